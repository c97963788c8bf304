"""LoRA and DoRA adapters through peft on a language model (``model.lora``; the ``lora`` extra).

peft's own layers do the work. :func:`inject_lora` wraps the target layers of the model that
``models/registry.py``'s ``build_model`` builds (on the meta device or on the CPU, before
anything shards it) with ``inject_adapter_in_model`` and freezes every other parameter
(``requires_grad=False``): the optimizer, the gradient reductions and the checkpoint see only the
adapters, and FSDP2 shards the frozen weights without gradients or optimizer state. Targets are
written in Hugging Face's names (``q_proj`` ... ``down_proj``, or ``all-linear``: every linear
layer but the output layer); a family maps them onto its own through its entry
(``ModelFamily.lora``: the Llama's ``attn.wq`` ...), a ``transformers`` model takes them as
they are.

Names. peft renames a wrapped layer's ``wq.weight`` to ``wq.base_layer.weight`` and adds
``wq.lora_A.default.weight``, ``wq.lora_B.default.weight`` (and DoRA's
``wq.lora_magnitude_vector.default.weight``). :func:`base_name` maps a name back to the base
model's (None for an adapter's own tensor): the readers of ``model.weights=hf:PATH`` read the
base through it. In a peft folder (``adapter_model.safetensors``) the adapters carry the names
peft saves for the ``transformers`` model, ``base_model.model.model.layers.0.self_attn.q_proj.
lora_A.weight`` (:func:`peft_names`, through peft's own ``get_peft_model_state_dict``).

Values. Built on the CPU, peft draws the adapters as it wraps each layer (``nn.Linear``'s own
construction draws, then A kaiming-uniform and B zero) and computes DoRA's magnitudes from the
base weights. Built on the meta device, :func:`init_adapters` does the same once this rank's
shards hold the base's values (the Trainer calls it after the base's init or load): the draws
replayed from the generator state that follows the base's init, so the adapters are the CPU
build's; each magnitude from the base rows this rank holds; or, with ``model.lora.adapter``, the
values of that peft folder (read as untrusted input, like a Hugging Face folder).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from sdnet_trainer.config.schema import Config, ModelConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.family import LoRATargets, ModelFamily
from sdnet_trainer.models.hf_folder import hf_weights_folder
from sdnet_trainer.models.init import (
    CONSTRUCTION_STEPS,
    InitStep,
    init_steps,
    materialize,
    reset,
    write_full,
)
from sdnet_trainer.models.lora_folder import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ALL_LINEAR,
    LoRASettings,
    adapter_folder,
    adapter_tensors,
    check_adapter_file,
    lora_settings,
    require_peft,
)
from sdnet_trainer.models.lora_names import ADAPTER_PARTS, base_name, base_state
from sdnet_trainer.models.registry import FAMILIES

logger = logging.getLogger(__name__)

ADAPTER = "default"  # peft's name of the one adapter a model holds here
PEFT_PREFIX = "base_model.model."  # a PeftModel's prefix of the transformers model's names
# The attribute of a model with adapters that holds their settings and pending init.
ADAPTERS = "lora_adapters"


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model`` (possibly wrapped by DDP or FSDP) holds peft's adapters."""
    return any(base_name(name) is None for name, _ in model.named_parameters())


@dataclass
class Adapters:
    """What a model with adapters keeps about them (under :data:`ADAPTERS`): the family's
    targets, the settings, the peft folder they start from, and the init steps of a build on the
    meta device that :func:`init_adapters` has yet to run (None once run, or for a CPU build)."""

    targets: LoRATargets
    settings: LoRASettings
    folder: Path | None
    steps: list[InitStep] | None


def adapters_of(model: nn.Module) -> Adapters | None:
    return getattr(model, ADAPTERS, None)


# ---------------------------------------------------------------------- targets


