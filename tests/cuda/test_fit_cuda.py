"""One GPU, end to end: the paths the CPU suite cannot reach.

- resnet18 and gpt_tiny through the real CLI in bf16, channels_last (ResNet), torch.compile per
  block and the profiler with a CUDA memory snapshot;
- fp16: a step whose gradients overflow is skipped by the GradScaler and counted;
- parallel=ddp, fsdp and zero1 under torchrun on a one-rank NCCL process group: FSDP2 shards
  over the mesh of one and ZeRO-1 over the group of one, while DDP wraps nothing at one rank (its
  CUDA wrapper is tested on two ranks in test_two_ranks_cuda.py).

Each run records what it was built as (``tests.support.ProbeTrainer``), so a run that silently
fell back to the CPU, to gloo or to eager mode fails here instead of passing: the model's device
and the devices of the batches it trained on are asserted to be CUDA.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from sdnet_trainer import compose
from sdnet_trainer.distributed import distributed_session
from tests.cuda.launches import FP16_INIT_SCALE, LAUNCHES
from tests.support import (
    ProbeTrainer,
    assert_on_cuda,
    read_jsonl,
    read_probe,
    run_cli,
)

pytestmark = pytest.mark.cuda

# Keys every log point of metrics.jsonl carries (hooks.MetricsHook).
LOG_KEYS = {
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "perf/samples_per_s",
    "perf/step_s",
    "perf/data_wait_s",
    "perf/peak_memory_mb",
    "perf/tflops_per_s",
}
# ResNet-18 (ImageNet stem) on 64x64 synthetic images; gpt_tiny on the synthetic token language
# (tests/cuda/launches.py). 30 steps: the first compile of each block takes most of the minute,
# so both cases run after every other CUDA test (tests/cuda/conftest.py).
COMPILED = [
    pytest.param("fit_compiled_resnet18", id="resnet18"),
    pytest.param("fit_compiled_gpt_tiny", id="gpt_tiny"),
]


def _losses(rows: list[dict]) -> list[float]:
    return [row["train/loss"] for row in rows if "train/loss" in row]


@pytest.mark.run_last  # cold inductor compiles: after every other test (tests/cuda/conftest.py)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", COMPILED)  # resnet18 first: gpt_tiny is the one to lose
def test_one_gpu_fit_bf16_compiled_and_profiled(tmp_path, name):
    model = name.removeprefix("fit_compiled_")
    run_dir = tmp_path / "run"
    launch = run_cli(
        [*LAUNCHES[name].keys, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        nproc=LAUNCHES[name].nproc,
        timeout=270,
        fork=False,
    )
    assert launch.returncode == 0, launch.output

    probe = read_probe(run_dir)
    assert probe["device"] == "cuda:0" and probe["steps"] == 30, probe
    assert_on_cuda(probe["device"], probe["batch_devices"])
    assert probe["param_dtypes"] == ["torch.float32"], probe  # autocast: fp32 master weights
    assert probe["compiled_modules"] > 0 and probe["dynamo_graphs"] > 0, probe
    if model == "resnet18":
        # The bare model (one process) is converted to NHWC as a whole.
        assert probe["conv_weight_channels_last"] is True, probe

    rows = read_jsonl(run_dir / "metrics.jsonl")
    logged = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in logged] == [5, 10, 15, 20, 25, 30], rows
    for row in logged:
        assert row.keys() >= LOG_KEYS, LOG_KEYS - row.keys()
        assert row["perf/peak_memory_mb"] > 0  # the CUDA allocator's figure, not the CPU's 0
    losses = _losses(rows)
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    if model == "gpt_tiny":
        assert all(row["perf/tokens_per_s"] > 0 for row in logged)
    assert any("val/loss" in row for row in rows)  # the final evaluation ran on the GPU too

    profile = run_dir / "profile"
    assert list(profile.glob("rank0.*.pt.trace.json*")), sorted(profile.iterdir())
    snapshot = profile / "memory_rank0.pickle"
    assert snapshot.stat().st_size > 0
    with open(snapshot, "rb") as f:
        recorded = pickle.load(f)  # our own file, just written: torch's snapshot dict
    assert recorded["segments"] and any(recorded["device_traces"]), list(recorded)
    log = (run_dir / "train.log").read_text()
    assert "by self CUDA time" in log and "world size 1 on cuda:0" in log


class OverflowTrainer(ProbeTrainer):
    """Sets every gradient of one parameter to inf in step ``OVERFLOW_STEP`` (a finite loss, as
    an fp16 overflow in backward gives) and keeps a copy of the parameters after every step
    (ProbeTrainer: also the devices of the batches)."""

    OVERFLOW_STEP = 3

    def setup(self) -> None:
        super().setup()
        self.after_steps: list[list[torch.Tensor]] = []
        self.losses: list[float] = []
        next(iter(self.model.parameters())).register_hook(self._overflow)

    def _overflow(self, grad: torch.Tensor) -> torch.Tensor:
        if self.state.step + 1 == self.OVERFLOW_STEP:
            return torch.full_like(grad, math.inf)
        return grad

    def train_step(self):
        result = super().train_step()
        self.losses.append(result.loss.item())
        self.after_steps.append([p.detach().clone() for p in self.model.parameters()])
        return result


def test_fp16_overflow_step_is_skipped_by_the_grad_scaler_and_counted(tmp_path):
    init_scale = FP16_INIT_SCALE  # precision.growth_interval=1000: the scale only halves
    cfg = compose(LAUNCHES["fp16_overflow"].keys)
    with distributed_session(cfg.dist) as env:
        assert env.device.type == "cuda"
        trainer = OverflowTrainer(cfg, output_dir=tmp_path, env=env)
        trainer.fit()

    state, k = trainer.state, OverflowTrainer.OVERFLOW_STEP
    assert state.step == 6
    assert_on_cuda(trainer.model, trainer.batch_devices)
    assert state.skipped_steps == 1, "the GradScaler's skip was not counted"
    assert state.nonfinite_steps == 0, "an fp16 overflow is routine, not a health event"
    assert all(math.isfinite(v) for v in trainer.losses), trainer.losses
    # The overflowing step left every parameter as it was; the steps around it moved them.
    before, during, after = (trainer.after_steps[i] for i in (k - 2, k - 1, k))
    assert all(torch.equal(a, b) for a, b in zip(before, during))
    assert not all(torch.equal(a, b) for a, b in zip(during, after))
    assert all(torch.isfinite(p).all() for p in trainer.after_steps[-1])
    assert trainer.precision.scaler.get_scale() == init_scale / 2

    rows = [row for row in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in row]
    assert rows[-1]["train/skipped_steps"] == 1.0
    assert rows[-1]["train/loss_scale"] == init_scale / 2
    assert rows[0]["train/loss_scale"] == init_scale  # step 1, before the overflow


class ShardedProbe(ProbeTrainer):
    """Probes FSDP2's parameters as sharded, as they are between training steps: the root module
    (``reshard_after_forward=False``) keeps its parameters unsharded, plain tensors, after the
    final evaluation's forward, which no backward follows to reshard them."""

    def write_probe(self) -> None:
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        super().write_probe()


