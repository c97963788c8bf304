"""Model FLOPs per sample, accelerator peaks, and model FLOPs utilisation (MFU).

MFU = achieved model FLOPs per second / (peak FLOPs per second x devices): the share of the
hardware's matrix throughput that goes into the model's own arithmetic. It answers "how far is
this run from what the hardware could do", which samples/s alone cannot (it does not compare
across models or GPUs).

The FLOPs come from ``torch.utils.flop_counter.FlopCounterMode``, counted once per run on one
training micro-step (forward, loss, backward). It counts matrix multiplications, convolutions and
attention at 2 FLOPs per multiply-add; element-wise operations, normalisation and the optimizer
are not counted (the usual MFU convention: they are small next to the matmuls and not what the
peak measures). Recomputed activations count if the model recomputes them (activation
checkpointing inside the model), which strictly makes the figure hardware FLOPs utilisation.

Counting builds the model on the meta device: shapes only, no memory, no arithmetic, no
collectives, so it is instant even for a model that would not fit on the host. Models whose
forward needs real values (``.item()``, data-dependent shapes) fall back to a real copy on the CPU.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.data import Dataset, default_collate
from torch.utils.flop_counter import FlopCounterMode

from sdnet_trainer.runtime.precision import DTYPES, tf32_enabled

logger = logging.getLogger(__name__)


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of the matrix operations ``fn`` runs (FlopCounterMode's total)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def train_flops_per_sample(
    model_builder: Callable[[], nn.Module],
    example_batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    batch_size: int | None = None,
    device: str = "auto",
) -> float:
    """Forward + backward FLOPs of one micro-batch, divided by its number of samples.

    ``model_builder()`` returns a fresh bare model (no DDP or other wrapper); ``loss_fn(model,
    batch)`` returns the scalar loss; ``batch_size`` defaults to the first dimension of the first
    tensor in ``example_batch``. ``device``: ``meta`` (shapes only), ``cpu`` (a real copy, real
    arithmetic), or ``auto``: meta, and the CPU where the meta device cannot run the model.
    """
    if batch_size is None:
        tensors = [t for t in tree_flatten(example_batch)[0] if isinstance(t, torch.Tensor)]
        if not tensors:
            raise ValueError("example_batch holds no tensor; pass batch_size")
        batch_size = tensors[0].shape[0]
    if device not in ("auto", "meta", "cpu"):
        raise ValueError(f"device={device!r}: expected auto, meta or cpu")
    if device in ("auto", "meta"):
        try:
            return (
                _train_flops(model_builder, example_batch, loss_fn, torch.device("meta"))
                / batch_size
            )
        except (
            Exception
        ) as err:  # any operator without a meta kernel, .item(), data-dependent shapes
            if device == "meta":
                raise
            logger.info(
                "counting FLOPs on a CPU copy of the model: the meta device cannot run it (%s: %s)",
                type(err).__name__,
                err,
            )
    return _train_flops(model_builder, example_batch, loss_fn, torch.device("cpu")) / batch_size


def _train_flops(
    model_builder: Callable[[], nn.Module],
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device,
) -> int:
    # The device context also covers tensors the forward creates without naming a device (masks,
    # position indices), which would otherwise land on the CPU next to meta activations.
    with torch.device(device):
        model = model_builder().train()
        batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
        return count_flops(lambda: loss_fn(model, batch).backward())


# ---------------------------------------------------------------------- peaks

# Dense (no 2:4 sparsity) peak tensor-core TFLOPs per device, by the precision of the matmul
# inputs ("tf32": fp32 matmuls and convolutions on tensor cores, precision.tf32; "fp32": the plain
# FP32 pipeline). Spec sheets print the sparse figure for tensor cores: halved here. A device with
# TF32 tensor cores but no "tf32" figure gets no fp32 peak while TF32 is on (no MFU rather than one
# against the wrong peak); devices without TF32 hardware are in _NO_TF32.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 and PCIe, 40 and 80 GB alike): BF16/FP16 312,
    # TF32 156, FP32 19.5.
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    # NVIDIA H100 datasheet: H100 SXM BF16/FP16 1,979*, TF32 989*, FP32 67; H100 NVL 1,671*,
    # 835*, 60; H100 PCIe (earlier datasheet) 1,513*, 756*, 51 (* with sparsity).
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    # NVIDIA H800 datasheet (the H100 with FP64 and NVLink cut for export; its tensor and FP32
    # figures are the H100's): H800 SXM BF16/FP16 1,979*, TF32 989*, FP32 67; H800 PCIe 1,513*,
    # 756*, 51.
    "H800 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H800 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    # NVIDIA H200 datasheet: H200 SXM as H100 SXM (1,979* / 989* / 67); H200 NVL as H100 NVL.
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # NVIDIA HGX B200 datasheet: FP16/BF16 36 PFLOPS* and TF32 18 PFLOPS* for 8 GPUs.
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1125.0},
    # NVIDIA L4 datasheet: BF16/FP16 242*, TF32 120*, FP32 30.3.
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    # NVIDIA L40S datasheet: BF16/FP16 362.05 | 733*, TF32 183 | 366*, FP32 91.6.
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    # NVIDIA L40 datasheet: BF16/FP16 181.05 | 362.1*, TF32 90.5 | 181*, FP32 90.5.
    "L40": {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    # NVIDIA A10 datasheet: BF16/FP16 125 | 250*, TF32 62.5 | 125*, FP32 31.2.
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    # A10G (AWS G5): NVIDIA publishes no datasheet; 70 dense BF16/FP16 and 31.52 FP32 are the
    # figures AWS partners quote (fewer tensor TFLOPs than the A10). Override when known better.
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.52},
    # NVIDIA V100 datasheet: tensor 125 (SXM2) / 112 (PCIe) / 130 (V100S), FP32 15.7 / 14 / 16.4.
    # Volta's tensor cores have no bf16 (torch emulates it): no bf16 peak.
    "V100 SXM2": {"fp16": 125.0, "fp32": 15.7},
    "V100 PCIe": {"fp16": 112.0, "fp32": 14.0},
    "V100S PCIe": {"fp16": 130.0, "fp32": 16.4},
    # NVIDIA T4 datasheet: mixed precision (FP16/FP32) 65, FP32 8.1; no bf16.
    "T4": {"fp16": 65.0, "fp32": 8.1},
    # NVIDIA Ada GPU architecture whitepaper, RTX 4090: FP16/BF16 tensor with FP32 accumulate
    # 165.2 | 330.4*, TF32 82.6 | 165.2*, FP32 82.6.
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    # NVIDIA Ampere GA102 whitepaper, RTX 3090: FP16/BF16 tensor with FP32 accumulate 71 | 142*,
    # TF32 35.6 | 71*, FP32 35.6.
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    # AMD Instinct MI300X / MI325X datasheets: FP16/BF16 1307.4 (2614.9 with sparsity),
    # TF32 653.7, FP32 163.4.
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "MI325X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    # AMD Instinct MI250X datasheet: FP16/BF16 383, FP32 matrix 95.7.
    "MI250X": {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7},
}

# torch.cuda.get_device_name() -> PEAK_TFLOPS key; first match wins, so variants come before the
# plain name ("NVIDIA H100 PCIe" before "NVIDIA H100 80GB HBM3", the SXM part).
_DEVICE_PATTERNS: list[tuple[str, str]] = [
    (r"H100.*PCIe", "H100 PCIe"),
    (r"H100.*NVL", "H100 NVL"),
    (r"H100|GH200", "H100 SXM"),
    (r"H800.*PCIe", "H800 PCIe"),
    (r"H800(?!.*NVL)", "H800 SXM"),  # "NVIDIA H800" is the SXM part; an NVL variant is unknown
    (r"H200.*NVL", "H200 NVL"),
    (r"H200", "H200"),
    (r"B200", "B200"),
    (r"A100|A800", "A100"),  # the A800 is the A100 with NVLink cut for export
    (r"A10G", "A10G"),
    (r"\bA10\b", "A10"),
    (r"L40S", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"V100S", "V100S PCIe"),
    (r"V100.*PCIE", "V100 PCIe"),
    (r"V100", "V100 SXM2"),
    (r"\bT4\b", "T4"),
    (r"RTX 4090", "RTX 4090"),
    (r"RTX 3090(?! Ti)", "RTX 3090"),
    (r"MI300X", "MI300X"),
    (r"MI325X", "MI325X"),
    (r"MI250X", "MI250X"),
]

_DTYPE_KEYS = {dtype: key for key, dtype in DTYPES.items()}

# Devices without TF32 tensor cores (before Ampere; CDNA2): fp32 runs on the FP32 pipeline whatever
# the TF32 flags say.
_NO_TF32 = frozenset({"V100 SXM2", "V100 PCIe", "V100S PCIe", "T4", "MI250X"})

# "NVIDIA A100-SXM4-40GB MIG 3g.20gb": a Multi-Instance GPU slice has a fraction of the device's
# SMs, which its name does not say reliably enough to scale the peak.
_MIG = re.compile(r"\bMIG\b")


def device_model(name: str) -> str | None:
    """The PEAK_TFLOPS key for a device name as torch reports it, or None if unknown."""
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return key
    return None


def peak_tflops(
    device: torch.device,
    dtype: torch.dtype,
    override: float | None = None,
    *,
    tf32: bool | None = None,
    device_name: str | None = None,
) -> float | None:
    """Dense peak TFLOPs of one ``device`` for the math a run uses: the bf16/fp16 tensor-core peak
    under autocast in ``dtype``; for float32 (no autocast) the TF32 peak where ``tf32`` and the
    device has TF32 tensor cores, the FP32 peak otherwise. ``tf32`` None reads torch's flags
    (:func:`~sdnet_trainer.runtime.precision.tf32_enabled`, set by Precision from
    ``precision.tf32``).

    ``override`` (``logging.peak_tflops``) wins. None on the CPU, on a MIG slice, for an unknown
    device or dtype, or where TF32 is half on (matmuls and convolutions differ), so no MFU is
    logged rather than a wrong one. ``device_name`` replaces ``torch.cuda.get_device_name``
    (tests)."""
    if override is not None:
        return float(override)
    if device.type != "cuda":
        return None
    name = device_name if device_name is not None else torch.cuda.get_device_name(device)
    if _MIG.search(name):
        return None
    model = device_model(name)
    if model is None or dtype not in _DTYPE_KEYS:
        return None
    peaks = PEAK_TFLOPS[model]
    key = _DTYPE_KEYS[dtype]
    if key == "fp32" and model not in _NO_TF32:
        if tf32 is None:
            tf32 = tf32_enabled()
        if tf32 is None:
            return None
        if tf32:
            key = "tf32"
    return peaks.get(key)


def mfu(flops_per_s: float, peak_tflops_per_device: float, world_size: int) -> float:
    """Model FLOPs utilisation: achieved FLOPs/s of the whole job over the peak of all its
    devices (a fraction in [0, 1])."""
    if peak_tflops_per_device <= 0 or world_size < 1:
        raise ValueError(
            f"peak_tflops_per_device={peak_tflops_per_device} and world_size={world_size} "
            f"must be positive"
        )
    return flops_per_s / (peak_tflops_per_device * 1e12 * world_size)


def run_flops(
    model_builder: Callable[[], nn.Module],
    dataset: Dataset,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
    peak_override: float | None,
    tf32: bool | None = None,
) -> tuple[float | None, float | None]:
    """(FLOPs per sample, device peak TFLOPs) for a run's MFU figures, counted on a batch of the
    first samples of ``dataset``; (None, None) when the counter cannot run the model (a custom
    model or batch), with a warning. ``dtype`` is the autocast dtype (float32 without autocast)
    and ``tf32`` whether fp32 math runs on TF32 tensor cores (None: torch's flags), as
    :func:`peak_tflops` takes them."""
    try:
        size = len(dataset)  # type: ignore[arg-type]  # map-style datasets have a length
        example_batch = default_collate([dataset[i] for i in range(min(2, size))])
        flops = train_flops_per_sample(model_builder, example_batch, loss_fn)
    except Exception as err:  # no FLOPs metrics rather than no run
        logger.warning(
            "model FLOPs not counted (%s: %s); set logging.flops=false to skip",
            type(err).__name__,
            err,
        )
        return None, None
    peak = peak_tflops(device, dtype, peak_override, tf32=tf32)
    logger.info(
        "model FLOPs: %.3g per sample (forward + backward)%s",
        flops,
        f"; device peak {peak:g} TFLOPs" if peak else "",
    )
    if peak is None and device.type == "cuda":
        logger.info(
            "no MFU: no known peak for %s in %s math (MIG slices and unlisted devices have none); "
            "set logging.peak_tflops to log it",
            torch.cuda.get_device_name(device),
            dtype,
        )
    return flops, peak


__all__ = [
    "PEAK_TFLOPS",
    "count_flops",
    "device_model",
    "mfu",
    "peak_tflops",
    "run_flops",
    "train_flops_per_sample",
]
