"""What a first GPU run needs, proven on the CPU where it can be (tests/cuda/ has the rest).

The process group's backend with FSDP CPU offload, the LOCAL_RANK check, dist.device=cpu on a
machine with GPUs, NCCL's flight recorder, the timeout shortening's no-op cases, a CPU-written
checkpoint resumed on CUDA (the CUDA calls simulated), the deterministic-kernel check, and the
pipeline evaluation's point-to-point group.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from sdnet_trainer.checkpoint import CheckpointError
from sdnet_trainer.checkpoint.parts import Part
from sdnet_trainer.config.schema import CheckpointConfig, Config, DistConfig, PipelineConfig
from sdnet_trainer.distributed import env as dist_env
from sdnet_trainer.distributed import pipeline as pipeline_mod
from sdnet_trainer.distributed.env import (
    CUDA_WITH_CPU_BACKEND,
    FLIGHT_RECORDER_ENTRIES,
    distributed_session,
    enable_flight_recorder,
    group_backend,
    shorten_timeout,
    validate_dist,
)
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.runtime import rng
from sdnet_trainer.training.checkpointer import Checkpointer
from sdnet_trainer.training.state import RunState

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)

# ---------------------------------------------------------------------- the process group


def test_cpu_offload_on_cuda_adds_gloo_for_cpu_tensors():
    assert group_backend("nccl", CUDA, cpu_collectives=True) == CUDA_WITH_CPU_BACKEND
    assert CUDA_WITH_CPU_BACKEND == "cuda:nccl,cpu:gloo"
    assert group_backend("nccl", CUDA, cpu_collectives=False) == "nccl"
    # On the CPU, or with gloo for everything, one backend serves both: nothing changes.
    assert group_backend("gloo", CPU, cpu_collectives=True) == "gloo"
    assert group_backend("gloo", CUDA, cpu_collectives=True) == "gloo"


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine that shows one GPU, without touching a real one (set_device must not run)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def no_set_device(device):
        raise AssertionError(f"set_device({device}) ran")

    monkeypatch.setattr(torch.cuda, "set_device", no_set_device)
    for name in ("RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)


def test_local_rank_beyond_the_gpus_is_a_config_error_naming_both(one_gpu, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    cfg = Config()
    cfg.dist.device = "cuda"
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=3 needs GPU 3, .* shows 1 CUDA device"):
        validate_dist(cfg)
    # Also where the session is used directly, before any set_device ("invalid device ordinal").
    with (
        pytest.raises(ConfigError, match=r"LOCAL_RANK=3 .* 1 CUDA device"),
        distributed_session(DistConfig(device="cuda")),
    ):
        pass


def test_dist_device_cpu_stays_on_the_cpu_where_gpus_exist(one_gpu, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")  # would be refused on CUDA
    cfg = Config()
    cfg.dist.device = "cpu"
    validate_dist(cfg)
    with distributed_session(DistConfig(device="cpu")) as env:
        assert env.device == CPU and not env.distributed


def test_step_timeout_must_be_positive_or_null():
    cfg = Config()
    cfg.dist.step_timeout_s = 0.0
    with pytest.raises(ConfigError, match="dist.step_timeout_s"):
        validate_dist(cfg)
    cfg.dist.step_timeout_s = None
    validate_dist(cfg)


def test_shorten_timeout_without_a_group_or_a_value_does_nothing(monkeypatch):
    def must_not_run(*args):
        raise AssertionError("no group: nothing to change")

    monkeypatch.setattr(dist_env, "_set_timeout", must_not_run)
    shorten_timeout(600.0)  # no process group in this process
    shorten_timeout(None)


def test_flight_recorder_dumps_into_the_run_directory(tmp_path):
    environ: dict[str, str] = {}
    chosen = enable_flight_recorder(tmp_path, environ)
    assert (
        chosen
        == environ
        == {
            "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "nccl_flight_recorder" / "rank_"),
        }
    )
    assert (tmp_path / "nccl_flight_recorder").is_dir()


def test_flight_recorder_keeps_what_the_user_set(tmp_path):
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/r_"}
    chosen = enable_flight_recorder(tmp_path, environ)
    assert chosen == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"
    assert "TORCH_FR_DUMP_TEMP_FILE" not in environ
    assert not (tmp_path / "nccl_flight_recorder").exists()


# ---------------------------------------------------------------------- a CPU checkpoint on CUDA

SEED, STEP = 17, 7


class _SimulatedCuda:
    """torch.cuda's generator calls on a machine without CUDA: a device with a 16-byte state."""

    def __init__(self, monkeypatch) -> None:
        self.seeded: list[int] = []
        self.set_states: list[torch.Tensor] = []
        monkeypatch.setattr(
            torch.cuda, "get_rng_state", lambda device=None: torch.zeros(16, dtype=torch.uint8)
        )
        monkeypatch.setattr(
            torch.cuda, "set_rng_state", lambda s, device=None: self.set_states.append(s)
        )
        monkeypatch.setattr(torch.cuda, "manual_seed", self.seeded.append)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())


def _checkpointer(directory: Path, state: RunState, rng_state: rng.RngState) -> Checkpointer:
    parts = {
        "trainer": Part(state),
        "rng": Part(rng_state, per_rank=True, reset=lambda: pytest.fail("same world: no reset")),
    }
    return Checkpointer(
        CheckpointConfig(resume="auto"),
        directory=directory,
        parts=parts,
        rank=0,
        world_size=1,
        meta={},
        run_id="gpu-readiness",
    )


