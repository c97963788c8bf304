"""Language models: a prompt in, its continuation out.

A prompt is text or token ids, as the training data's tokenizer says: UTF-8 bytes for byte-level
data (``data=text``, text shards, ``data=hf`` without a tokenizer), the Hugging Face tokenizer of
``data.tokenizer``, or token ids alone (``data=tokens``, whose language has no text).

Generation feeds the model the whole sequence again for each new token (the models here keep no
cache), cropped to the model's context from the left once it is longer. ``temperature=0`` picks
the most likely token (greedy); above 0 the token is drawn from ``softmax(logits / temperature)``
with the request's ``seed`` (a random one when none is given). A batch runs its prompts of equal
length together (no padding, so each row computes what it would alone).
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import torch

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.hf import load_tokenizer
from sdnet_trainer.serve.errors import InputError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

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

    def __init__(self, kind: str, tokenizer: Tokenizer | None = None) -> None:
        self.kind = kind  # bytes | tokenizer | ids
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        if self.tokenizer is not None:
            # No special tokens: a prompt is the start of a text to continue, and an end-of-text
            # token appended here would end it. Send ids to put them in.
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
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
            return str(self.tokenizer.decode(ids))
        return None


def codec(data: DataConfig) -> Codec:
    """The tokenization of ``data``: its Hugging Face tokenizer, bytes, or none (ids only)."""
    if data.tokenizer is not None:
        return Codec("tokenizer", load_tokenizer(data.tokenizer))
    if data.name in BYTE_DATASETS:
        return Codec("bytes")
    return Codec("ids")


@dataclass(frozen=True)
class Job:
    """One request's generation."""

    tokens: list[int]
    max_new_tokens: int
    temperature: float
    seed: int | None


class LanguageModel:
    """A causal language model: prompts become jobs (:meth:`job`), a batch of jobs becomes the
    new tokens of each (:meth:`run`)."""

    kind = "language"

    def __init__(
        self, runner: Runner, *, context: int, vocab_size: int, codec: Codec, max_new_tokens: int
    ) -> None:
        self.runner = runner
        self.context = context
        self.vocab_size = vocab_size
        self.codec = codec
        self.max_new_tokens = max_new_tokens

    def job(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int | None,
        temperature: float,
        seed: int | None,
    ) -> Job:
        """The request as a job, or an InputError (422) naming what does not fit;
        ``max_new_tokens`` None: DEFAULT_NEW_TOKENS, or this server's limit if lower."""
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
        if max_new_tokens is None:
            max_new_tokens = min(DEFAULT_NEW_TOKENS, self.max_new_tokens)
        if max_new_tokens > self.max_new_tokens:
            raise InputError(
                422,
                f"max_new_tokens: {max_new_tokens} is more than this server generates per "
                f"request ({self.max_new_tokens})",
            )
        if temperature > 0 and seed is None:
            seed = secrets.randbits(63)
        return Job(tokens, max_new_tokens, float(temperature), seed)

    def run(self, jobs: list[Job]) -> list[list[int]]:
        """The new tokens of every job, in order: jobs whose prompts have the same length
        generate together, one forward pass per token."""
        results: list[list[int]] = [[] for _ in jobs]
        groups: dict[int, list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            groups[len(job.tokens)].append(i)
        for length, rows in groups.items():
            generated = self._generate([jobs[i] for i in rows])
            for row, i in enumerate(rows):
                results[i] = generated[row, length : length + jobs[i].max_new_tokens].tolist()
        return results

    def _generate(self, jobs: list[Job]) -> torch.Tensor:
        ids = torch.tensor([job.tokens for job in jobs], dtype=torch.int64)
        temperatures = [job.temperature for job in jobs]
        generators = [
            torch.Generator().manual_seed(job.seed) if job.seed is not None else None
            for job in jobs
        ]
        for _ in range(max(job.max_new_tokens for job in jobs)):
            logits = self.runner(ids[:, -self.context :])[:, -1, :].float()
            step = [
                _pick(logits[row], temperatures[row], generators[row]) for row in range(len(jobs))
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
        }


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):  # a temperature so small that it overflows
        return int(logits.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))
