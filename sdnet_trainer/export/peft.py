"""``format=peft``: a LoRA run's adapters as a peft folder (``adapter_config.json`` and
``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained(base, out)`` loads on the
``transformers`` base model, and ``merge_lora=true``, under which every format writes the base
with the adapters merged in.

The folder is written by peft itself: the ``transformers`` model of the run's architecture (the
family's Hugging Face config, or the transformers model a ``hf_causal_lm`` run trained) is built
on the meta device and given the run's frozen base weights (the same tensors, not copies), peft's
``get_peft_model`` wraps it as the run wrapped its layers, ``set_peft_model_state_dict`` sets the
trained adapters under Hugging Face's names (a name it has no place for is an error here, not a
warning), and ``PeftModel.save_pretrained`` writes the two files. ``base_model_name_or_path`` is
the Hugging Face folder the run started from (``model.weights=hf:PATH`` or ``model.hf_config``),
if any.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdnet_trainer.config.schema import Config
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export.writers import ExportError
from sdnet_trainer.models.family import ModelFamily
from sdnet_trainer.models.hf_causal_lm import require_transformers
from sdnet_trainer.models.lora import (
    ADAPTER,
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ALL_LINEAR,
    adapters_of,
    base_state,
    peft_names,
)
from sdnet_trainer.runtime.quiet import import_quietly

logger = logging.getLogger(__name__)

PEFT_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)


def check_lora_args(names: list[str], *, lora: bool, merge_lora: bool, checkpoint: str) -> None:
    """The formats and ``merge_lora`` against the checkpoint: adapters (a LoRA run's) or not."""
    if merge_lora and not lora:
        raise ConfigError(
            f"merge_lora=true: checkpoint={checkpoint!r} holds no adapters (it was written "
            f"without model.lora.enabled=true); export it without merge_lora"
        )
    if "peft" in names and not lora:
        raise ConfigError(
            f"format=peft writes a LoRA run's adapters; checkpoint={checkpoint!r} holds none "
            f"(written without model.lora.enabled=true)"
        )
    if "peft" in names and merge_lora:
        raise ConfigError(
            "format=peft writes the adapters, merge_lora=true merges them away: export the "
            "adapters (format=peft) and the merged model (format=hf merge_lora=true) to "
            "separate out= folders"
        )
    if "hf" in names and lora and not merge_lora:
        raise ConfigError(
            f"format=hf of checkpoint={checkpoint!r}, a LoRA run's: pass merge_lora=true for "
            f"the base model with the adapters merged in, or format=peft for the adapters alone "
            f"(a peft folder for the base model)"
        )


def merged_config(cfg: Config) -> Config:
    """The training config of a merged export: the plain model's (``model.lora`` off), which
    ``build_model`` builds for the merged weights."""
    merged = copy.deepcopy(cfg)
    merged.model.lora.enabled, merged.model.lora.adapter = False, None
    return merged


def write_peft(
    model: nn.Module, folder: Path, *, family: ModelFamily | None, base: Path | None
) -> list[str]:
    """Write the adapters of ``model`` (a LoRA run's, rebuilt) as a peft folder into ``folder``;
    the names written. ``base``: the Hugging Face folder the run started from."""
    peft = import_quietly("peft")  # it imports torchao: without torch's notices about it

    adapters = adapters_of(model)
    if adapters is None:
        raise ExportError("format=peft: the rebuilt model holds no adapters")
    transformers = require_transformers("format=peft")
    root_name = adapters.targets.root
    root = model.get_submodule(root_name) if root_name else model
    config = _hf_config(transformers, model, root, family)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
    # The run's base tensors themselves (no copy); a weight without a Hugging Face name of its
    # own here (none of the wrapped layers') stays on the meta device: only adapters are saved.
    base_tensors = _base_tensors(model, root_name, adapters.targets.hf_name)
    hf_model.load_state_dict(base_tensors, assign=True, strict=False)
    hf_model.tie_weights()
    settings = adapters.settings
    targets = settings.targets if isinstance(settings.targets, str) else list(settings.targets)
    if targets == ALL_LINEAR and adapters.targets.modules:
        # The family's layers, by Hugging Face's names: a transformers model's own all-linear may
        # take more (a mixture of experts' router and experts).
        targets = [hf for hf, _ in adapters.targets.modules]
    wrapped = peft.get_peft_model(hf_model, settings.peft_config(targets), adapter_name=ADAPTER)
    params = dict(model.named_parameters())
    tensors = {theirs: params[ours].detach() for ours, theirs in peft_names(model).items()}
    loaded: Any = peft.set_peft_model_state_dict(wrapped, tensors, adapter_name=ADAPTER)
    unexpected = sorted(loaded.unexpected_keys)
    if unexpected:
        raise ExportError(
            f"format=peft: peft's {type(hf_model).__name__} has no place for the adapters "
            f"{unexpected[:5]}"
        )
    unset = [n for n, p in wrapped.named_parameters() if p.requires_grad and p.is_meta]
    if unset:
        raise ExportError(f"format=peft: no base weight for the adapters {unset[:5]}")
    wrapped.peft_config[ADAPTER].base_model_name_or_path = str(base) if base else None
    wrapped.save_pretrained(str(folder))
    (folder / "README.md").unlink(missing_ok=True)  # peft's empty model card
    logger.info("format=peft: %d adapter tensors (%s)", len(tensors), ", ".join(PEFT_FILES))
    return list(PEFT_FILES)


def _hf_config(
    transformers: Any, model: nn.Module, root: nn.Module, family: ModelFamily | None
) -> Any:
    """The ``transformers`` config of the run's architecture: the transformers model's own, or
    the family's Hugging Face config (the Llama's config.json)."""
    if root is not model:
        return root.config
    if family is None or family.hf is None:
        raise ExportError(
            f"format=peft needs a family with a Hugging Face adapter; this model is a "
            f"{type(model).__name__}"
        )
    dtype = next(p.dtype for p in model.parameters())
    fields = dict(family.hf.config(model, dtype))
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def _base_tensors(model: nn.Module, root_name: str, hf_name: Any) -> dict[str, torch.Tensor]:
    """The frozen base weights under the transformers model's names."""
    prefix = f"{root_name}." if root_name else ""
    tensors = {}
    for base, value in base_state(model).items():
        if not base.startswith(prefix):
            continue
        base = base[len(prefix) :]
        try:
            tensors[hf_name(base) if hf_name is not None else base] = value
        except KeyError:
            continue  # stored under other names (fused experts): not a layer adapters wrap
    return tensors


__all__ = ["PEFT_FILES", "check_lora_args", "merged_config", "write_peft"]
