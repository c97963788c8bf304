"""``data=chat``: instruction tuning on conversations, the loss on the assistant's tokens only.

``data.root`` holds ``.jsonl`` files, one conversation per line:
``{"messages": [{"role": "system" | "user" | "assistant" | ..., "content": "..."}, ...]}``.
Each conversation is rendered with a chat template: the tokenizer's own (``chat_template`` of its
``tokenizer_config.json``) or a named one (``data.chat_template``: see ``TEMPLATES``), in
jinja2's sandbox, as ``transformers``' ``apply_chat_template`` renders it (a template is
untrusted input).

Which tokens are the assistant's: the conversation is rendered one message at a time, each
rendering a prefix of the next. An assistant message's text (its content and the template's
end-of-turn marker after it) is trained; everything else (system and user turns, the header
that opens the assistant's turn, ``add_generation_prompt``'s text) is a prompt, its targets
``IGNORE_INDEX`` (-100). Each piece is tokenized on its own, so the assistant's tokens are the
ones a model generates after the prompt. Conversations are separated by EOS (not trained) and
packed into windows like ``data=text`` (the token cache of ``data/token_cache.py`` keeps one
"trained" byte per token).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.text import (
    cache_folder,
    check_vocab,
    read_jsonl,
    source_files,
    split_windows,
)
from sdnet_trainer.data.token_cache import PackedTokens, Piece, open_cache
from sdnet_trainer.data.tokenizer import TOKENIZER_CONFIG, TextTokenizer, load_tokenizer
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

ASSISTANT = "assistant"
MESSAGES_KEY = "messages"
_CONVERSATIONS_PER_PIECE = 256

# Named templates for tokenizers without one (data.chat_template=NAME).
TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
        "message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}


def resolve_template(cfg: DataConfig, tokenizer: TextTokenizer) -> str:
    """The template text: ``data.chat_template``'s named one, or the tokenizer's own."""
    name = cfg.chat_template
    if name is not None:
        if name not in TEMPLATES:
            raise ConfigError(
                f"data.chat_template={name!r} is not a known template; choose one of "
                f"{sorted(TEMPLATES)}, or null for the tokenizer's own"
            )
        return TEMPLATES[name]
    if tokenizer.chat_template is None:
        raise ConfigError(
            f"data.tokenizer={cfg.tokenizer!r} has no chat_template (in its {TOKENIZER_CONFIG}); "
            f"name one with data.chat_template={'|'.join(sorted(TEMPLATES))}"
        )
    return tokenizer.chat_template


class ChatRenderer:
    """A template compiled in jinja2's immutable sandbox, rendering conversations into
    (text, trained) pieces."""

    def __init__(self, template: str, *, tokenizer: TextTokenizer, source: str) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, indent=indent, ensure_ascii=False
        )
        env.globals["raise_exception"] = raise_exception
        self.source = source
        self._template_error = TemplateError
        try:
            self.template = env.from_string(template)
        except TemplateError as err:
            raise ConfigError(f"{source}: the chat template does not compile: {err}") from err
        self.specials = {"bos_token": tokenizer.bos or "", "eos_token": tokenizer.eos or ""}

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
        return str(
            self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.specials
            )
        )

    def pieces(
        self, messages: list[dict[str, str]], *, where: str, add_generation_prompt: bool = False
    ) -> list[tuple[str, bool]]:
        """The conversation as (text, trained) pieces whose concatenation is its rendering; with
        ``add_generation_prompt``, the header that opens the assistant's reply last (a served
        chat's prompt: the pieces training tokenized, so the reply starts where it learned to)."""
        pieces: list[tuple[str, bool]] = []
        done = ""

        def add(text: str, trained: bool) -> None:
            nonlocal done
            if not text.startswith(done):
                raise ConfigError(
                    f"{where}: {self.source} renders the first {len(pieces)} pieces of this "
                    f"conversation as text that the longer conversation does not begin with, so "
                    f"the assistant's tokens cannot be told apart; use another template "
                    f"(data.chat_template={'|'.join(sorted(TEMPLATES))})"
                )
            if len(text) > len(done):
                pieces.append((text[len(done) :], trained))
            done = text

        try:
            for k, message in enumerate(messages):
                assistant = message["role"] == ASSISTANT
                if assistant:  # the header that opens the assistant's turn is prompt
                    add(self.render(messages[:k], add_generation_prompt=True), False)
                add(self.render(messages[: k + 1], add_generation_prompt=False), assistant)
            if add_generation_prompt:
                add(self.render(messages, add_generation_prompt=True), False)
        except self._template_error as err:
            raise ConfigError(f"{where}: {self.source} refuses this conversation: {err}") from err
        return pieces