def _peft_targets(settings: LoRASettings, targets: LoRATargets, root: nn.Module) -> list[str] | str:
    """``settings.targets`` in peft's spelling for ``root``: as they are for a transformers
    model; else each Hugging Face name as the family's (a short name as the family's suffix, a
    full module path as the family's module), ``all-linear`` as all of them."""
    if not targets.modules:
        return settings.targets if isinstance(settings.targets, str) else list(settings.targets)
    names = dict(targets.modules)
    if settings.targets == ALL_LINEAR:
        return sorted(set(names.values()))
    if isinstance(settings.targets, str):
        raise ConfigError(
            f"{settings.source} is {settings.targets!r}: a pattern, which this family's names "
            f"do not follow; give the names ({', '.join(names)}) or {ALL_LINEAR}"
        )
    paths = _hf_module_paths(targets, root)
    chosen = []
    for name in settings.targets:
        if name not in names and name not in paths:
            raise ConfigError(
                f"{settings.source} names {name!r}, which is none of the layers adapters wrap "
                f"here: {', '.join(names)} (Hugging Face's names), or {ALL_LINEAR}"
            )
        chosen.append(names.get(name) or paths[name])
    return chosen


def _hf_module_paths(targets: LoRATargets, root: nn.Module) -> dict[str, str]:
    """Hugging Face's full module path -> the family's, for every linear layer of ``root``."""
    paths = {}
    for name, module in root.named_modules():
        if isinstance(module, nn.Linear) and targets.hf_name is not None:
            try:
                paths[targets.hf_name(f"{name}.weight").removesuffix(".weight")] = name
            except KeyError:
                continue  # no Hugging Face name (an adapter's own layer)
    return paths


# ---------------------------------------------------------------------- building


def inject_lora(model: nn.Module, cfg: ModelConfig, family: ModelFamily) -> nn.Module:
    """``model`` (the family's bare build) with peft's adapters in its target layers and every
    other parameter frozen. On the meta device the construction's init steps are kept for the
    base and the adapters' own are left to :func:`init_adapters`; on the CPU peft draws them, and
    ``model.lora.adapter``'s values load at once."""
    targets = family.lora
    if targets is None:
        raise ConfigError(_unsupported(family.name))
    peft = require_peft("model.lora.enabled=true")
    settings = lora_settings(cfg)
    on_meta = any(p.is_meta for p in model.parameters())
    base_steps = init_steps(model) if on_meta else None
    root = model.get_submodule(targets.root) if targets.root else model
    chosen = _peft_targets(settings, targets, root)
    try:
        peft.inject_adapter_in_model(settings.peft_config(chosen), root, adapter_name=ADAPTER)
    except ValueError as err:
        raise ConfigError(
            f"{settings.source}={_shown(settings.targets)}: {err} (model.name={cfg.name}; layers "
            f"adapters may wrap: {', '.join(n for n, _ in targets.modules) or 'any linear'})"
        ) from None
    for name, param in model.named_parameters():
        param.requires_grad_(base_name(name) is None)
    folder = adapter_folder(cfg.lora.adapter) if cfg.lora.adapter is not None else None
    pending = None
    if base_steps is not None:
        setattr(model, CONSTRUCTION_STEPS, base_steps)
        pending = _adapter_steps(root)
    setattr(model, ADAPTERS, Adapters(targets, settings, folder, pending))
    if not on_meta and folder is not None:
        load_adapter(model, folder)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(
        "model.lora: %s adapters of rank %d (alpha %g) on %s: %d of %d parameters trained "
        "(%.2f%%)%s",
        "DoRA" if settings.use_dora else "LoRA",
        settings.r,
        settings.alpha,
        _shown(settings.targets),
        trainable,
        total,
        100.0 * trainable / max(total, 1),
        f", from {folder}" if folder is not None else "",
    )
    return model


def _shown(targets: tuple[str, ...] | str) -> str:
    return targets if isinstance(targets, str) else f"[{','.join(targets)}]"


def _unsupported(name: str) -> str:
    able = sorted(n for n, f in FAMILIES.items() if f.lora is not None)
    return (
        f"model.lora.enabled=true: model.name={name} takes no adapters here; LoRA trains "
        f"model.name={' or '.join(able)} (a family whose entry declares its lora targets)"
    )


def _adapter_steps(root: nn.Module) -> list[InitStep]:
    """The draws peft makes as it wraps each layer on the CPU, in its order: the construction
    of ``lora_A`` and ``lora_B`` (``nn.Linear``'s own init), then A kaiming-uniform, B zero."""
    from peft.tuners.lora import LoraLayer

    steps = []
    for module in root.modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            a, b = module.lora_A[ADAPTER], module.lora_B[ADAPTER]
            steps += [InitStep(a, reset), InitStep(b, reset)]
            steps += [InitStep(a, _kaiming_uniform), InitStep(b, _zeros)]
    return steps