def _save_on_cpu(directory: Path) -> tuple[torch.Tensor, float]:
    """A checkpoint written on the CPU at STEP; returns its torch and Python streams' next draws."""
    written = RunState(step=STEP)
    saver = _checkpointer(directory, written, rng.RngState(CPU))
    torch.manual_seed(5)
    random.seed(5)
    saver.save(written)
    saver.close()
    return torch.rand(3), random.random()


def test_a_cpu_checkpoint_resumes_on_cuda_and_derives_the_cuda_stream(tmp_path, monkeypatch):
    expected_torch, expected_python = _save_on_cpu(tmp_path)
    cuda = _SimulatedCuda(monkeypatch)
    resumed = RunState()
    loader = _checkpointer(
        tmp_path, resumed, rng.RngState(CUDA, seed=SEED, rank=0, step=lambda: resumed.step)
    )
    torch.manual_seed(99)
    random.seed(99)
    assert loader.resume(resumed) is not None
    loader.close()
    assert resumed.step == STEP
    # What the checkpoint holds is restored exactly...
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_python
    # ...and the CUDA stream it lacks comes from (seed, rank, restored step).
    assert cuda.seeded == [rng.derive_seed(SEED, rank=0, step=STEP)] and not cuda.set_states


def test_without_the_load_request_the_cuda_stream_is_a_missing_key(tmp_path, monkeypatch):
    # The failure this fixes: asking the checkpoint for every live stream, rng/rank0.cuda included.
    _save_on_cpu(tmp_path)
    _SimulatedCuda(monkeypatch)
    monkeypatch.delattr(rng.RngState, "load_request")
    resumed = RunState()
    loader = _checkpointer(tmp_path, resumed, rng.RngState(CUDA, seed=SEED))
    with pytest.raises(CheckpointError, match="rng/rank0.cuda"):
        loader.resume(resumed)
    loader.close()


def test_a_cuda_stream_in_the_checkpoint_is_restored_not_derived(monkeypatch):
    cuda = _SimulatedCuda(monkeypatch)
    state = rng.RngState(CUDA, seed=SEED).state_dict()
    assert "cuda" in state
    rng.RngState(CUDA, seed=SEED).load_state_dict(state)
    assert len(cuda.set_states) == 1 and not cuda.seeded


# ---------------------------------------------------------------------- deterministic kernels


def test_deterministic_on_cuda_refuses_a_pool_without_a_deterministic_backward():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(2), nn.Flatten())
    with pytest.raises(ConfigError, match=r"loop.deterministic=true.*1 \(AdaptiveAvgPool2d"):
        rng.check_deterministic(model, CUDA, deterministic=True)
    rng.check_deterministic(model, CUDA, deterministic=False)
    rng.check_deterministic(model, CPU, deterministic=True)  # CPU kernels are deterministic
    upsample = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"))
    assert rng.nondeterministic_modules(upsample) and not rng.nondeterministic_modules(
        nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"))
    )


def test_resnets_pool_to_one_by_one_which_is_a_mean():
    # torch computes AdaptiveAvgPool2d(1) as a mean, whose backward is deterministic.
    model = torchvision.models.resnet18(num_classes=10)
    rng.check_deterministic(model, CUDA, deterministic=True)
    x = torch.randn(2, 3, 7, 7, requires_grad=True)
    assert type(model.avgpool(x).grad_fn).__name__ == "MeanBackward1"


# ---------------------------------------------------------------------- pipeline evaluation


def test_pipeline_evaluation_sends_over_the_stage_group(monkeypatch):
    # Rank 6 of the stage group [4, 6] holds stage 1 of 2: it receives stage 0's activations from
    # global rank 4, over the stage group (not the world, where NCCL would build another
    # communicator for the pair).
    stage_group = object()
    calls: list[tuple[str, int, object]] = []
    activations = torch.arange(8.0).reshape(2, 4)

    def recv(tensor, src, group=None):
        calls.append(("recv", src, group))
        header = torch.tensor([2, 0, 2, 4, 0, 0, 0, 0])  # 2-D float32 of shape (2, 4)
        tensor.copy_(header if tensor.dtype == torch.int64 else activations)

    monkeypatch.setattr(pipeline_mod.dist, "recv", recv)
    monkeypatch.setattr(pipeline_mod.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(pipeline_mod.dist, "get_process_group_ranks", lambda group: [4, 6])
    cfg = PipelineConfig(schedule="GPipe")
    stage = nn.Linear(4, 3)
    pipeline = pipeline_mod.Pipeline(None, [], [stage], [1], 2, cfg, stage_group)
    out = pipeline.forward(torch.zeros(2, 4))
    assert calls == [("recv", 4, stage_group)] * 2
    assert out is not None and torch.equal(out, stage(activations))

    sent: list[tuple[int, object]] = []
    monkeypatch.setattr(
        pipeline_mod.dist, "send", lambda t, dst, group=None: sent.append((dst, group))
    )
    first = pipeline_mod.Pipeline(None, [], [nn.Identity()], [0], 2, cfg, stage_group)
    assert first.forward(torch.zeros(2, 4)) is None
    assert sent == [(6, stage_group)] * 2
