"""Hugging Face Llama checkpoints in and out: config.json <-> ``model.llama`` (kept as data), and
``model.weights=hf:PATH`` read into a model that may be sharded.

A Hugging Face Llama folder holds ``config.json`` and its weights, ``model.safetensors`` or
shards named by ``model.safetensors.index.json``. The tensor names are the family's state-dict
adapter's (``state_dict_adapter.py``: the same rotary layout as ``transformers``, so no
permutation).

The folder is untrusted input (``models/hf_folder.py`` reads it): :func:`check_hf_weights`
compares the model built on the meta device, before anything is allocated, with what the files'
headers declare (every name, shape and dtype; a tied output layer against the stored one; the
``torch_dtype`` field). :func:`load_hf_weights` fills the model *after* it is sharded: it checks
again, then DCP's Hugging Face reader reads into the adapter's state of the model
(:func:`~sdnet_trainer.models.hf_folder.read_folder`), each rank only the elements of its shards
(a DTensor's local shard of FSDP and/or tensor parallelism, the whole tensor where it is not
sharded, nothing for the units a pipeline split removed). No rank reads the whole model.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.hf_folder import (
    CONFIG_FILE,
    StoredTensor,
    check_dtype_field,
    check_stored,
    open_safetensors,
    read_folder,
    read_hf_config,
    stored_tensors,
)
from sdnet_trainer.models.llama.state_dict_adapter import HF_NAMES, from_hf_name, to_hf, to_hf_name
from sdnet_trainer.models.lora_names import base_state

logger = logging.getLogger(__name__)

# Stored by some older exports, recomputed here: skipped when found.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# model.llama's keys <- config.json's (the rest of model.llama is built from several keys).
CONFIG_KEYS: tuple[tuple[str, str], ...] = (
    ("vocab_size", "vocab_size"),
    ("seq_len", "max_position_embeddings"),
    ("dim", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("hidden_dim", "intermediate_size"),
)
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# ---------------------------------------------------------------------- config.json


def llama_sizes_from_hf(config: dict[str, Any], *, source: str) -> dict[str, Any]:
    """``model.llama``'s keys from a Hugging Face config (a dict of config.json); a config this
    family cannot represent is a ConfigError naming ``source`` and the field."""

    def field(name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = config.get(name, default)
        if value is None or isinstance(value, bool) or not isinstance(value, kind):
            if value is None and default is None and name not in config:
                raise ConfigError(f"{source}: field {name!r} is missing")
            raise ConfigError(f"{source}: field {name!r} is {value!r}, expected {kind}")
        return value

    model_type = config.get("model_type")
    if model_type != "llama":
        raise ConfigError(
            f"{source}: field 'model_type' is {model_type!r}; model.name=llama reads Llama "
            f"checkpoints (model_type 'llama'); for other architectures use model=hf_causal_lm"
        )
    sizes = {ours: field(theirs, int) for ours, theirs in CONFIG_KEYS}
    heads = sizes["n_heads"]
    sizes["n_kv_heads"] = field("num_key_value_heads", int, heads)
    sizes["norm_eps"] = float(field("rms_norm_eps", (int, float), 1e-6))
    sizes["tie_embeddings"] = bool(config.get("tie_word_embeddings", False))
    expect = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    for name, wanted in expect.items():
        if config.get(name, wanted) != wanted:
            raise ConfigError(
                f"{source}: field {name!r} is {config[name]!r}; the Llama family here has "
                f"{name}={wanted!r}"
            )
    if config.get("attention_dropout", 0.0) not in (0, 0.0):
        raise ConfigError(
            f"{source}: field 'attention_dropout' is {config['attention_dropout']!r}; the Llama "
            f"family here has no dropout (0.0)"
        )
    head_dim = config.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim * heads != sizes["dim"]):
        raise ConfigError(
            f"{source}: field 'head_dim' is {head_dim!r}; the Llama family here has head_dim = "
            f"hidden_size / num_attention_heads = {sizes['dim']} / {heads}"
        )
    sizes["rope_theta"], sizes["rope_scaling"] = _rope(config, source)
    return sizes


def _rope(config: dict[str, Any], source: str) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) from transformers 5's ``rope_parameters`` or the older ``rope_theta`` and
    ``rope_scaling``."""
    params = config.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = config.get("rope_scaling") or {}
        field = "rope_scaling"
        params = {**params, "rope_theta": config.get("rope_theta", 10000.0)}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: field {field!r} is {params!r}, expected an object")
    theta = params.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: field 'rope_theta' is {theta!r}, expected a number > 0")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(
            f"{source}: field '{field}.rope_type' is {rope_type!r}; the Llama family here has "
            f"rotary scaling 'default' (none) or 'llama3'"
        )
    scaling: dict[str, Any] = {"rope_type": rope_type}
    if rope_type == "llama3":
        for name in _ROPE_KEYS:
            value = params.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(
                    f"{source}: field '{field}.{name}' is {value!r}, expected a number > 0"
                )
            scaling[name] = int(value) if name.startswith("original") else float(value)
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise ConfigError(
                f"{source}: field '{field}.high_freq_factor' must exceed low_freq_factor"
            )
    return float(theta), scaling


