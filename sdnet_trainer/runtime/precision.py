"""Mixed precision: the dtype a run computes in, the autocast context, the GradScaler, and how fp32
matrix math runs on CUDA (TF32).

``precision.dtype=auto`` is resolved here against the device the rank runs on: bf16 where the
hardware computes bf16 natively, fp32 elsewhere. Every reader of the compute dtype (FSDP's
``param_dtype: auto``, the MFU peak) takes the resolved name from :func:`resolve_precision_dtype`
or :attr:`Precision.dtype_name`, never ``cfg.precision.dtype`` itself, so ``auto`` never reaches
them unresolved.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, cast

import torch

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.config.schema import Config, PrecisionConfig

logger = logging.getLogger(__name__)

# The config's names for floating-point dtypes (precision.dtype, parallel.fsdp.*_dtype, ...).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# precision.dtype's choices: a dtype, or auto (resolved per device by choose_dtype).
PRECISIONS = (*DTYPES, "auto")

# How much slower bf16 autocast trains than fp32 on a CPU without AVX512-BF16/AMX, where oneDNN and
# ATen convert every bf16 operand to fp32 and back. Measured with torch 2.14 on a shared AMD EPYC
# (AVX2 only), one thread: `python -m sdnet_trainer +recipe=gpt_fsdp precision=bf16|auto
# loop.max_steps=3` in one process took 144-209 s per step in bf16 against 12.0-13.5 s in fp32
# (11-16x; step 3: 11.3x); a gpt_small micro-step alone 11-18x, a 512 x 512 matmul 20-25x.
CPU_BF16_EMULATION_SLOWDOWN = 11


def validate_precision(cfg: Config) -> None:
    """``precision.dtype``, checked before launch."""
    check_choice("precision.dtype", cfg.precision.dtype, PRECISIONS)


# ---------------------------------------------------------------------- what the hardware computes


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic instructions (AVX512-BF16 or AMX).

    torch.cpu's probes ask cpuinfo, the library ATen's and oneDNN's kernel dispatch rely on, so
    the answer is the one the kernels act on. (``torch.backends.cpu.get_cpu_capability()`` names
    only the vector width, AVX2 / AVX512, which does not say whether bf16 is native.) All shipped
    AMX parts have AMX-BF16, so the tile probe stands for it.
    """
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    # Private torch.cpu functions: a torch without them reads as "no", which falls back to fp32.
    return any(bool(getattr(torch.cpu, probe, lambda: False)()) for probe in probes)


