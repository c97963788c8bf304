"""The mixture-of-experts family (``model.name=moe``): its decoder (``model.py``: the Llama's
attention with Qwen3's head size and query/key norms; ``experts.py``: the router, the stacked
experts, load balancing), its Hugging Face side (``hf.py``: Qwen3-MoE and Mixtral config.json and
names; ``state_dict_adapter.py``: its tensors under those names, per expert or fused;
``weights.py``: ``model.weights=hf:PATH`` checked and read, each rank its own shards), its serving
cache (the transformers model of its own tensors), and the family's entry (:data:`FAMILY`) that
``models/registry.py`` lists."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from sdnet_trainer.config.schema import Config, ModelConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.family import (
    HFAdapter,
    HFWeights,
    LoRATargets,
    ModelFamily,
    check_kwargs,
    config_dict,
)
from sdnet_trainer.models.hf_folder import hf_config_source, read_hf_config
from sdnet_trainer.models.hf_twin import transformers_twin
from sdnet_trainer.models.llama import LORA_MODULES as LLAMA_LORA_MODULES
from sdnet_trainer.models.moe.experts import LOAD_BALANCE, GroupedExperts, MoE
from sdnet_trainer.models.moe.hf import (
    GATE_UP,
    config_fields,
    hf_config_of,
    layout_of,
    moe_sizes_from_hf,
    to_hf_name,
)
from sdnet_trainer.models.moe.model import MoEDecoder, check_sizes, validate_moe
from sdnet_trainer.models.moe.state_dict_adapter import hf_tensors
from sdnet_trainer.models.moe.weights import check_hf_weights, load_hf_weights

logger = logging.getLogger(__name__)

NAME = "moe"
# model.moe's keys a Hugging Face config does not set: the training loop's.
_TRAINING_KEYS = ("load_balance", "bias_update_rate")


def moe_sizes(cfg: ModelConfig) -> dict[str, Any]:
    """The MoE decoder's constructor arguments: the architecture from the Hugging Face
    config.json of ``model.weights=hf:PATH`` or ``model.hf_config`` (with ``model.moe``'s
    ``load_balance`` and ``bias_update_rate``), else ``model.moe``; ``model.kwargs`` overrides
    single ones."""
    own = config_dict(cfg.moe)
    source = hf_config_source(cfg)
    if source is not None:
        config = read_hf_config(source.file, key=source.key)
        sizes = moe_sizes_from_hf(config, source=f"{source.key}: {source.file}")
        sizes |= {name: own[name] for name in _TRAINING_KEYS}
    else:
        sizes = own
    check_kwargs(cfg, sizes, "model.moe")
    return {**sizes, **cfg.kwargs}


def _validate(cfg: Config, *, tp: int, pp: int) -> None:
    # Reads model.hf_config / model.weights=hf:PATH's config.json: a bad one stops here.
    model = cfg.model
    sizes = moe_sizes(model)
    source = hf_config_source(model)
    path = None if source is None else source.file
    fields = {} if source is None else config_fields(read_hf_config(source.file, key=source.key))

    def named(key: str, value: Any) -> str:
        if key in model.kwargs:
            return f"model.kwargs.{key}={value}"
        if key in fields:
            return f"{fields[key]}={value} ({path})"
        return f"model.moe.{key}={value}"

    validate_moe(cfg, sizes, tp=tp, pp=pp, named=named)


def generation_model(model: nn.Module) -> nn.Module | None:
    """Serving's KV cache: the ``transformers`` Qwen3-MoE or Mixtral model of this model's own
    tensors, in the expert layout that release builds. Under transformers 5's fused experts the
    model's ``w1`` and ``w3`` become the halves of the twin's ``gate_up_proj``, so the weights
    stay held once. None (a warning: served without the cache) for a model neither type holds."""
    if not isinstance(model, MoEDecoder):
        return None
    try:
        config = hf_config_of(model, dtype=next(model.parameters()).dtype)
    except ConfigError as err:  # hf_model_type's: a model neither type holds
        logger.warning("serving without a KV cache: %s", err)
        return None
    model_type = config["model_type"]

    def tensors(wanted: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
        theirs = hf_tensors(model, layout_of(model_type, wanted))
        for name, experts in model.named_modules():  # blocks.{i}.mlp.experts
            if not isinstance(experts, GroupedExperts):
                continue
            fused = theirs.get(GATE_UP.format(i=name.split(".")[1]))
            if fused is not None:
                rows = experts.w1.shape[1]
                experts.w1.data, experts.w3.data = fused[:, :rows], fused[:, rows:]
        return theirs

    return transformers_twin(model, config=config, tensors=tensors)


# model.lora.target_modules: the Llama's attention projections (the experts are stacked 3-D
# weights, not linear layers).
LORA_MODULES = tuple((hf, ours) for hf, ours in LLAMA_LORA_MODULES if ours.startswith("attn."))


def _decoder_sizes(cfg: ModelConfig) -> tuple[int, int]:
    sizes = moe_sizes(cfg)
    return int(sizes["dim"]), int(sizes["n_layers"])


FAMILY = ModelFamily(
    name=NAME,
    build=lambda cfg: MoEDecoder(**moe_sizes(cfg)),
    language=True,
    validate=_validate,
    decoder_sizes=_decoder_sizes,
    hf=HFAdapter(tensors=hf_tensors, config=lambda model, dtype: hf_config_of(model, dtype=dtype)),
    hf_weights=HFWeights(check=check_hf_weights, load=load_hf_weights),
    lora=LoRATargets(modules=LORA_MODULES, hf_name=to_hf_name),
    num_experts=lambda cfg: int(moe_sizes(cfg)["num_experts"]),
    generation_model=generation_model,
)

__all__ = [
    "FAMILY",
    "LOAD_BALANCE",
    "GroupedExperts",
    "MoE",
    "MoEDecoder",
    "check_sizes",
    "generation_model",
    "hf_tensors",
    "moe_sizes",
    "validate_moe",
]