def hf_config_of(llama: nn.Module, *, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for ``model`` (a :class:`~sdnet_trainer.models.llama.Llama`), as
    ``transformers.LlamaConfig`` reads it (the ``rope_theta`` / ``rope_scaling`` spelling that
    transformers 4 and 5 both read)."""
    model: Any = llama  # its sizes are plain attributes
    sizes = {theirs: getattr(model, ours) for ours, theirs in CONFIG_KEYS}
    scaling = dict(model.rope_scaling)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **sizes,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.dim // model.n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": None if scaling.get("rope_type") == "default" else scaling,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# ---------------------------------------------------------------------- the weight files


def check_hf_weights(model: nn.Module, folder: Path) -> dict[str, StoredTensor]:
    """The Llama ``model`` (built on the meta device: nothing allocated yet; whole, or one
    pipeline stage's part) against what the folder's headers declare: every tensor it needs,
    none it has no place for, each of its shape and of a floating-point dtype, a tied output
    layer against a stored one, config.json's ``torch_dtype``. The stored tensors."""
    stored = stored_tensors(folder)
    expected = {to_hf_name(name): tuple(t.shape) for name, t in base_state(model).items()}
    tied = bool(getattr(model, "tie_embeddings", False))
    head = to_hf_name("head.weight")
    # Names of the whole model (a pipeline stage holds fewer), to tell foreign tensors apart.
    layers = max(int(getattr(model, "n_layers", 0)), 1)
    known = {hf.replace("{i}", str(i)) for _, hf in HF_NAMES for i in range(layers)}
    known |= {name for name in stored if _IGNORED.fullmatch(name)}
    what = "the Llama of its config.json"
    check_stored(expected, stored, folder, optional=[head] if tied else [], known=known, what=what)
    source = f"model.weights=hf:{folder}: {CONFIG_FILE}"
    if tied and head in stored and to_hf_name("embed.tok.weight") in stored:
        check_tied(folder, stored, source)
    check_dtype_field(read_hf_config(folder, key="model.weights"), stored, source)
    return stored


def check_tied(folder: Path, stored: dict[str, StoredTensor], source: str) -> None:
    """``tie_word_embeddings``: the output layer is the embedding. Some exports store it under
    both names; the two must then hold the same values (compared in blocks of rows)."""
    embed, head = to_hf_name("embed.tok.weight"), to_hf_name("head.weight")
    rows, width = stored[embed].shape[0], max(stored[embed].shape[1], 1)
    block = max(1, (16 << 20) // width)
    with (
        open_safetensors(folder, stored[embed].file) as fe,
        open_safetensors(folder, stored[head].file) as fh,
    ):
        ours, theirs = fe.get_slice(embed), fh.get_slice(head)
        for start in range(0, rows, block):
            rows_e = ours[start : start + block].float()
            rows_h = theirs[start : start + block].float()
            if not torch.equal(rows_e, rows_h):
                raise ConfigError(
                    f"{source}: field 'tie_word_embeddings' is true, but "
                    f"{folder / stored[head].file} stores {head} with other values than {embed} "
                    f"(from row {start}): the output layer would not be the stored one"
                )


def load_hf_weights(model: nn.Module, folder: Path) -> None:
    """Fill every parameter of ``model`` (a Llama, possibly sharded or pruned to pipeline stages)
    this rank holds from the Hugging Face folder, each from the elements of its file it holds;
    checked first (:func:`check_hf_weights`)."""
    stored = check_hf_weights(model, folder)
    state = to_hf(base_state(model), tied=bool(getattr(model, "tie_embeddings", False)))
    read = read_folder(state, folder, stored)
    logger.info(
        "loaded %d tensors from %s (%.1f MB read by this rank)",
        len(state.tensors),
        folder,
        read / 2**20,
    )


# HF_NAMES, from_hf_name and to_hf_name are the adapter's (state_dict_adapter.py), listed here too
# for the code that imports them from this module.
__all__ = [
    "CONFIG_KEYS",
    "HF_NAMES",
    "check_hf_weights",
    "from_hf_name",
    "hf_config_of",
    "llama_sizes_from_hf",
    "load_hf_weights",
    "to_hf_name",
]