def _messages(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    messages = record.get(MESSAGES_KEY)
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: no {MESSAGES_KEY!r} list of messages")
    for i, message in enumerate(messages):
        ok = isinstance(message, dict) and all(
            isinstance(message.get(key), str) for key in ("role", "content")
        )
        if not ok:
            raise ConfigError(
                f"{where}: message {i} is not an object with string 'role' and 'content'"
            )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def encode_conversations(
    files: list[Path], tokenizer: TextTokenizer, renderer: ChatRenderer, *, eos: int
) -> Iterator[Piece]:
    """Token pieces of every conversation: ids, trained flags (1 on the assistant's tokens),
    an EOS after each (not trained; left out where the rendering already ends with EOS)."""
    ids: list[int] = []
    trained: list[int] = []
    done = 0
    count = 0
    for file in files:
        if file.suffix != ".jsonl":
            raise ConfigError(f"data.root: {file}: data.name='chat' reads .jsonl files")
        for number, record, size in read_jsonl(file):
            where = f"data.root: {file}:{number}"
            pieces = renderer.pieces(_messages(record, where), where=where)
            for piece_ids, (_, flag) in zip(tokenizer.encode([text for text, _ in pieces]), pieces):
                ids += piece_ids
                trained += [int(flag)] * len(piece_ids)
            if not ids or ids[-1] != eos:
                ids.append(eos)
                trained.append(0)
            done += size
            count += 1
            if count % _CONVERSATIONS_PER_PIECE == 0:
                yield ids, trained, done
                ids, trained, done = [], [], 0
    if ids:
        yield ids, trained, done


def build_chat(cfg: DataConfig) -> tuple[PackedTokens, PackedTokens]:
    """The (train, val) pair of ``data=chat``: packed conversations from the token cache."""
    if cfg.tokenizer is None:
        raise ConfigError(
            "data.tokenizer is not set: data.name='chat' renders conversations with a "
            "tokenizer's chat template (data.tokenizer=PATH)"
        )
    tokenizer = load_tokenizer(cfg.tokenizer)
    check_vocab(cfg, tokenizer)
    eos = tokenizer.require_eos("data.name='chat'")
    template = resolve_template(cfg, tokenizer)
    source = (
        f"data.chat_template={cfg.chat_template}"
        if cfg.chat_template
        else f"the chat template of data.tokenizer={cfg.tokenizer!r}"
    )
    renderer = ChatRenderer(template, tokenizer=tokenizer, source=source)
    root, files = source_files(cfg, (".jsonl",))
    settings = {"kind": "chat", "tokenizer": tokenizer.fingerprint, "template": template}
    cache = open_cache(
        root=root,
        sources=files,
        folder=cache_folder(cfg, root),
        settings=settings,
        vocab_size=tokenizer.vocab_size,
        with_trained=True,
        encode=lambda: encode_conversations(files, tokenizer, renderer, eos=eos),
    )
    logger.info(
        "chat data: %d of %d tokens are the assistant's (trained)",
        cache.meta["trained_tokens"],
        cache.length,
    )
    return split_windows(cfg, cache, mask_eos=None)
