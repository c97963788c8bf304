"""Language models: a prompt in, its continuation out.

A prompt is text or token ids, as the training data's tokenizer says: UTF-8 bytes for byte-level
data (``data=text``, text shards, ``data=hf`` without a tokenizer), the tokenizer of
``data.tokenizer`` (a ``tokenizer.json``, a folder of one, or a tiktoken file), or token ids
alone (``data=tokens``, whose language has no text).

Generation: a model with a decoder (:mod:`sdnet_trainer.serve.decoding`: ``transformers`` models,
the project's ``hf_causal_lm`` and Llama) runs a whole batch together with a KV cache, prompts of
different lengths left-padded, and refuses a prompt plus ``max_new_tokens`` longer than its
context. Other models (the project's GPT, ONNX graphs) keep no cache: the whole sequence is fed
again for each new token, cropped to the model's context from the left once it is longer, and a
batch runs its prompts of equal length together (no padding, so each row computes what it would
alone). Decoding, either way: ``temperature=0`` picks the most likely token (greedy); above 0 the
token is drawn from ``softmax(logits / temperature)``, cut to its ``top_p`` nucleus, with the
request's ``seed`` (a random one when none is given). A job ends at its ``max_new_tokens`` or at a
stop token (the model's end-of-sequence ids and the request's ``stop`` ids), which is returned
last.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.chat import TEMPLATES, ChatRenderer
from sdnet_trainer.data.tokenizer import TextTokenizer, load_tokenizer
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.serve.decoding import Decoder, Job, generate, pick, until_stop
from sdnet_trainer.serve.errors import InputError

Runner = Callable[[torch.Tensor], torch.Tensor]
Prompt = Union[str, list[int]]

# The data sets whose tokens are UTF-8 bytes when data.tokenizer is null.
BYTE_DATASETS = ("text", "hf", "shards")
# The tokens a request generates when it does not say (at most the server's max_new_tokens).
DEFAULT_NEW_TOKENS = 32
# The most characters a tokenizer's token is taken to cover on average, to refuse a text prompt
# that cannot fit in the context before tokenizing all of it (a body may hold 16 MB of text).
# Tokens of subword tokenizers average a few characters; a prompt above this is refused even if
# its tokens would have fit.
MAX_CHARS_PER_TOKEN = 64


class Codec:
    """Text to token ids and back, as the training data tokenized it."""

    def __init__(self, kind: str, tokenizer: TextTokenizer | None = None) -> None:
        self.kind = kind  # bytes | tokenizer | ids
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        if self.tokenizer is not None:
            # No special tokens: a prompt is the start of a text to continue, and an end-of-text
            # token appended here would end it. Send ids to put them in.
            return list(self.tokenizer.encode([text])[0])
        raise InputError(
            422, "prompt: this model's data has no text form (data=tokens): send token ids"
        )

    def max_chars(self, tokens: int) -> int:
        """The longest text (in characters) that may encode to at most ``tokens`` tokens: every
        character is at least one UTF-8 byte, so one byte token."""
        return tokens if self.kind == "bytes" else tokens * MAX_CHARS_PER_TOKEN

    def decode(self, ids: list[int]) -> str | None:
        if self.kind == "bytes":
            return bytes(ids).decode("utf-8", errors="replace")
        if self.tokenizer is not None:
            return str(self.tokenizer.decode(ids, skip_special_tokens=True))
        return None


def codec(data: DataConfig) -> Codec:
    """The tokenization of ``data``: its tokenizer (a ``tokenizer.json``, a folder, a tiktoken
    file: :func:`~sdnet_trainer.data.tokenizer.load_tokenizer`, as training read it), bytes, or
    none (ids only)."""
    if data.tokenizer is not None:
        return Codec("tokenizer", load_tokenizer(data.tokenizer))
    if data.name in BYTE_DATASETS:
        return Codec("bytes")
    return Codec("ids")


def chat_renderer(tokenizer: TextTokenizer | None, named: str | None = None) -> ChatRenderer | None:
    """The chat template a served model's conversations are rendered with: the one its training
    named (``data.chat_template``), else its tokenizer's own (``tokenizer_config.json``); None
    without either."""
    if tokenizer is None:
        return None
    template = TEMPLATES.get(named) if named is not None else tokenizer.chat_template
    if template is None:
        return None
    source = f"data.chat_template={named}" if named else "the tokenizer's chat template"
    return ChatRenderer(template, tokenizer=tokenizer, source=source)


class LanguageModel:
    """A causal language model: prompts become jobs (:meth:`job`), a batch of jobs becomes the
    new tokens of each (:meth:`run`)."""

    kind = "language"

    def __init__(
        self,
        runner: Runner,
        *,
        context: int,
        vocab_size: int,
        codec: Codec,
        max_new_tokens: int,
        decoder: Decoder | None = None,
        stop_ids: Sequence[int] = (),
        chat: ChatRenderer | None = None,
    ) -> None:
        self.runner = runner
        self.context = context
        self.vocab_size = vocab_size
        self.codec = codec
        self.max_new_tokens = max_new_tokens
        self.decoder = decoder  # None: the runner, no cache (see the module docstring)
        self.stop_ids = tuple(stop_ids)  # the model's end-of-sequence ids
        self.chat = chat  # renders /v1/chat/completions' messages; None: no chat template

    def job(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int | None,
        temperature: float,
        seed: int | None,
        top_p: float = 1.0,
        stop: Sequence[int] = (),
        top_k: int = 0,
        default_new_tokens: int = DEFAULT_NEW_TOKENS,
        limit_key: str = "max_new_tokens",
    ) -> Job:
        """The request as a job, or an InputError (422) naming what does not fit;
        ``max_new_tokens`` None: ``default_new_tokens``, or this server's limit if lower (and,
        with a decoder, what the context leaves after the prompt); ``limit_key``: the request's
        name for it, which a refusal names."""
        if isinstance(prompt, str):
            if self.codec.kind != "ids" and len(prompt) > self.codec.max_chars(self.context):
                raise InputError(
                    422,
                    f"prompt: {len(prompt)} characters is longer than the model's context of "
                    f"{self.context} tokens can hold",
                )
            tokens = self.codec.encode(prompt)
        else:
            tokens = list(prompt)
        if not tokens:
            raise InputError(422, "prompt: empty; it needs at least one token")
        if len(tokens) > self.context:
            raise InputError(
                422,
                f"prompt: {len(tokens)} tokens is longer than the model's context of "
                f"{self.context} tokens",
            )
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InputError(
                422, f"prompt: token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}"
            )
        bad = next((t for t in stop if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InputError(
                422, f"stop: token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}"
            )
        # With a cache the sequence cannot slide past the context: the prompt and what it
        # generates must fit in it.
        room = self.context - len(tokens) if self.decoder is not None else None
        if max_new_tokens is None:
            max_new_tokens = min(
                default_new_tokens, self.max_new_tokens, *([room] if room is not None else [])
            )
        if max_new_tokens > self.max_new_tokens:
            raise InputError(
                422,
                f"{limit_key}: {max_new_tokens} is more than this server generates per "
                f"request ({self.max_new_tokens})",
            )
        if room is not None and max_new_tokens > room:
            raise InputError(
                422,
                f"{limit_key}: {max_new_tokens} new tokens after a prompt of {len(tokens)} "
                f"tokens is more than the model's context of {self.context} tokens holds",
            )
        if temperature > 0 and seed is None:
            seed = secrets.randbits(63)
        return Job(
            tokens, max_new_tokens, float(temperature), seed, float(top_p), tuple(stop), top_k
        )

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation's prompt tokens: its pieces, rendered by the chat template and
        tokenized one by one as training tokenized them, up to the assistant's opened reply."""
        if self.chat is None or self.codec.tokenizer is None:
            raise InputError(
                400,
                "messages: this model has no chat template (none in its tokenizer's "
                "tokenizer_config.json, and it did not train with data.chat_template): send "
                "text to /v1/completions",
            )
        chars = sum(len(message["content"]) for message in messages)
        if chars > self.codec.max_chars(self.context):
            raise InputError(
                422,
                f"messages: {chars} characters is longer than the model's context of "
                f"{self.context} tokens can hold",
            )
        try:
            pieces = self.chat.pieces(messages, where="messages", add_generation_prompt=True)
        except ConfigError as err:
            raise InputError(422, str(err)) from None
        encoded = self.codec.tokenizer.encode([text for text, _ in pieces])
        return [token for ids in encoded for token in ids]

    def run(self, jobs: list[Job]) -> list[list[int]]:
        """The new tokens of every job, in order: all together with a decoder; else jobs whose
        prompts have the same length generate together, one forward pass per token."""
        if self.decoder is not None:
            return generate(self.decoder, jobs, stop_ids=self.stop_ids)
        results: list[list[int]] = [[] for _ in jobs]
        groups: dict[int, list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            groups[len(job.tokens)].append(i)
        for length, rows in groups.items():
            generated = self._generate([jobs[i] for i in rows])
            for row, i in enumerate(rows):
                new = generated[row, length : length + jobs[i].max_new_tokens].tolist()
                results[i] = until_stop(new, {*self.stop_ids, *jobs[i].stop})
        return results

    def _generate(self, jobs: list[Job]) -> torch.Tensor:
        ids = torch.tensor([job.tokens for job in jobs], dtype=torch.int64)
        generators = [
            torch.Generator().manual_seed(job.seed) if job.seed is not None else None
            for job in jobs
        ]
        for _ in range(max(job.max_new_tokens for job in jobs)):
            logits = self.runner(ids[:, -self.context :])[:, -1, :].float()
            step = [
                pick(logits[row], job.temperature, job.top_p, generators[row])
                for row, job in enumerate(jobs)
            ]
            ids = torch.cat([ids, torch.tensor(step, dtype=torch.int64)[:, None]], dim=1)
        return ids

    def text(self, tokens: list[int]) -> str | None:
        return self.codec.decode(tokens)

    def info(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "context": self.context,
            "vocab_size": self.vocab_size,
            "prompt": "text or token ids" if self.codec.kind != "ids" else "token ids",
            "tokenizer": self.codec.kind,
            "max_new_tokens": self.max_new_tokens,
            "kv_cache": self.decoder is not None,
            "stop_ids": list(self.stop_ids),
            "chat_template": self.chat is not None,
        }