def cuda_has_native_bf16(device: torch.device) -> bool:
    """Whether ``device`` has bf16 tensor cores (compute capability 8.0 and later, and ROCm)."""
    with torch.cuda.device(device):
        # including_emulation=False: by default torch also answers True for Volta and Turing,
        # where bf16 runs without tensor cores, slower than fp32.
        return torch.cuda.is_bf16_supported(including_emulation=False)


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a run computes in (a key of DTYPES) and why."""

    name: str
    reason: str


def _cuda_description(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def choose_dtype(requested: str, device: torch.device | str) -> DtypeChoice:
    """What ``precision.dtype=requested`` computes in on ``device``: itself, or for ``auto`` bf16
    where ``device`` computes bf16 natively and fp32 elsewhere (fp16 is never chosen for you:
    it needs loss scaling and can overflow)."""
    check_choice("precision.dtype", requested, PRECISIONS)
    device = torch.device(device)
    if requested != "auto":
        return DtypeChoice(requested, f"precision.dtype={requested}")
    if device.type == "cuda":
        if cuda_has_native_bf16(device):
            return DtypeChoice("bf16", f"{_cuda_description(device)} has bf16 tensor cores")
        return DtypeChoice(
            "fp32",
            f"{_cuda_description(device)} has no bf16 tensor cores; precision=fp16 uses its fp16 "
            f"tensor cores with loss scaling",
        )
    if device.type == "cpu":
        if cpu_has_native_bf16():
            return DtypeChoice("bf16", "this CPU computes bf16 natively (AVX512-BF16/AMX)")
        return DtypeChoice(
            "fp32",
            f"this CPU has no native bf16 arithmetic (no AVX512-BF16/AMX): bf16 would be emulated, "
            f"measured ~{CPU_BF16_EMULATION_SLOWDOWN}x slower than fp32",
        )
    return DtypeChoice("fp32", f"no bf16 capability probe for device type {device.type!r}")


def resolve_precision_dtype(cfg: PrecisionConfig, device: torch.device | str) -> str:
    """``cfg.dtype`` with ``auto`` resolved for ``device`` (a device or a device type): fp32, bf16
    or fp16. What every reader of the compute dtype should call instead of reading the config."""
    return choose_dtype(cfg.dtype, device).name


def emulation_warning(dtype_name: str, device: torch.device | str) -> str | None:
    """The warning for an explicit bf16 on hardware that only emulates it, else None."""
    device = torch.device(device)
    if dtype_name != "bf16":
        return None
    if device.type == "cpu" and not cpu_has_native_bf16():
        return (
            f"precision.dtype=bf16 on a CPU without native bf16 arithmetic: autocast emulates it, "
            f"measured ~{CPU_BF16_EMULATION_SLOWDOWN}x slower than fp32 on a CPU without "
            f"AVX512-BF16/AMX; precision=auto picks fp32 here"
        )
    if device.type == "cuda" and not cuda_has_native_bf16(device):
        return (
            f"precision.dtype=bf16 on {_cuda_description(device)}: no bf16 tensor cores, so torch "
            f"emulates bf16, slower than fp32; precision=fp16 uses its fp16 tensor cores"
        )
    return None


# ---------------------------------------------------------------------- fp32 math on CUDA (TF32)


def configure_tf32(enabled: bool) -> None:
    """Let fp32 matmuls (cuBLAS) and convolutions (cuDNN) run on TF32 tensor cores, or not.

    Process-wide, as torch's flags are. Set through ``allow_tf32``, not the newer
    ``fp32_precision`` properties: in torch 2.14 setting those leaves torch's own
    ``torch.get_float32_matmul_precision()`` (read by inductor's autotuning) and every
    ``allow_tf32`` reader raising "mix of the legacy and new APIs", while after ``allow_tf32``
    both kinds of reader answer consistently.
    """
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def tf32_enabled() -> bool | None:
    """Whether fp32 matmuls and convolutions run on TF32 tensor cores (where the GPU has them):
    True or False when cuBLAS and cuDNN agree, None when they differ (the math then depends on the
    model's mix of matmuls and convolutions)."""
    # The fp32_precision getters answer whichever API set the flags; the allow_tf32 getters raise
    # once anything used the newer API.
    matmul = torch.backends.cuda.matmul.fp32_precision == "tf32"
    # cudnn's module object is swapped for a class at import, which type stubs do not show.
    conv = cast(Any, torch.backends.cudnn).conv.fp32_precision == "tf32"
    return matmul if matmul == conv else None


# ---------------------------------------------------------------------- the run's precision


class Precision:
    """One object owns autocast and loss scaling, so the loop has a single code path.

    fp32: autocast off, scaler disabled (its scale/unscale/step are then pass-throughs).
    bf16: autocast on, no scaler: bf16 has fp32's exponent range, so gradients do not underflow.
    fp16: autocast on and a GradScaler that skips steps whose gradients overflowed.
    auto: one of the above for this device (see :func:`choose_dtype`), logged with its reason.

    On CUDA, construction also sets TF32 from ``precision.tf32`` (see :func:`configure_tf32`), so
    the math is fixed before the model first runs and before the MFU peak is looked up.
    """

    def __init__(self, cfg: PrecisionConfig, *, device_type: torch.device | str) -> None:
        device = torch.device(device_type)
        choice = choose_dtype(cfg.dtype, device)
        self.dtype_name = choice.name  # fp32 | bf16 | fp16: auto resolved
        self.dtype = DTYPES[choice.name]
        self.device_type = device.type
        # fp32 math on TF32 tensor cores: asked for, and on CUDA (the flag means nothing elsewhere).
        self.tf32 = device.type == "cuda" and cfg.tf32
        if device.type == "cuda":
            configure_tf32(cfg.tf32)
        if cfg.dtype == "auto":
            logger.info("precision.dtype=auto: %s, as %s", choice.name, choice.reason)
        else:
            warning = emulation_warning(choice.name, device)
            if warning is not None:
                logger.warning(warning)
        self.scaler = torch.amp.GradScaler(
            self.device_type,
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


__all__ = [
    "CPU_BF16_EMULATION_SLOWDOWN",
    "DTYPES",
    "PRECISIONS",
    "DtypeChoice",
    "Precision",
    "choose_dtype",
    "configure_tf32",
    "cpu_has_native_bf16",
    "cuda_has_native_bf16",
    "emulation_warning",
    "resolve_precision_dtype",
    "tf32_enabled",
    "validate_precision",
]
