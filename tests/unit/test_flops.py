"""sdnet_trainer.observability.flops: FLOP counts, the meta-device path, peaks and MFU."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from sdnet_trainer.models.simple_cnn import SimpleCNN
from sdnet_trainer.observability.flops import (
    count_flops,
    mfu,
    peak_tflops,
    run_flops,
    train_flops_per_sample,
)
from sdnet_trainer.runtime.gpus import GPUS, device_model
from sdnet_trainer.runtime.precision import configure_tf32

GPU = torch.device("cuda", 0)  # only a name here: peak_tflops is given the device name


def classification_loss(model, batch):
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


# ---------------------------------------------------------------------- counting


def test_linear_forward_is_two_flops_per_multiply_add_and_backward_twice_that():
    batch, fan_in, fan_out = 8, 32, 16
    layer = nn.Linear(fan_in, fan_out)
    x = torch.randn(batch, fan_in)
    forward = 2 * batch * fan_in * fan_out
    assert count_flops(lambda: layer(x)) == forward
    # Backward: the weight gradient (one more matmul) and, when the input needs one, the input
    # gradient (another): 3x the forward in all, as for a layer inside a network.
    assert count_flops(lambda: layer(x).sum().backward()) == 2 * forward
    x.requires_grad_(True)
    assert count_flops(lambda: layer(x).sum().backward()) == 3 * forward


def test_resnet18_forward_at_224_is_twice_its_1_8_gmacs():
    # The "1.8 GFLOPs" usually quoted for ResNet-18 are multiply-adds (1.814 G); FlopCounterMode
    # counts 2 FLOPs per multiply-add.
    with torch.device("meta"):
        model = torchvision.models.resnet18()
        images = torch.empty(2, 3, 224, 224)
    assert count_flops(lambda: model(images)) / 2 == pytest.approx(2 * 1.814e9, rel=0.005)


def test_resnet18_training_flops_per_sample_on_the_meta_device():
    batch = (torch.randn(2, 3, 224, 224), torch.tensor([0, 1]))
    per_sample = train_flops_per_sample(
        torchvision.models.resnet18, batch, classification_loss, device="meta"
    )
    # Backward ~2x forward, less the first convolution's input gradient (the images need none).
    assert per_sample == pytest.approx(2.935 * 3.628e9, rel=0.005)


def test_meta_and_real_cpu_counts_agree_on_a_small_cnn():
    batch = (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    meta = train_flops_per_sample(SimpleCNN, batch, classification_loss, device="meta")
    real = train_flops_per_sample(SimpleCNN, batch, classification_loss, device="cpu")
    assert meta == real > 0


class TinyGPT(nn.Module):
    """A two-block causal transformer; the forward makes its position indices and mask without
    naming a device, as many models do."""

    def __init__(self, vocab: int = 64, dim: int = 32, seq: int = 16) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq, dim)
        layer = nn.TransformerEncoderLayer(
            dim, nhead=4, dim_feedforward=4 * dim, batch_first=True, dropout=0.1
        )
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        length = idx.shape[1]
        mask = torch.ones(length, length).triu(1).bool()
        x = self.tokens(idx) + self.positions(torch.arange(length))
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def lm_loss(model, batch):
    inputs, targets = batch
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


def test_a_small_transformer_counts_on_the_meta_device(caplog):
    tokens = torch.randint(0, 64, (2, 17))
    batch = (tokens[:, :-1], tokens[:, 1:])
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.observability.flops"):
        auto = train_flops_per_sample(TinyGPT, batch, lm_loss)
    assert "CPU copy" not in caplog.text  # the meta device ran it
    assert auto == train_flops_per_sample(TinyGPT, batch, lm_loss, device="cpu")
    # At least the 6 x parameters x tokens of the dense layers (embeddings excluded), per sample.
    dense = sum(
        p.numel()
        for n, p in TinyGPT().named_parameters()
        if p.dim() == 2 and "positions" not in n and "tokens" not in n
    )
    assert auto >= 6 * dense * 16


class NeedsValues(nn.Module):
    """A forward that reads a value: impossible on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x) * (2.0 if x.sum().item() > 0 else 1.0)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_projects_decoders_count_on_the_meta_device(family):
    """device="meta" raises where the meta device cannot run the model: the project's decoders
    count on shapes, never on a CPU copy of the whole model (so the 4-process memory test of the
    1B GPT, tests/distributed/test_init_memory.py, leaves its FLOPs count out)."""
    from functools import partial

    from sdnet_trainer.models.gpt import GPT
    from sdnet_trainer.models.llama import Llama

    sizes = dict(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4)
    build = partial(GPT, **sizes) if family == "gpt" else partial(Llama, **sizes, n_kv_heads=2)
    tokens = torch.randint(0, 64, (2, 17))
    batch = (tokens[:, :-1], tokens[:, 1:])
    meta = train_flops_per_sample(build, batch, lm_loss, device="meta")
    cpu = train_flops_per_sample(build, batch, lm_loss, device="cpu")
    # torch's counter has no formula for the CPU's fused attention kernel (it counts 0), where the
    # meta device runs attention as its two matmuls (2 x seq x seq x dim each per sample, full
    # square, in each layer; backward twice the forward): only the meta count includes them.
    seq, dim, layers = sizes["seq_len"], sizes["dim"], sizes["n_layers"]
    assert meta == cpu + 3 * layers * 2 * (2 * seq * seq * dim) and cpu > 0


