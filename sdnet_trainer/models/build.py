"""Build a model from ``ModelConfig``: a registered family's builder (with peft's adapters where
``model.lora`` asks for them), one of this project's own classifiers, or torchvision's (with the
CIFAR stem where ``model.cifar_stem`` asks). Apart from the registry (``models/registry.py``),
which LoRA reads without building."""

from __future__ import annotations

import difflib

from torch import nn

from sdnet_trainer.config.schema import ModelConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.init import REPLACED_STEM, ZERO_INIT_RESIDUAL
from sdnet_trainer.models.lora import inject_lora
from sdnet_trainer.models.registry import OWN_MODELS, available_models, model_family


def build_model(cfg: ModelConfig) -> nn.Module:
    model: nn.Module
    family = model_family(cfg.name)
    if family is not None:
        model = family.build(cfg)
        lora = getattr(cfg, "lora", None)
        if lora is not None and lora.enabled:  # peft's adapters in it, the rest frozen
            model = inject_lora(model, cfg, family)
    elif cfg.name in OWN_MODELS:
        if cfg.weights is not None:
            raise ConfigError(
                f"model.weights={cfg.weights!r}: model.name={cfg.name!r} has no pretrained weights"
            )
        model = OWN_MODELS[cfg.name](num_classes=_num_classes(cfg), **cfg.kwargs)
    else:
        model = _torchvision_model(cfg)
    if cfg.cifar_stem:
        _use_cifar_stem(model, cfg.name)
    return model


def _num_classes(cfg: ModelConfig) -> int:
    if cfg.num_classes is None:
        # The Trainer fills it in from the data before building (data.resolve_num_classes).
        raise ConfigError(
            f"model.num_classes is not set for model.name={cfg.name!r}: the Trainer takes the "
            f"class count from the data (or data.num_classes); to build the model by hand, pass "
            f"it: compose([..., 'model.num_classes=10']), or set cfg.model.num_classes before "
            f"build_model(cfg.model)"
        )
    return cfg.num_classes


def _torchvision_model(cfg: ModelConfig) -> nn.Module:
    import torchvision  # as in available_models

    names = torchvision.models.list_models(module=torchvision.models)
    if cfg.name not in names:
        close = difflib.get_close_matches(cfg.name, available_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"model.name={cfg.name!r} is not in the model registry{hint}")
    try:
        # weights=None builds a randomly initialised model; a weights name loads (and on first use
        # downloads) torchvision's pretrained checkpoint, whose head must match num_classes.
        model = torchvision.models.get_model(
            cfg.name, weights=cfg.weights, num_classes=_num_classes(cfg), **cfg.kwargs
        )
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(
            f"model.name={cfg.name!r} with model.weights={cfg.weights!r}, "
            f"model.num_classes={cfg.num_classes}, model.kwargs={dict(cfg.kwargs)}: {err}"
        ) from err
    if cfg.kwargs.get("zero_init_residual"):
        # Kept for the init replayed after building on the meta device (models/init.py).
        setattr(model, ZERO_INIT_RESIDUAL, True)
    return model


def _use_cifar_stem(model: nn.Module, name: str) -> None:
    """3x3 stride-1 first conv and no max-pool: 32x32 inputs keep their resolution into layer1."""
    conv1 = getattr(model, "conv1", None)
    if not isinstance(conv1, nn.Conv2d) or not hasattr(model, "maxpool"):
        raise ConfigError(
            f"model.cifar_stem=true needs a ResNet-style model (conv1 + maxpool); "
            f"model.name={name!r} has none"
        )
    # What was removed, for the init replayed after building on the meta device (models/init.py).
    setattr(
        model,
        REPLACED_STEM,
        {
            "in_channels": conv1.in_channels,
            "out_channels": conv1.out_channels,
            "kernel_size": conv1.kernel_size,
            "stride": conv1.stride,
            "padding": conv1.padding,
            "bias": conv1.bias is not None,
        },
    )
    model.conv1 = nn.Conv2d(
        conv1.in_channels, conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False
    )
    model.maxpool = nn.Identity()


__all__ = ["build_model"]