def _kaiming_uniform(module: nn.Module) -> None:
    nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))  # type: ignore[arg-type]


def _zeros(module: nn.Module) -> None:
    for param in module.parameters(recurse=False):
        nn.init.zeros_(param)


@torch.no_grad()
def init_adapters(model: nn.Module) -> None:
    """The adapters of a model built on the meta device, once this rank's shards hold the base's
    values: ``model.lora.adapter``'s values, or the draws of a CPU build (from the generator's
    current state) and DoRA's magnitudes from the base weights. Nothing for other models."""
    adapters = adapters_of(model)
    if adapters is None or adapters.steps is None:
        return
    steps, adapters.steps = adapters.steps, None
    if adapters.folder is not None:
        load_adapter(model, adapters.folder)
        return
    materialize(steps)
    if adapters.settings.use_dora:
        _dora_magnitudes(model)


def _dora_magnitudes(model: nn.Module) -> None:
    """Each DoRA magnitude as peft sets it: the row norms of the base weight plus the scaled
    B A, which is zero at the start. Under FSDP2 a magnitude and its weight are sharded by the
    same rows, so each rank computes its own from its own rows."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_magnitude_vector:
            continue
        magnitude = module.lora_magnitude_vector[ADAPTER].weight
        weight = module.get_base_layer().weight
        assert isinstance(magnitude, torch.Tensor) and isinstance(weight, torch.Tensor)
        if magnitude.is_meta or weight.is_meta:
            continue  # not on this rank
        rows = (Shard(0), Replicate())
        if (
            isinstance(weight, DTensor)
            and isinstance(magnitude, DTensor)
            and weight.placements == magnitude.placements
            and all(p in rows for p in weight.placements)
        ):
            local = torch.linalg.norm(weight.to_local(), dim=1).to(weight.dtype)
            magnitude.to_local().copy_(local)
        else:
            full = weight.full_tensor() if isinstance(weight, DTensor) else weight
            write_full(magnitude, torch.linalg.norm(full, dim=1).to(full.dtype))


# ---------------------------------------------------------------------- peft's names and folders


def peft_names(model: nn.Module) -> dict[str, str]:
    """Each adapter parameter of ``model`` -> its name in a peft folder of the transformers model
    (``base_model.model.<Hugging Face's module>.lora_A.weight``): the adapter name dropped and
    DoRA's magnitude renamed by peft's own ``get_peft_model_state_dict``, the module named as
    Hugging Face does through the family's ``hf_name``."""
    from peft import get_peft_model_state_dict

    adapters = adapters_of(model)
    assert adapters is not None, "a model with adapters (inject_lora)"
    root_name = adapters.targets.root
    root = model.get_submodule(root_name) if root_name else model
    names = [name for name, _ in root.named_parameters() if base_name(name) is None]
    # peft renames a state dict's keys: markers in place of the tensors say which is which.
    markers = {name: torch.tensor(float(i)) for i, name in enumerate(names)}
    saved = get_peft_model_state_dict(root, state_dict=markers, adapter_name=ADAPTER)
    prefix = f"{root_name}." if root_name else ""
    result = {}
    for key, marker in saved.items():
        parts = key.split(".")
        cut = next(i for i, p in enumerate(parts) if p in ADAPTER_PARTS)
        module, suffix = ".".join(parts[:cut]), ".".join(parts[cut:])
        if adapters.targets.hf_name is not None:
            module = adapters.targets.hf_name(f"{module}.weight").removesuffix(".weight")
        result[prefix + names[int(marker)]] = f"{PEFT_PREFIX}{module}.{suffix}"
    return result


def check_adapter(model: nn.Module, folder: Path) -> dict[str, str]:
    """The peft folder's tensors against the adapters of ``model`` (built on the meta device or
    not; ``lora_folder.check_adapter_file``); the model's name -> the folder's."""
    names = peft_names(model)
    params = dict(model.named_parameters())
    check_adapter_file(
        folder, {theirs: tuple(params[ours].shape) for ours, theirs in names.items()}
    )
    return names


@torch.no_grad()
def load_adapter(model: nn.Module, folder: Path) -> None:
    """The values of the peft folder's adapters into ``model``'s (this rank's shards of them),
    checked first (:func:`check_adapter`)."""
    names = check_adapter(model, folder)
    params = dict(model.named_parameters())
    ours = {theirs: name for name, theirs in names.items()}
    for theirs, value in adapter_tensors(folder, ours):
        write_full(params[ours[theirs]], value)
    logger.info("model.lora.adapter: %d adapter tensors loaded from %s", len(names), folder)


def merge_adapters(model: nn.Module) -> nn.Module:
    """``model`` without its adapters: each merged by peft into its layer's weight (``merge``:
    W + (alpha / r) B A, or DoRA's rescaled sum) and the layer unwrapped to its base layer, as
    ``PeftModel.merge_and_unload`` does. The family's plain model, under its own names."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge(safe_merge=True, adapter_names=[ADAPTER])
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    adapters = adapters_of(model)
    if adapters is not None:
        root = model.get_submodule(adapters.targets.root) if adapters.targets.root else model
        for owner, attribute in ((root, "peft_config"), (model, ADAPTERS)):
            if attribute in owner.__dict__:
                delattr(owner, attribute)
    model.__dict__.pop(CONSTRUCTION_STEPS, None)
    for param in model.parameters():
        param.requires_grad_(True)
    return model


# ---------------------------------------------------------------------- before launch


def validate_lora(
    cfg: Config,
    family: ModelFamily | None,
    *,
    tp: int,
    build: Callable[[ModelConfig], nn.Module] | None,
) -> None:
    """``model.lora``, before launch: a family that takes adapters, peft installed, the layout
    and options it trains with, and (where ``build`` builds the run's model: the stock
    Trainer's) the adapters built on the meta device: targets that match no layer, and a
    ``model.lora.adapter`` folder for another base, fail here, naming the key or the file."""
    lora = cfg.model.lora
    if not lora.enabled:
        if lora.adapter is not None:
            raise ConfigError(f"model.lora.adapter={lora.adapter!r} needs model.lora.enabled=true")
        return
    if family is None or family.lora is None:
        raise ConfigError(_unsupported(cfg.model.name))
    require_peft("model.lora.enabled=true")
    if lora.r < 1:
        raise ConfigError(f"model.lora.r={lora.r} must be >= 1")
    if not lora.alpha > 0:
        raise ConfigError(f"model.lora.alpha={lora.alpha} must be > 0")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout={lora.dropout} must be in [0, 1)")
    targets = list(lora.target_modules)
    if not targets or (ALL_LINEAR in targets and len(targets) > 1):
        raise ConfigError(
            f"model.lora.target_modules={targets}: give layer names (q_proj, v_proj, ...) or "
            f"[{ALL_LINEAR}] alone"
        )
    refused = {
        # Its column and row styles take nn.Linear layers; peft's wrappers are not.
        "parallel.tp": (tp > 1, tp, "tensor parallel splits the layers peft has wrapped"),
        "precision.float8": (
            cfg.precision.float8 is not None,
            cfg.precision.float8,
            "float8 would convert the frozen layers peft wraps",
        ),
        "model.ema.enabled": (
            cfg.model.ema.enabled,
            "true",
            "the average would hold a second copy of the frozen base",
        ),
    }
    for key, (bad, value, why) in refused.items():
        if bad:
            raise ConfigError(
                f"model.lora.enabled=true with {key}={value}: not supported ({why}); LoRA "
                f"trains under parallel=fsdp, ddp or zero1, with parallel.pp and parallel.cp"
            )
    lora_settings(cfg.model)  # an adapter folder's config.json is read and checked here
    if build is not None:
        model = _meta_model(cfg.model, build)
        if lora.adapter is not None:
            check_adapter(model, adapter_folder(lora.adapter))


def _meta_model(cfg: ModelConfig, build: Callable[[ModelConfig], nn.Module]) -> nn.Module:
    """The model with its adapters on the meta device: from config.json alone where the builder
    would load a transformers model's weights."""
    folder = hf_weights_folder(cfg.weights)
    if folder is not None and cfg.name == "hf_causal_lm":
        cfg = copy.copy(cfg)
        cfg.weights, cfg.hf_config = None, str(folder)
    with torch.device("meta"):
        return build(cfg)


__all__ = [
    "ADAPTERS",
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "ALL_LINEAR",
    "Adapters",
    "LoRASettings",
    "adapters_of",
    "base_name",
    "base_state",
    "check_adapter",
    "init_adapters",
    "inject_lora",
    "is_adapted",
    "load_adapter",
    "lora_settings",
    "merge_adapters",
    "peft_names",
    "validate_lora",
]
