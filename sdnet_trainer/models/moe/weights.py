"""``model.weights=hf:PATH`` for the MoE family: a Qwen3-MoE or Mixtral folder checked against the
model built on the meta device before anything is allocated, then read into the model after it
is sharded, each rank reading only the elements it holds.

The check (:func:`check_hf_weights`) compares every name, shape and dtype the files' headers
declare with the meta model (``models/hf_folder.py``), the expert count of each layer with
config.json's first, so that a folder whose experts are not its config's is named by its file.

The load (:func:`load_hf_weights`) checks again, then DCP's Hugging Face reader reads into the
family's state-dict adapter's view of the model (``state_dict_adapter.py``:
:func:`~sdnet_trainer.models.moe.state_dict_adapter.to_hf`) in the folder's layout: the hub's
tensor per expert (only the experts this rank holds are read, and of each only its block), or
transformers 5's fused tensors; every tensor's local shard of tensor parallelism, FSDP, expert
parallelism (:func:`~sdnet_trainer.models.hf_folder.read_folder`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from torch import nn

from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.hf_folder import (
    CONFIG_FILE,
    StoredTensor,
    check_dtype_field,
    check_stored,
    read_folder,
    read_hf_config,
    stored_tensors,
)
from sdnet_trainer.models.llama.hf import check_tied
from sdnet_trainer.models.moe.hf import MODEL_TYPES, Layout, config_fields, layout_of, stored_as
from sdnet_trainer.models.moe.state_dict_adapter import hf_sources, model_state, to_hf

logger = logging.getLogger(__name__)

_EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
_FUSED_TENSOR = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
# Per block, the tensors of every MoE decoder, and those of one with query/key norms.
_BLOCK = ("norm1", "attn.wq", "attn.wk", "attn.wv", "attn.wo", "norm2", "mlp.router")
_QK_NORMS = ("attn.q_norm", "attn.k_norm")


def _folder_layout(folder: Path, stored: dict[str, StoredTensor]) -> tuple[dict[str, Any], Layout]:
    config = read_hf_config(folder, key="model.weights")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"model.weights=hf:{folder}: {CONFIG_FILE}: field 'model_type' is {model_type!r}, "
            f"not a Qwen3-MoE or Mixtral checkpoint"
        )
    return config, layout_of(model_type, stored)


def _whole_model_names(model: nn.Module, layout: Layout) -> set[str]:
    """The names of the whole model in a folder of ``layout`` (a pipeline stage holds fewer),
    to tell foreign tensors apart."""
    moe: Any = model  # its sizes are plain attributes
    experts, hidden, dim = moe.num_experts, moe.moe_hidden_dim, moe.dim
    per_block = [f"{name}.weight" for name in (*_BLOCK, *(_QK_NORMS if moe.qk_norm else ()))]
    ours: dict[str, tuple[int, ...]] = dict.fromkeys(
        ("embed.tok.weight", "norm.weight", "head.weight"), ()
    )
    for i in range(moe.n_layers):
        ours |= {f"blocks.{i}.{name}": () for name in per_block}
        ours[f"blocks.{i}.mlp.experts.w1"] = ours[f"blocks.{i}.mlp.experts.w3"] = (
            experts,
            hidden,
            dim,
        )
        ours[f"blocks.{i}.mlp.experts.w2"] = (experts, dim, hidden)
    names: set[str] = set()
    for name, shape in ours.items():
        stored = stored_as(name, shape, layout)
        assert stored is not None, name  # every name above has a Hugging Face one
        names.update(stored.names)
    return names


def _check_expert_count(
    stored: dict[str, StoredTensor], folder: Path, layout: Layout, *, experts: int, field: str
) -> None:
    """Each layer's experts in the files against config.json's count (``field``)."""
    config_says = f"its {CONFIG_FILE} has {field}={experts}: the weights are not the config's"
    if layout.fused:
        for name, entry in stored.items():
            if name.endswith(_FUSED_TENSOR) and entry.shape[:1] != (experts,):
                raise ConfigError(
                    f"model.weights: {folder / entry.file}: tensor {name} of shape "
                    f"{list(entry.shape)} stacks {entry.shape[0]} experts, where {config_says}"
                )
        return
    found: dict[int, dict[int, str]] = {}  # layer -> expert -> one of its tensors
    for name in stored:
        match = _EXPERT_TENSOR.match(name)
        if match is not None:
            found.setdefault(int(match[1]), {})[int(match[2])] = name
    for layer, names in sorted(found.items()):
        if set(names) != set(range(experts)):
            last = names[max(names)]
            raise ConfigError(
                f"model.weights: {folder / stored[last].file}: layer {layer} stores "
                f"{len(names)} experts (the last: {last}), where {config_says}"
            )


def check_hf_weights(model: nn.Module, folder: Path) -> dict[str, StoredTensor]:
    """The MoE decoder ``model`` (built on the meta device: nothing allocated yet; whole, or one
    pipeline stage's part) against what the folder's headers declare: each layer's expert count,
    every tensor it needs, none it has no place for, each of its shape and of a floating-point
    dtype, a tied output layer against a stored one, config.json's ``torch_dtype``. The stored
    tensors."""
    return _checked(model, folder)[0]


def _checked(model: nn.Module, folder: Path) -> tuple[dict[str, StoredTensor], Layout]:
    """:func:`check_hf_weights`'s checks; the stored tensors, and the folder's layout."""
    stored = stored_tensors(folder)
    config, layout = _folder_layout(folder, stored)
    moe: Any = model  # its sizes are plain attributes
    field = config_fields(config)["num_experts"]
    _check_expert_count(stored, folder, layout, experts=moe.num_experts, field=field)
    tied = bool(getattr(model, "tie_embeddings", False))
    sources = hf_sources(model_state(model), layout, tied=tied)
    expected = {name: source.shape for source in sources.values() for name in source.names}
    optional = ["lm_head.weight"] if tied else []
    what = f"the {config['model_type']} model of its {CONFIG_FILE}"
    known = _whole_model_names(model, layout)
    check_stored(expected, stored, folder, optional=optional, known=known, what=what)
    source = f"model.weights=hf:{folder}: {CONFIG_FILE}"
    if tied and {"lm_head.weight", "model.embed_tokens.weight"} <= set(stored):
        check_tied(folder, stored, source)
    check_dtype_field(config, stored, source)
    return stored, layout


def load_hf_weights(model: nn.Module, folder: Path) -> None:
    """Fill every parameter of ``model`` (a MoE decoder, possibly sharded or pruned to pipeline
    stages) this rank holds from the Hugging Face folder, each from the elements of its files it
    holds; checked first (:func:`check_hf_weights`)."""
    stored, layout = _checked(model, folder)
    tied = bool(getattr(model, "tie_embeddings", False))
    state = to_hf(model_state(model), layout, tied=tied)
    read = read_folder(state, folder, stored)
    logger.info(
        "loaded %d tensors from %s (%.1f MB read by this rank)",
        len(state.tensors),
        folder,
        read / 2**20,
    )


__all__ = ["check_hf_weights", "load_hf_weights"]