def test_models_that_need_real_values_fall_back_to_a_cpu_copy(caplog):
    batch = (torch.randn(3, 8), torch.tensor([0, 1, 2]))
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.observability.flops"):
        per_sample = train_flops_per_sample(NeedsValues, batch, classification_loss)
    assert "counting FLOPs on a CPU copy" in caplog.text
    assert per_sample == 2 * 2 * 8 * 4  # forward + weight gradient, per sample
    with pytest.raises(RuntimeError):
        train_flops_per_sample(NeedsValues, batch, classification_loss, device="meta")


def test_batch_size_comes_from_the_first_tensor_or_the_argument():
    batch = {"x": torch.randn(6, 8), "y": torch.zeros(6, dtype=torch.long)}
    loss = lambda model, b: F.cross_entropy(model(b["x"]), b["y"])  # noqa: E731
    per_sample = train_flops_per_sample(lambda: nn.Linear(8, 4), batch, loss)
    assert per_sample == 2 * 2 * 8 * 4
    assert (
        train_flops_per_sample(lambda: nn.Linear(8, 4), batch, loss, batch_size=3) == 2 * per_sample
    )


# ---------------------------------------------------------------------- peaks and MFU


@pytest.mark.parametrize(
    "name, model, bf16",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", "H100 NVL", 835.5),
        ("NVIDIA GH200 480GB", "H100 SXM", 989.4),
        ("NVIDIA H200", "H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
        ("NVIDIA A100-PCIE-40GB", "A100", 312.0),
        ("NVIDIA A10G", "A10G", 70.0),
        ("NVIDIA A10", "A10", 125.0),
        ("NVIDIA L40S", "L40S", 362.05),
        ("NVIDIA L40", "L40", 181.05),
        ("NVIDIA L4", "L4", 121.0),
        ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2),
        ("NVIDIA GeForce RTX 3090", "RTX 3090", 71.0),
        ("AMD Instinct MI300X", "MI300X", 1307.4),
    ],
)
def test_peak_lookup_by_device_name(name, model, bf16):
    assert device_model(name) == model
    assert peak_tflops(GPU, torch.bfloat16, device_name=name) == bf16
    assert peak_tflops(GPU, torch.float16, device_name=name) == bf16


def test_peaks_without_bf16_tensor_cores_or_unknown_devices_give_none():
    assert peak_tflops(GPU, torch.float16, device_name="Tesla V100-SXM2-16GB") == 125.0
    assert peak_tflops(GPU, torch.bfloat16, device_name="Tesla V100-SXM2-16GB") is None
    assert peak_tflops(GPU, torch.float16, device_name="Tesla T4") == 65.0
    assert peak_tflops(GPU, torch.bfloat16, device_name="NVIDIA GeForce RTX 3090 Ti") is None
    assert peak_tflops(GPU, torch.bfloat16, device_name="Some Future Accelerator") is None
    assert peak_tflops(torch.device("cpu"), torch.float32) is None
    assert peak_tflops(GPU, torch.float64, device_name="NVIDIA A100-SXM4-80GB") is None


