"""The mixture-of-experts family (``model.name=moe``): its decoder (``model.py``: the Llama's
attention with Qwen3's head size and query/key norms; ``experts.py``: the router, the stacked
experts, load balancing), its Hugging Face side (``hf.py``: Qwen3-MoE and Mixtral config.json and
names, and serving's KV cache as the transformers model of its tensors; ``weights.py``:
``model.weights=hf:PATH`` checked and read slice by slice), and the
family's entry (:data:`FAMILY`) that ``models/registry.py`` lists."""

from __future__ import annotations

from typing import Any

from sdnet_trainer.config.schema import Config, ModelConfig
from sdnet_trainer.models.family import (
    HFAdapter,
    HFWeights,
    LoRATargets,
    ModelFamily,
    check_kwargs,
    config_dict,
)
from sdnet_trainer.models.hf_folder import hf_config_source, read_hf_config
from sdnet_trainer.models.llama import LORA_MODULES as LLAMA_LORA_MODULES
from sdnet_trainer.models.moe.experts import LOAD_BALANCE, GroupedExperts, MoE
from sdnet_trainer.models.moe.hf import (
    config_fields,
    generation_model,
    hf_config_of,
    hf_tensors,
    moe_sizes_from_hf,
    to_hf_name,
)
from sdnet_trainer.models.moe.model import MoEDecoder, check_sizes, validate_moe
from sdnet_trainer.models.moe.weights import check_hf_weights, load_hf_weights

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
    "hf_tensors",
    "moe_sizes",
    "validate_moe",
]
