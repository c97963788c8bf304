"""Mixed precision: the autocast context and the GradScaler, chosen by ``precision.dtype``."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.config.schema import Config, PrecisionConfig

# The config's names for floating-point dtypes (precision.dtype, parallel.fsdp.*_dtype, ...).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = tuple(DTYPES)


def validate_precision(cfg: Config) -> None:
    """``precision.dtype``, checked before launch."""
    check_choice("precision.dtype", cfg.precision.dtype, PRECISIONS)


class Precision:
    """One object owns autocast and loss scaling, so the loop has a single code path.

    fp32: autocast off, scaler disabled (its scale/unscale/step are then pass-throughs).
    bf16: autocast on, no scaler: bf16 has fp32's exponent range, so gradients do not underflow.
    fp16: autocast on and a GradScaler that skips steps whose gradients overflowed.
    """

    def __init__(self, cfg: PrecisionConfig, *, device_type: str) -> None:
        self.dtype = DTYPES[cfg.dtype]
        self.device_type = device_type
        self.scaler = torch.amp.GradScaler(
            device_type,
            init_scale=cfg.init_scale,
            growth_interval=cfg.growth_interval,
            enabled=self.dtype == torch.float16,
        )

    def autocast(self) -> AbstractContextManager:
        return torch.autocast(
            self.device_type, dtype=self.dtype, enabled=self.dtype != torch.float32
        )

    @property
    def scaling(self) -> bool:
        return self.scaler.is_enabled()
