"""The Llama family (``model.name=llama``): its model (``model.py``), its Hugging Face side
(``state_dict_adapter.py``: its tensors under Hugging Face's names; ``hf.py``: config.json and
``model.weights=hf:PATH``), its serving cache (the same tensors as a
``transformers.LlamaForCausalLM``, ``models/hf_twin.py``), and the family's entry
(:data:`FAMILY`) that ``models/registry.py`` lists. Its tensor-parallel plan and pipeline units
are the decoder machinery's it shares with the GPT (``models/parallel_spec.py``)."""

from __future__ import annotations

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
from sdnet_trainer.models.hf_folder import hf_config_source, hf_weights_folder, read_hf_config
from sdnet_trainer.models.hf_twin import transformers_twin
from sdnet_trainer.models.llama.hf import (
    CONFIG_KEYS,
    check_hf_weights,
    hf_config_of,
    llama_sizes_from_hf,
    load_hf_weights,
)
from sdnet_trainer.models.llama.model import (
    Llama,
    check_sizes,
    check_tensor_parallel,
    validate_llama,
)
from sdnet_trainer.models.llama.state_dict_adapter import to_hf, to_hf_name

NAME = "llama"


def llama_sizes(cfg: ModelConfig) -> dict[str, Any]:
    """The Llama's constructor arguments: from the Hugging Face config.json of
    ``model.weights=hf:PATH`` or ``model.hf_config``, else ``model.llama``; ``model.kwargs``
    overrides single ones."""
    source = hf_config_source(cfg)
    if source is not None:
        config = read_hf_config(source.given, key=source.key)
        sizes = llama_sizes_from_hf(config, source=f"{source.key}={source.given}")
    else:
        sizes = config_dict(cfg.llama)
        sizes["rope_scaling"] = config_dict(sizes["rope_scaling"])
    check_kwargs(cfg, sizes, "model.llama")
    return {**sizes, **cfg.kwargs}


def hf_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The Llama's tensors under Hugging Face's names (its state-dict adapter's); a tied output
    layer once, as the embedding (transformers ties it back)."""
    if not isinstance(model, Llama):
        raise ConfigError(
            f"model.name={NAME}'s Hugging Face names are a Llama's; this model is a "
            f"{type(model).__name__}"
        )
    return to_hf(model.state_dict(), tied=model.tie_embeddings).tensors


def generation_model(model: nn.Module) -> nn.Module | None:
    """Serving's KV cache: the ``transformers.LlamaForCausalLM`` of the Llama's own tensors (the
    same rotary layout, ``rotate_half``, so no weight is permuted or copied)."""
    if not isinstance(model, Llama):
        return None
    dtype = next(model.parameters()).dtype
    config = hf_config_of(model, dtype=dtype)
    return transformers_twin(model, config=config, tensors=lambda _: hf_tensors(model))


def _validate(cfg: Config, *, tp: int, pp: int) -> None:
    # Reads model.hf_config / model.weights=hf:PATH's config.json: a bad one stops here.
    model = cfg.model
    folder = hf_weights_folder(model.weights)
    source = model.hf_config if folder is None else folder / "config.json"
    fields = {ours: theirs for ours, theirs in CONFIG_KEYS} | {
        "tie_embeddings": "tie_word_embeddings"
    }

    def named(key: str, value: Any) -> str:
        return (
            f"model.llama.{key}={value}" if source is None else f"{fields[key]}={value} ({source})"
        )

    validate_llama(cfg, llama_sizes(model), tp=tp, pp=pp, named=named)


# model.lora.target_modules: Hugging Face's names of the layers adapters wrap -> the Llama's.
LORA_MODULES = (
    ("q_proj", "attn.wq"),
    ("k_proj", "attn.wk"),
    ("v_proj", "attn.wv"),
    ("o_proj", "attn.wo"),
    ("gate_proj", "mlp.w1"),
    ("up_proj", "mlp.w3"),
    ("down_proj", "mlp.w2"),
)


def _decoder_sizes(cfg: ModelConfig) -> tuple[int, int]:
    sizes = llama_sizes(cfg)
    return int(sizes["dim"]), int(sizes["n_layers"])


FAMILY = ModelFamily(
    name=NAME,
    build=lambda cfg: Llama(**llama_sizes(cfg)),
    language=True,
    context_parallel=True,
    validate=_validate,
    decoder_sizes=_decoder_sizes,
    hf=HFAdapter(tensors=hf_tensors, config=lambda model, dtype: hf_config_of(model, dtype=dtype)),
    hf_weights=HFWeights(check=check_hf_weights, load=load_hf_weights),
    lora=LoRATargets(modules=LORA_MODULES, hf_name=to_hf_name),
    generation_model=generation_model,
)

__all__ = [
    "FAMILY",
    "LORA_MODULES",
    "Llama",
    "check_sizes",
    "check_tensor_parallel",
    "hf_tensors",
    "llama_sizes",
    "validate_llama",
]
