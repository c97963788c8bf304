"""Serving a ``transformers`` model folder: ``config.json`` and safetensors weights, as
``save_pretrained`` writes them (and ``python -m sdnet_trainer.export format=hf``), with its
``tokenizer.json`` when it has one.

The model is loaded with ``AutoModelForCausalLM.from_pretrained``: local files only, safetensors
only (no pickled ``.bin`` weights), no code from the folder (``trust_remote_code`` stays off). It
generates with its KV cache (:class:`~sdnet_trainer.serve.decoding.CausalLMDecoder`); its
end-of-sequence ids (``generation_config.json``, else ``config.json``) end every request. Text
prompts go through ``tokenizer.json``, with the special tokens its post-processor puts before a
text (a Llama's BOS) and none after; without one the server takes token ids only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from sdnet_trainer.checkpoint import MANIFEST
from sdnet_trainer.data.tokenizer import TextTokenizer, load_tokenizer
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.hf_causal_lm import (
    HFCausalLM,
    context_length,
    dtype_key,
    require_transformers,
)
from sdnet_trainer.serve.args import ServeArgs
from sdnet_trainer.serve.decoding import CausalLMDecoder
from sdnet_trainer.serve.errors import first_line
from sdnet_trainer.serve.language import Codec, LanguageModel, chat_renderer

logger = logging.getLogger(__name__)

CONFIG_JSON = "config.json"


def is_hf_folder(path: Path) -> bool:
    """A folder with a ``transformers`` config.json that is not a checkpoint of this project."""
    return path.is_dir() and (path / CONFIG_JSON).is_file() and not (path / MANIFEST).exists()


def load_hf_folder(args: ServeArgs, folder: Path, device: torch.device) -> LanguageModel:
    """The language model of ``folder`` on ``device``, ready for requests."""
    key = f"checkpoint={str(folder)!r}"
    if args.backend != "torch":
        raise ConfigError(
            f"backend={args.backend}: {key} is a transformers model folder, served with "
            f"backend=torch (its KV cache)"
        )
    if args.ema:
        raise ConfigError(f"ema=true: {key} is a transformers model folder, which has no EMA")
    transformers = require_transformers(f"{key} (a transformers model folder)")
    # fp32 on the CPU; on a GPU the dtype the folder was saved in.
    dtype: Any = torch.float32 if device.type == "cpu" else "auto"
    try:
        lm = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder),
            local_files_only=True,
            use_safetensors=True,
            **{dtype_key(transformers): dtype},
        )
    except Exception as err:  # transformers raises OSError, ValueError, its own errors
        raise ConfigError(
            f"{key}: transformers cannot load a causal LM from it: "
            f"{type(err).__name__}: {first_line(err)}"
        ) from None
    config = lm.config.to_dict()
    context = context_length(config)
    if context is None:
        raise ConfigError(f"{key}: {CONFIG_JSON} gives no context length (max_position_embeddings)")
    codec = _codec(folder)
    model = LanguageModel(
        HFCausalLM(lm).to(device).eval(),
        context=context,
        vocab_size=int(config["vocab_size"]),
        codec=codec,
        max_new_tokens=args.max_new_tokens,
        decoder=CausalLMDecoder(lm, device),
        stop_ids=eos_ids(lm),
        chat=chat_renderer(codec.tokenizer),
    )
    logger.info("serving %s: context %d, stop ids %s", key, context, list(model.stop_ids))
    return model


def eos_ids(lm: Any) -> list[int]:
    """The model's end-of-sequence token ids: its generation config's, else its config's."""
    for config in (getattr(lm, "generation_config", None), lm.config):
        found = getattr(config, "eos_token_id", None)
        if found is not None:
            return [found] if isinstance(found, int) else [int(i) for i in found]
    return []


class PrefixedCodec(Codec):
    """The folder's tokenizer, with the tokens its post-processor puts before a text (a Llama's
    BOS), as ``transformers``' tokenizer gives a prompt; nothing after it (an EOS would end
    it)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        super().__init__("tokenizer", tokenizer)
        plain = tokenizer.encode(["a"])[0]
        full = tokenizer.encode(["a"], add_special_tokens=True)[0]
        starts = [i for i in range(len(full)) if full[i : i + len(plain)] == plain]
        self.prefix = full[: starts[0]] if plain and starts else []

    def encode(self, text: str) -> list[int]:
        return [*self.prefix, *super().encode(text)]


def _codec(folder: Path) -> Codec:
    if (folder / "tokenizer.json").is_file():
        return PrefixedCodec(load_tokenizer(str(folder)))
    return Codec("ids")


__all__ = ["CONFIG_JSON", "eos_ids", "is_hf_folder", "load_hf_folder"]
