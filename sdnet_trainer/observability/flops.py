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

from sdnet_trainer.runtime.gpus import GPUS, device_model, peak_of
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

# The peaks are runtime/gpus.py's table, which parallel=auto's planner reads too.
_DTYPE_KEYS = {dtype: key for key, dtype in DTYPES.items()}

# "NVIDIA A100-SXM4-40GB MIG 3g.20gb": a Multi-Instance GPU slice has a fraction of the device's
# SMs, which its name does not say reliably enough to scale the peak.
_MIG = re.compile(r"\bMIG\b")


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
    precision = _DTYPE_KEYS[dtype]
    if precision == "fp32" and GPUS[model].tf32 and tf32 is None:
        tf32 = tf32_enabled()
        if tf32 is None:
            return None
    return peak_of(model, precision, tf32=bool(tf32))


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
    "count_flops",
    "mfu",
    "peak_tflops",
    "run_flops",
    "train_flops_per_sample",
]
