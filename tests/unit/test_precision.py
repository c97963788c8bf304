"""sdnet_trainer.runtime.precision: precision.dtype=auto, the bf16 emulation warning, and TF32.

The hardware probes are mocked both ways (torch.cpu's CPU-feature probes, torch.cuda's bf16 and
device queries), so each branch runs on any CPU; tests/cuda/test_precision_cuda.py checks the
CUDA answers and TF32's effect on a real GPU.
"""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
import torch

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import PrecisionConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.runtime.precision import (
    CPU_BF16_EMULATION_SLOWDOWN,
    DTYPES,
    Precision,
    choose_dtype,
    configure_tf32,
    cpu_has_native_bf16,
    emulation_warning,
    resolve_precision_dtype,
    tf32_enabled,
    validate_precision,
)
from tests.support import TINY

CPU_PROBES = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")


def _cpu_features(monkeypatch, *, avx512_bf16: bool, amx: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


def _gpu(monkeypatch, *, name: str, capability: tuple[int, int]) -> None:
    """A fake CUDA device as torch.cuda describes it; is_bf16_supported answers as torch does:
    True from compute capability 8.0, and for older GPUs only when emulation counts."""
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return capability >= (8, 0) or including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)


@pytest.fixture
def tf32_flags():
    """Restore torch's TF32 flags after the test, through the same setters configure_tf32 uses
    (the newer fp32_precision setters would leave the legacy getters raising for later tests)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = cudnn


# ---------------------------------------------------------------------- validation


def test_auto_is_a_valid_precision_and_typos_name_the_key():
    validate_precision(compose(["precision=auto"]))
    validate_precision(compose(["precision.dtype=auto"]))
    with pytest.raises(ConfigError, match=r"precision.dtype='atuo'.*did you mean 'auto'"):
        validate_precision(compose(["precision.dtype=atuo"]))


def test_an_unknown_dtype_names_the_key_where_it_is_resolved_too():
    with pytest.raises(ConfigError, match=r"precision.dtype='bf61'"):
        resolve_precision_dtype(PrecisionConfig(dtype="bf61"), "cpu")


def test_the_auto_group_option_composes_to_auto():
    assert compose(["precision=auto"]).precision.dtype == "auto"


@pytest.mark.parametrize("recipe", ["gpt_fsdp", "gpt_tp_fsdp", "gpt_pipeline", "resnet152"])
def test_recipes_that_trained_in_bf16_now_say_auto(recipe):
    assert compose([f"+recipe={recipe}"]).precision.dtype == "auto"


# ---------------------------------------------------------------------- auto on the CPU


def test_this_probe_reads_torch_cpu_features(monkeypatch):
    _cpu_features(monkeypatch, avx512_bf16=False, amx=False)
    assert not cpu_has_native_bf16()
    _cpu_features(monkeypatch, avx512_bf16=True, amx=False)
    assert cpu_has_native_bf16()
    _cpu_features(monkeypatch, avx512_bf16=False, amx=True)
    assert cpu_has_native_bf16()


def test_a_torch_without_the_probes_reads_as_no_native_bf16(monkeypatch):
    for probe in CPU_PROBES:
        monkeypatch.delattr(torch.cpu, probe)
    assert not cpu_has_native_bf16()
    assert choose_dtype("auto", "cpu").name == "fp32"


@pytest.mark.parametrize(
    "avx512_bf16, amx, expected",
    [(True, False, "bf16"), (False, True, "bf16"), (False, False, "fp32")],
)
def test_auto_on_a_cpu_follows_its_bf16_instructions(monkeypatch, avx512_bf16, amx, expected):
    _cpu_features(monkeypatch, avx512_bf16=avx512_bf16, amx=amx)
    assert choose_dtype("auto", torch.device("cpu")).name == expected
    assert resolve_precision_dtype(PrecisionConfig(dtype="auto"), "cpu") == expected


def test_precision_resolves_auto_logs_why_and_autocasts_accordingly(monkeypatch, caplog):
    x = torch.randn(4, 4)
    _cpu_features(monkeypatch, avx512_bf16=False, amx=False)
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.runtime.precision"):
        precision = Precision(PrecisionConfig(dtype="auto"), device_type="cpu")
    assert (precision.dtype_name, precision.dtype) == ("fp32", torch.float32)
    with precision.autocast():
        assert (x @ x).dtype == torch.float32
    (record,) = [r for r in caplog.records if r.name == "sdnet_trainer.runtime.precision"]
    assert record.levelno == logging.INFO  # the choice is news, not a warning
    assert "precision.dtype=auto: fp32" in record.message
    assert "no AVX512-BF16/AMX" in record.message

    caplog.clear()
    _cpu_features(monkeypatch, avx512_bf16=True, amx=False)
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.runtime.precision"):
        precision = Precision(PrecisionConfig(dtype="auto"), device_type="cpu")
    assert (precision.dtype_name, precision.dtype) == ("bf16", torch.bfloat16)
    assert not precision.scaling  # bf16 needs no loss scaling
    with precision.autocast():
        assert (x @ x).dtype == torch.bfloat16
    assert "precision.dtype=auto: bf16" in caplog.text


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_an_explicit_dtype_is_kept_whatever_the_hardware(monkeypatch, dtype):
    _cpu_features(monkeypatch, avx512_bf16=False, amx=False)
    assert resolve_precision_dtype(PrecisionConfig(dtype=dtype), "cpu") == dtype
    _gpu(monkeypatch, name="Tesla V100-SXM2-16GB", capability=(7, 0))
    assert resolve_precision_dtype(PrecisionConfig(dtype=dtype), "cuda") == dtype


# ---------------------------------------------------------------------- explicit bf16, emulated


def test_explicit_bf16_on_a_cpu_without_native_bf16_warns_with_the_measured_slowdown(
    monkeypatch, caplog
):
    _cpu_features(monkeypatch, avx512_bf16=False, amx=False)
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.runtime.precision"):
        precision = Precision(PrecisionConfig(dtype="bf16"), device_type="cpu")
    assert precision.dtype == torch.bfloat16  # warned, not overridden
    (record,) = [r for r in caplog.records if r.name == "sdnet_trainer.runtime.precision"]
    assert record.levelno == logging.WARNING
    assert (
        f"measured ~{CPU_BF16_EMULATION_SLOWDOWN}x slower than fp32 on a CPU without "
        f"AVX512-BF16/AMX"
    ) in record.message
    assert "precision=auto" in record.message


def test_no_warning_where_bf16_is_native_or_not_asked_for(monkeypatch, caplog):
    _cpu_features(monkeypatch, avx512_bf16=False, amx=True)
    assert emulation_warning("bf16", "cpu") is None
    _cpu_features(monkeypatch, avx512_bf16=False, amx=False)
    assert emulation_warning("fp32", "cpu") is None
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.runtime.precision"):
        Precision(PrecisionConfig(dtype="fp32"), device_type="cpu")
    assert not [r for r in caplog.records if r.name == "sdnet_trainer.runtime.precision"]


# ---------------------------------------------------------------------- auto on CUDA (mocked)


def test_auto_on_an_ampere_or_later_gpu_is_bf16(monkeypatch):
    _gpu(monkeypatch, name="NVIDIA H100 80GB HBM3", capability=(9, 0))
    choice = choose_dtype("auto", torch.device("cuda", 0))
    assert choice.name == "bf16"
    assert "NVIDIA H100 80GB HBM3 (compute capability 9.0) has bf16 tensor cores" in choice.reason


def test_auto_on_a_gpu_that_only_emulates_bf16_is_fp32_and_points_to_fp16(monkeypatch):
    # torch.cuda.is_bf16_supported() alone says True here (emulation counts by default).
    _gpu(monkeypatch, name="Tesla V100-SXM2-16GB", capability=(7, 0))
    assert torch.cuda.is_bf16_supported()
    choice = choose_dtype("auto", "cuda")
    assert choice.name == "fp32"
    assert "Tesla V100-SXM2-16GB (compute capability 7.0)" in choice.reason
    assert "precision=fp16" in choice.reason
    warning = emulation_warning("bf16", "cuda")
    assert warning is not None and "no bf16 tensor cores" in warning


# ---------------------------------------------------------------------- TF32


@pytest.mark.usefixtures("tf32_flags")
def test_configure_tf32_sets_cublas_and_cudnn_and_tf32_enabled_reads_them():
    configure_tf32(True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high"  # torch's own reader still works
    assert tf32_enabled() is True
    configure_tf32(False)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    assert tf32_enabled() is False
    torch.backends.cuda.matmul.allow_tf32 = True  # matmuls in TF32, convolutions not
    assert tf32_enabled() is None


@pytest.mark.usefixtures("tf32_flags")
@pytest.mark.parametrize("tf32", [True, False])
def test_precision_on_cuda_applies_precision_tf32(tf32):
    configure_tf32(not tf32)
    # fp32 asks nothing of the GPU, so this builds without one; only the flags are checked.
    precision = Precision(PrecisionConfig(dtype="fp32", tf32=tf32), device_type="cuda")
    assert precision.tf32 is tf32
    assert torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.backends.cudnn.allow_tf32 is tf32


@pytest.mark.usefixtures("tf32_flags")
def test_precision_on_the_cpu_leaves_the_cuda_flags_alone():
    configure_tf32(False)
    precision = Precision(PrecisionConfig(dtype="fp32", tf32=True), device_type="cpu")
    assert precision.tf32 is False
    assert tf32_enabled() is False


# ---------------------------------------------------------------------- through the Trainer


class _RecordLogitsDtype(Trainer):
    def compute_loss(self, batch):
        inputs, targets = batch
        logits = self.model(inputs)
        self.logits_dtype = logits.dtype
        return self.criterion(logits, targets)


@pytest.mark.parametrize("native, expected", [(False, "fp32"), (True, "bf16")])
def test_the_trainer_computes_in_what_auto_resolves_to(monkeypatch, tmp_path, native, expected):
    _cpu_features(monkeypatch, avx512_bf16=native, amx=False)
    cfg = compose([*TINY, "precision=auto", "loop.max_steps=2", "loop.eval_at_end=false"])
    trainer = _RecordLogitsDtype(cfg, output_dir=tmp_path)
    metrics = trainer.fit()
    assert trainer.precision.dtype_name == expected
    assert trainer.logits_dtype == DTYPES[expected]
    assert math.isfinite(metrics["train/loss"])
