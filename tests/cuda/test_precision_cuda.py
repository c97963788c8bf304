"""precision on a real GPU: ``auto`` picks bf16 where the GPU has bf16 tensor cores, and
``precision.tf32`` changes how cuBLAS and cuDNN compute fp32, seen in the numbers and not only in
torch's flags; the MFU peak follows the flag for this GPU's own name."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from sdnet_trainer.config.schema import PrecisionConfig
from sdnet_trainer.observability.flops import peak_tflops
from sdnet_trainer.runtime.gpus import GPUS, device_model
from sdnet_trainer.runtime.precision import DTYPES, Precision, choose_dtype, tf32_enabled
from tests.support import assert_on_cuda

pytestmark = pytest.mark.cuda

GPU = torch.device("cuda", 0)


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(GPU)


def _needs_tf32_tensor_cores() -> None:
    if _capability() < (8, 0):
        pytest.skip(f"TF32 needs compute capability 8.0; this GPU has {_capability()}")


@pytest.fixture
def tf32_flags():
    """Restore torch's TF32 flags through the setters configure_tf32 uses."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = cudnn


def _relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return ((result.double() - reference).norm() / reference.norm()).item()


def test_auto_is_bf16_on_a_gpu_with_bf16_tensor_cores(caplog):
    expected_name = "bf16" if _capability() >= (8, 0) else "fp32"
    expected = DTYPES[expected_name]
    # The Trainer passes the device type; a device with its index resolves the same way.
    for device in ("cuda", GPU):
        assert choose_dtype("auto", device).name == expected_name
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.runtime.precision"):
        precision = Precision(PrecisionConfig(dtype="auto"), device_type="cuda")
    assert precision.dtype == expected
    x = torch.randn(64, 64, device=GPU)
    with precision.autocast():
        product = x @ x
    assert product.dtype == expected
    assert_on_cuda(x, product)
    assert f"precision.dtype=auto: {precision.dtype_name}" in caplog.text
    assert torch.cuda.get_device_name(GPU) in caplog.text  # the reason names the GPU


@pytest.mark.usefixtures("tf32_flags")
def test_precision_tf32_switches_fp32_matmuls_and_convolutions_to_tf32():
    _needs_tf32_tensor_cores()
    gen = torch.Generator(device=GPU).manual_seed(0)
    a = torch.randn(1024, 1024, device=GPU, generator=gen)
    b = torch.randn(1024, 1024, device=GPU, generator=gen)
    x = torch.randn(8, 128, 32, 32, device=GPU, generator=gen)
    w = torch.randn(128, 128, 3, 3, device=GPU, generator=gen)
    assert_on_cuda(a, b, x, w)
    matmul_reference = a.double() @ b.double()
    conv_reference = F.conv2d(x.double(), w.double(), padding=1)
    errors = {}
    for tf32 in (True, False):
        Precision(PrecisionConfig(dtype="fp32", tf32=tf32), device_type="cuda")
        assert tf32_enabled() is tf32
        errors[tf32] = (
            _relative_error(a @ b, matmul_reference),
            _relative_error(F.conv2d(x, w, padding=1), conv_reference),
        )
    # TF32 keeps 10 of fp32's 23 mantissa bits: a relative error of a few 1e-4 over these sums of
    # ~1,000 products, against ~1e-6 in full fp32.
    (matmul_on, conv_on), (matmul_off, conv_off) = errors[True], errors[False]
    assert matmul_on > 1e-4 and matmul_off < 1e-5, errors
    # cuDNN may pick FFT or Winograd in fp32 (larger errors than a direct sum): compare relatively.
    assert conv_on > 1e-4 and conv_off < conv_on / 10, errors


def _peaks_of(name: str) -> dict[str, float]:
    """This GPU's row of the peak table; an unlisted GPU fails the test, naming itself: the
    MFU of every run on it would silently be missing."""
    model = device_model(name)
    if model is None:
        pytest.fail(
            f"{name!r} is not in the GPU table (sdnet_trainer/runtime/gpus.py: "
            f"_DEVICE_PATTERNS maps device names to GPUS rows): add it from its datasheet"
        )
    return dict(GPUS[model].peaks)


def _figure(peaks: dict[str, float], key: str, name: str) -> float:
    """One figure of the row: a missing one would compare None with None and pass."""
    assert key in peaks, f"the peak table's row for {name!r} has no {key} figure: {peaks}"
    return peaks[key]


def _assert_no_peak_on_a_mig_slice(name: str) -> None:
    """A slice has a fraction of the device's SMs, which its name does not say reliably: no peak
    in any precision (flops.peak_tflops), so no MFU rather than a wrong one."""
    for tf32 in (False, True):
        Precision(PrecisionConfig(dtype="fp32", tf32=tf32), device_type="cuda")
        assert peak_tflops(GPU, torch.float32) is None, name
    assert peak_tflops(GPU, torch.bfloat16) is None, name


def _assert_the_peak_follows_tf32(name: str) -> None:
    peaks = _peaks_of(name)
    Precision(PrecisionConfig(dtype="fp32", tf32=False), device_type="cuda")
    assert peak_tflops(GPU, torch.float32) == _figure(peaks, "fp32", name)
    if _capability() >= (8, 0) and torch.version.hip is None:  # TF32 tensor cores
        Precision(PrecisionConfig(dtype="fp32", tf32=True), device_type="cuda")
        assert peak_tflops(GPU, torch.float32) == _figure(peaks, "tf32", name)
    # bf16 tensor cores from compute capability 8.0 on; before, no bf16 peak.
    bf16 = _figure(peaks, "bf16", name) if _capability() >= (8, 0) else None
    assert peak_tflops(GPU, torch.bfloat16) == bf16, name


@pytest.mark.usefixtures("tf32_flags")
def test_the_mfu_peak_of_this_gpu_follows_precision_tf32():
    """On a GPU the peak table lacks (neither a MIG slice nor listed) this fails, naming it."""
    name = torch.cuda.get_device_name(GPU)
    if "MIG" in name:
        _assert_no_peak_on_a_mig_slice(name)
    else:
        _assert_the_peak_follows_tf32(name)