@pytest.mark.parametrize(
    "name, dtype, tf32, expected",
    [
        # Autocast: the bf16/fp16 tensor-core peak, whatever TF32 says.
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, True, 312.0),
        ("NVIDIA A100-SXM4-80GB", torch.float16, False, 312.0),
        # fp32: TF32 tensor cores when TF32 is on, the FP32 pipeline otherwise.
        ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156.0),
        ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5),
        ("NVIDIA H100 80GB HBM3", torch.float32, True, 494.7),
        ("NVIDIA H100 80GB HBM3", torch.float32, False, 66.9),
        # The H800: the H100's tensor and FP32 figures (only FP64 and NVLink are cut).
        ("NVIDIA H800", torch.bfloat16, True, 989.4),
        ("NVIDIA H800", torch.float32, True, 494.7),
        ("NVIDIA H800", torch.float32, False, 66.9),
        ("NVIDIA H800 PCIe", torch.bfloat16, True, 756.5),
        ("NVIDIA H800 PCIe", torch.float32, True, 378.0),
        ("NVIDIA A800-SXM4-80GB", torch.bfloat16, True, 312.0),
        # No TF32 hardware: fp32 stays on the FP32 pipeline with the flag on.
        ("Tesla V100-SXM2-16GB", torch.float32, True, 15.7),
        ("Tesla T4", torch.float32, True, 8.1),
        ("AMD Instinct MI250X", torch.float32, True, 95.7),
        # TF32 hardware without a published TF32 figure: no MFU rather than the FP32 peak.
        ("NVIDIA A10G", torch.float32, True, None),
        ("NVIDIA A10G", torch.float32, False, 31.52),
        ("NVIDIA B200", torch.float32, True, 1125.0),
        ("NVIDIA B200", torch.float32, False, None),
    ],
)
def test_peak_matches_the_math_the_run_uses(name, dtype, tf32, expected):
    assert peak_tflops(GPU, dtype, tf32=tf32, device_name=name) == expected


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
        "NVIDIA A100-SXM4-80GB MIG 1g.10gb",
        "NVIDIA H100 80GB HBM3 MIG 7g.80gb",  # even the whole-GPU profile: MIG has its own limits
        "NVIDIA H800 MIG 2g.20gb",
    ],
)
def test_a_mig_slice_gets_no_peak_unless_given_one(name):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tf32 in (True, False):
            assert peak_tflops(GPU, dtype, tf32=tf32, device_name=name) is None
    assert peak_tflops(GPU, torch.bfloat16, 123.0, device_name=name) == 123.0


def test_h800_names_map_to_their_own_figures():
    assert device_model("NVIDIA H800") == "H800 SXM"
    assert device_model("NVIDIA H800 80GB HBM3") == "H800 SXM"
    assert device_model("NVIDIA H800 PCIe") == "H800 PCIe"
    assert device_model("NVIDIA H800 NVL") is None  # not a part with published figures


@pytest.fixture
def tf32_flags():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = cudnn


@pytest.mark.usefixtures("tf32_flags")
def test_without_an_explicit_tf32_the_peak_follows_torchs_flags():
    a100 = "NVIDIA A100-SXM4-80GB"
    configure_tf32(True)
    assert peak_tflops(GPU, torch.float32, device_name=a100) == 156.0
    configure_tf32(False)
    assert peak_tflops(GPU, torch.float32, device_name=a100) == 19.5
    # Matmuls in TF32 but convolutions in FP32: which peak applies depends on the model.
    torch.backends.cuda.matmul.allow_tf32 = True
    assert peak_tflops(GPU, torch.float32, device_name=a100) is None
    assert peak_tflops(GPU, torch.bfloat16, device_name=a100) == 312.0


@pytest.mark.parametrize("tf32, expected", [(True, 156.0), (False, 19.5)])
def test_run_flops_passes_tf32_to_the_peak(monkeypatch, tf32, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    dataset = [(torch.randn(8), 0), (torch.randn(8), 1)]
    flops, peak = run_flops(
        lambda: nn.Linear(8, 2),
        dataset,  # a list is a map-style dataset
        classification_loss,
        device=GPU,
        dtype=torch.float32,
        peak_override=None,
        tf32=tf32,
    )
    assert flops == 2 * (2 * 8 * 2)  # forward + weight gradient (the input needs none)
    assert peak == expected


def test_override_wins_everywhere():
    assert peak_tflops(torch.device("cpu"), torch.float32, 1.5) == 1.5
    assert peak_tflops(GPU, torch.bfloat16, 400.0, device_name="NVIDIA H100 80GB HBM3") == 400.0


def test_every_peak_is_dense_and_plausible():
    for model, gpu in GPUS.items():
        peaks = gpu.peaks
        assert set(peaks) <= {"bf16", "fp16", "tf32", "fp32"}, model
        for key, value in peaks.items():
            assert 1.0 < value < 5000.0, (model, key)
        if "fp32" in peaks and "fp16" in peaks:
            assert peaks["fp16"] >= peaks["fp32"], model


def test_mfu_is_achieved_over_peak_of_all_devices():
    # 8 A100s at 40% of 312 TFLOPs each.
    assert mfu(0.4 * 312e12 * 8, 312.0, 8) == pytest.approx(0.4)
    assert mfu(1e12, 100.0, 1) == pytest.approx(0.01)
    with pytest.raises(ValueError):
        mfu(1e12, 0.0, 1)
