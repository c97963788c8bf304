"""precision.float8 on a GPU with float8 tensor cores (compute capability 8.9 and later): the
paths the CPU suite reaches only through torchao's CPU emulation.

- Both recipes train llama3_debug in bf16 through the Trainer, in this process: every projection
  a Float8Linear on the GPU whose matmuls are ``torch._scaled_mm`` calls (the float8 kernels), the
  loss finite and falling, near the bf16 run's;
- rowwise compiled per block (inductor fuses torchao's casts: how float8 is meant to be fast);
- tensorwise under FSDP2 on a one-rank NCCL group: the weights all-gathered in float8, their
  scales computed after each optimizer step.

Where the GPU lacks float8 tensor cores each test is skipped with the GPU's name and capability
(the preflight refusal itself is checked on the CPU, tests/unit/test_float8.py); without torchao
(the float8 extra) the module is. The speed of float8 against bf16 is scripts/bench/bench_gpu.py's
llama3_1b row, not a test.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from sdnet_trainer.config import compose
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.preflight import validate
from tests.cuda.launches import LAUNCHES
from tests.cuda.test_fsdp_cuda import DeviceRecorder
from tests.support import assert_on_cuda

# The GPU check's second command runs these (tests/cuda/conftest.py).
pytestmark = [pytest.mark.cuda, pytest.mark.gpu_second]
pytest.importorskip("torchao.float8", reason="the float8 extra (torchao) is not installed")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402  (after the skip)
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

DEVICE = torch.device("cuda", 0)
# llama3_debug in bf16, 30 steps (tests/cuda/launches.py: FLOAT8_LLAMA): every projection's sizes
# are multiples of 16, and so are a micro-batch's tokens (4 sequences of 32), which the float8
# kernels need for the weight gradients.
PROJECTIONS = 14  # 2 blocks x (wq, wk, wv, wo, w1, w3, w2); the output layer stays in bf16


def _needs_float8_tensor_cores() -> None:
    capability = torch.cuda.get_device_capability(DEVICE)
    if capability < (8, 9):
        pytest.skip(
            f"float8 needs compute capability 8.9 or later; {torch.cuda.get_device_name(DEVICE)} "
            f"has {capability[0]}.{capability[1]}"
        )


# Every step's loss and the device of every batch it trained on.
LossRecorder = DeviceRecorder


def _fit(tmp_path, name: str, env: DistEnv | None = None) -> LossRecorder:
    """The launch ``LAUNCHES[name]`` in this process."""
    cfg = compose(LAUNCHES[name].keys)
    validate(cfg, world_size=1)  # the launch's own check: this GPU has float8 tensor cores
    trainer = LossRecorder(cfg, output_dir=tmp_path, env=env)
    trainer.fit()
    return trainer


def float8_matmuls(model: torch.nn.Module, device: torch.device) -> list[str]:
    """The ``_scaled_mm`` calls (float8 matmuls) of one forward and backward of ``model`` in bf16
    autocast, as the profiler records them: torchao's float8 tensors dispatch to them inside
    their own ``__torch_dispatch__``, below what a dispatch mode would see."""
    tokens = torch.randint(0, 256, (4, 32), device=device)
    activities = [torch.profiler.ProfilerActivity.CPU]  # the operators, whatever the device
    with torch.profiler.profile(activities=activities) as profile:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens)
        logits.float().square().mean().backward()
    return [event.name for event in profile.events() if event.name == "aten::_scaled_mm"]


def _assert_trains(run: LossRecorder, reference: LossRecorder) -> None:
    assert run.batch_devices == {"cuda"}
    assert all(math.isfinite(v) for v in run.losses) and len(run.losses) == 30
    assert run.losses[-1] < 0.7 * run.losses[0]  # 5.5 at the start
    # The CPU's emulation comes within 2 % of bf16 (tests/unit/test_float8.py); the GPU's float8
    # kernels accumulate differently (fast accumulation in the forward).
    gaps = [abs(a - b) / b for a, b in zip(run.losses, reference.losses, strict=True)]
    assert max(gaps) < 0.05, gaps


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> LossRecorder:
    """The same run without float8 (only where float8 can run: the skip comes first)."""
    _needs_float8_tensor_cores()
    return _fit(tmp_path_factory.mktemp("bf16"), "float8_bf16")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("float8_rowwise", id="rowwise"),
        pytest.param("float8_tensorwise", id="tensorwise"),
    ],
)
def test_float8_trains_on_the_gpus_float8_kernels(tmp_path, bf16, name):
    _needs_float8_tensor_cores()
    run = _fit(tmp_path, name)
    converted = [m for m in run.model.modules() if isinstance(m, Float8Linear)]
    assert len(converted) == PROJECTIONS
    assert_on_cuda(run.model, [m.weight for m in converted])
    assert all(m.weight.dtype == torch.float32 for m in converted)  # high-precision weights
    _assert_trains(run, bf16)
    # Three float8 matmuls per projection: the output, the input and the weight gradients.
    assert len(float8_matmuls(run.model, DEVICE)) == 3 * PROJECTIONS


@pytest.mark.run_last  # a cold inductor compile: after every other test (tests/cuda/conftest.py)
@pytest.mark.timeout(400)
def test_float8_rowwise_compiled_per_block_trains(tmp_path, bf16):
    _needs_float8_tensor_cores()
    run = _fit(tmp_path, "float8_rowwise_compiled")
    assert_on_cuda(run.model)
    assert torch._inductor.config.emulate_precision_casts  # torchtitan's fix for rowwise + compile
    _assert_trains(run, bf16)


@pytest.mark.timeout(300)
def test_tensorwise_fsdp_gathers_float8_weights_over_nccl(tmp_path, one_rank, bf16):
    _needs_float8_tensor_cores()
    run = _fit(tmp_path, "float8_tensorwise_fsdp", one_rank)
    assert isinstance(run.model, FSDPModule)
    wq = run.model.blocks[0].attn.wq
    local = wq.weight._local_tensor
    assert isinstance(local, WeightWithDynamicFloat8CastTensor)  # FSDP all-gathers it in float8
    assert local._precomputed_scale is not None  # computed after the last optimizer step
    assert_on_cuda(run.model, local._precomputed_scale)
    _assert_trains(run, bf16)