# parallel=<strategy> on one rank, by what parallelize builds there: FSDP2 wraps on a mesh of one
# and ZeRO-1 shards the optimizer over the group of one, but DDP wraps only over more than one
# data-parallel rank, so parallel=ddp trains the bare model (the case's id says so).
ONE_RANK_LAYOUTS = [
    pytest.param("one_rank_nccl_ddp", id="ddp_unwrapped"),
    pytest.param("one_rank_nccl_fsdp", id="fsdp"),
    pytest.param("one_rank_nccl_zero1", id="zero1"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ONE_RANK_LAYOUTS)
def test_one_rank_nccl_process_group(tmp_path, name):
    """torchrun with one process: the NCCL group carries the step's agreement, the metrics'
    gathers, the evaluation's reduction and the checkpoint's collectives; FSDP2 shards the model
    over the one-rank mesh (its parameters DTensors); ZeRO-1 shards its optimizer over the group.
    At world size 1 nothing is wrapped in DDP (parallelize wraps DDP only over more than one
    data-parallel rank), and the probe asserts that: the ``ddp_unwrapped`` case checks the group,
    the device and the checkpoints of the bare model."""
    strategy = name.removeprefix("one_rank_nccl_")
    run_dir = tmp_path / "run"
    launch = run_cli(
        [*LAUNCHES[name].keys, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        nproc=LAUNCHES[name].nproc,
        timeout=210,
        fork=False,
    )
    assert launch.returncode == 0, launch.output
    probe = read_probe(run_dir)
    assert probe["backend"] == "nccl" and probe["world_size"] == 1, probe
    assert probe["device"] == "cuda:0" and probe["steps"] == 20, probe
    assert_on_cuda(probe["device"], probe["batch_devices"])
    assert probe["ddp"] is False, probe  # one rank: DDP wraps nothing under any strategy
    # FSDP2's one-rank path: FSDPModule wrappers (torch.distributed.fsdp) and DTensor weights.
    sharded = probe["fsdp"] is True and probe["dtensor_params"] > 0
    assert sharded is (strategy == "fsdp"), probe
    zero = probe["optimizer_class"] == "ZeroRedundancyOptimizer"
    assert zero is (strategy == "zero1"), probe
    rows = read_jsonl(run_dir / "metrics.jsonl")
    losses = _losses(rows)
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses), losses
    assert min(losses[-3:]) < losses[0], losses  # lr 0.05 with momentum: a noisy descent
    assert any("val/loss" in row for row in rows)  # the final evaluation, reduced over NCCL
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert "step_00000010" in checkpoints and "step_00000020" in checkpoints, checkpoints
