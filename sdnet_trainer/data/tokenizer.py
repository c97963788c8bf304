"""``data.tokenizer=PATH``: the text tokenizer of ``data=text`` and ``data=chat``.

``PATH`` is one of:

- a ``tokenizer.json`` (a fast tokenizer, read with Hugging Face ``tokenizers``), with the
  ``tokenizer_config.json`` beside it when there is one;
- a folder holding ``tokenizer.json`` (and usually ``tokenizer_config.json``), as
  ``transformers``' ``save_pretrained`` writes it;
- a Hugging Face Hub repository id that is no local path (``org/name``): its ``tokenizer.json``
  and ``tokenizer_config.json``, downloaded into the Hugging Face cache;
- a tiktoken BPE file (lines of a base64 token and its rank; Llama 3's ``tokenizer.model`` is
  one), read with ``tiktoken``.

BOS, EOS and the chat template come from the tokenizer's own ``tokenizer_config.json``
(``bos_token``, ``eos_token``, ``chat_template``); without one, EOS is the first of the usual
end-of-text tokens the vocabulary has. The files are untrusted input: anything that cannot be
read as a tokenizer is one :class:`~sdnet_trainer.errors.ConfigError` naming ``data.tokenizer``
and the file, and the chat template is rendered in jinja2's sandbox (see ``data/chat.py``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
INSTALL_HINT = "pip install 'sdnet_trainer[llm]'"

# A Hugging Face Hub repository id ("gpt2", "org/name"), for a data.tokenizer that is no local path.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_FILE_SUFFIXES = (".json", ".model", ".tiktoken")  # a missing file, not a Hub id
# End-of-text tokens looked up when no tokenizer_config.json names one (GPT-2/NeoX, Llama 3,
# SentencePiece-style, Gemma).
_EOS_GUESSES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
# Llama 3's split pattern, also the one of OpenAI's cl100k_base: tiktoken BPE files hold only
# the merges, not how text is split before them.
_TIKTOKEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's tiktoken file holds 128,000 merges; its 256 special tokens follow them.
_LLAMA3_MERGES = 128_000
_LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
_LLAMA3_SPECIALS += [
    f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(_LLAMA3_SPECIALS) + 2)
]


class TextTokenizer:
    """One interface over a ``tokenizers.Tokenizer`` or a ``tiktoken.Encoding``: ids of texts,
    the vocabulary size, BOS/EOS ids and their strings, the chat template, and a fingerprint of
    the files it was read from (the token cache's key)."""

    def __init__(
        self,
        backend: Any,
        *,
        source: str,
        fingerprint: str,
        vocab_size: int,
        bos: str | None,
        eos: str | None,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.source = source
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.chat_template = chat_template
        self.bos, self.bos_id = self._special(bos, "bos_token")
        self.eos, self.eos_id = self._special(eos, "eos_token")

    def _special(self, token: str | None, key: str) -> tuple[str | None, int | None]:
        if token is None:
            return None, None
        ids = self.encode([token])[0]
        if len(ids) != 1:
            raise ConfigError(
                f"data.tokenizer={self.source!r}: its {key} {token!r} is not one token of its "
                f"vocabulary (it encodes to {ids})"
            )
        return token, ids[0]

    def encode(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        """Each text's ids; special tokens written in the text (a chat template's markers) are
        those tokens. No BOS/EOS is added (the callers place them) unless ``add_special_tokens``
        asks for those a ``tokenizer.json``'s post-processor puts around every text (a tiktoken
        file has none)."""
        if _is_tiktoken(self.backend):
            return self.backend.encode_batch(list(texts), allowed_special="all")
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; ``skip_special_tokens`` leaves out BOS, EOS, chat markers."""
        if _is_tiktoken(self.backend):
            if skip_special_tokens:
                ids = [i for i in ids if not self.backend.is_special_token(i)]
            return str(self.backend.decode(list(ids)))
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def require_eos(self, what: str) -> int:
        """EOS's id, or a clear error: ``what`` (a data set) separates documents with it."""
        if self.eos_id is None:
            raise ConfigError(
                f"data.tokenizer={self.source!r} has no EOS token (no eos_token in "
                f"{TOKENIZER_CONFIG}, none of {list(_EOS_GUESSES)} in its vocabulary); {what} "
                f"separates documents with it: add eos_token to {TOKENIZER_CONFIG}"
            )
        return self.eos_id

    def __repr__(self) -> str:
        return (
            f"TextTokenizer({self.source!r}, vocab_size={self.vocab_size}, bos={self.bos!r}, "
            f"eos={self.eos!r})"
        )


def _is_tiktoken(backend: Any) -> bool:
    return type(backend).__module__.startswith("tiktoken")


def load_tokenizer(path: str) -> TextTokenizer:
    """The tokenizer ``data.tokenizer`` names (see the module's docstring)."""
    file = Path(path).expanduser()
    if file.is_dir():
        folder, file = file, file / TOKENIZER_JSON
        if not file.is_file():
            raise ConfigError(
                f"data.tokenizer={path!r} is a folder without {TOKENIZER_JSON} (a fast "
                f"tokenizer's file, which transformers' save_pretrained writes)"
            )
    elif file.is_file():
        folder = file.parent
    elif _HUB_NAME.fullmatch(path) and not path.endswith(_FILE_SUFFIXES):
        file = _from_hub(path)
        folder = file.parent
    else:
        raise ConfigError(f"data.tokenizer={path!r} does not exist")
    try:
        raw = file.read_bytes()
    except OSError as err:
        raise ConfigError(f"data.tokenizer={path!r}: {file} cannot be read: {err}") from err
    config, config_bytes = _read_config(path, folder / TOKENIZER_CONFIG)
    digest = hashlib.sha256(raw + b"\0" + config_bytes).hexdigest()
    if raw.lstrip()[:1] == b"{":
        backend, vocab = _hf_backend(path, file)
    else:
        backend, vocab = _tiktoken_backend(path, file, raw)
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    tokenizer = TextTokenizer(
        backend,
        source=path,
        fingerprint=digest,
        vocab_size=vocab,
        bos=_token_text(config.get("bos_token")) or _guess_bos(backend),
        eos=_token_text(config.get("eos_token")) or _guess_eos(backend),
        chat_template=template if isinstance(template, str) else None,
    )
    logger.info("tokenizer %s", tokenizer)
    return tokenizer


def _from_hub(name: str) -> Path:
    """``tokenizer.json`` of the Hub repository ``name`` (and its ``tokenizer_config.json`` beside
    it, where it has one), downloaded into the Hugging Face cache: read as any local file."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as err:
        raise ConfigError(
            f"data.tokenizer={name!r} is not a local path; fetching it from the Hugging Face Hub "
            f"needs the `huggingface_hub` package: {INSTALL_HINT}"
        ) from err
    try:
        file = Path(hf_hub_download(name, TOKENIZER_JSON))
    except Exception as err:  # not found, offline, gated, ...: hub errors of many types
        raise ConfigError(
            f"data.tokenizer={name!r} is not a local file or folder, and its {TOKENIZER_JSON} "
            f"cannot be fetched from the Hugging Face Hub: {type(err).__name__}: {err}"
        ) from err
    try:
        hf_hub_download(name, TOKENIZER_CONFIG)
    except Exception:  # optional: BOS/EOS then come from the vocabulary
        logger.info("data.tokenizer=%r: no %s on the Hub", name, TOKENIZER_CONFIG)
    return file


def _read_config(path: str, file: Path) -> tuple[dict[str, Any], bytes]:
    """``tokenizer_config.json`` (a JSON object) and its bytes, or ({}, b"") where there is none."""
    if not file.is_file():
        return {}, b""
    try:
        raw = file.read_bytes()
        config = json.loads(raw)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"data.tokenizer={path!r}: {file} is not readable JSON: {type(err).__name__}: {err}"
        ) from err
    if not isinstance(config, dict):
        raise ConfigError(f"data.tokenizer={path!r}: {file} is not a JSON object")
    return config, raw


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _guess_bos(backend: Any) -> str | None:
    """Llama 3's BOS, for its tiktoken file (which comes without a tokenizer_config.json)."""
    return "<|begin_of_text|>" if _has_token(backend, "<|begin_of_text|>") else None


def _has_token(backend: Any, token: str) -> bool:
    """Whether ``token`` is one token of the vocabulary, also as text (a word-level vocabulary
    may hold ``</s>`` while its pre-tokenizer splits the text ``</s>``: no usable EOS)."""
    if _is_tiktoken(backend):
        return token in backend.special_tokens_set
    found = backend.token_to_id(token)
    return found is not None and backend.encode(token, add_special_tokens=False).ids == [found]


def _guess_eos(backend: Any) -> str | None:
    return next((token for token in _EOS_GUESSES if _has_token(backend, token)), None)


def _hf_backend(path: str, file: Path) -> tuple[Any, int]:
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise ConfigError(
            f"data.tokenizer={path!r} needs the Hugging Face `tokenizers` package: {INSTALL_HINT}"
        ) from err
    try:
        backend = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises its own Exception type for any bad file
        raise ConfigError(
            f"data.tokenizer={path!r}: {file} is not a tokenizer.json that Hugging Face "
            f"tokenizers can read: {err}"
        ) from err
    return backend, backend.get_vocab_size(with_added_tokens=True)


def _tiktoken_backend(path: str, file: Path, raw: bytes) -> tuple[Any, int]:
    try:
        import tiktoken
    except ImportError as err:
        raise ConfigError(
            f"data.tokenizer={path!r} looks like a tiktoken BPE file, which needs the `tiktoken` "
            f"package: {INSTALL_HINT}"
        ) from err
    ranks: dict[bytes, int] = {}
    where = "its encoding"
    try:
        lines = raw.decode("ascii").splitlines()
        for number, line in enumerate(lines, start=1):
            where = f"line {number}"
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (UnicodeDecodeError, ValueError) as err:  # binascii.Error is a ValueError
        raise ConfigError(
            f"data.tokenizer={path!r}: {file} is neither a tokenizer.json nor a tiktoken BPE file "
            f"(lines of a base64 token and its rank); {where}: {err}"
        ) from err
    if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(
            f"data.tokenizer={path!r}: {file} is not a tiktoken BPE file: its ranks are not "
            f"0..N-1 each once"
        )
    names = _LLAMA3_SPECIALS if len(ranks) == _LLAMA3_MERGES else ["<|endoftext|>"]
    specials = {name: len(ranks) + i for i, name in enumerate(names)}
    try:
        backend = tiktoken.Encoding(
            name=file.name,
            pat_str=_TIKTOKEN_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
    except Exception as err:  # tiktoken's own checks (e.g. a rank missing its byte pieces)
        raise ConfigError(
            f"data.tokenizer={path!r}: {file} is not a usable BPE file: {err}"
        ) from err
    return backend, backend.n_vocab
