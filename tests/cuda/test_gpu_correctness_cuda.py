"""One GPU: what the CPU suite can only simulate (issue 12, items 1, 3, 4, 5, 14 and 15).

- FSDP2 with CPU offload reduces CPU gradients over the group's gloo half (item 1);
- ``loop.deterministic=true``: the module check agrees with what torch's CUDA kernels do (item 3);
- a CPU-written checkpoint resumed on CUDA derives the CUDA stream from (seed, rank, step) (item 4);
- ``LOCAL_RANK`` beyond the GPUs is a config error naming both numbers (item 5);
- the NCCL group: flight recorder, shortened timeout, ZeRO bucket views, DDP released by
  ``GradientComm.release``, and a short run that exits promptly with the watchdog on (item 14/15);
- the profiler never traces step 1 on CUDA (item 15).
"""

from __future__ import annotations

import gzip
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from sdnet_trainer.checkpoint.parts import Part
from sdnet_trainer.config.schema import CheckpointConfig, Config, ProfileConfig
from sdnet_trainer.distributed.env import validate_dist
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.observability.profiler import StepProfiler
from sdnet_trainer.runtime import rng
from sdnet_trainer.training.checkpointer import Checkpointer
from sdnet_trainer.training.state import RunState
from tests.cuda import _gpu_correctness_worker as worker
from tests.cuda.launches import LAUNCHES
from tests.support import (
    PROBE_FILE,
    REPO,
    assert_on_cuda,
    cli_env,
    read_probe,
    run_cli,
)

pytestmark = pytest.mark.cuda

GPU = torch.device("cuda", 0)


# ---------------------------------------------------------------------- the NCCL group (1, 14, 15)


@pytest.fixture(scope="module")
def group_results(tmp_path_factory) -> tuple[dict, Path]:
    out_dir = tmp_path_factory.mktemp("gpu_group")
    group = LAUNCHES["nccl_group"]
    launch = run_cli(
        [str(out_dir), *group.keys],
        cwd=out_dir,
        nproc=group.nproc,
        script=Path(worker.__file__),
        fork=False,
    )
    assert launch.returncode == 0, launch.output
    return torch.load(out_dir / "results.pt", weights_only=False), out_dir


def test_cpu_offloaded_gradients_reduce_over_gloo(group_results):
    offload = group_results[0]["cpu_offload"]
    assert_on_cuda(offload["compute_devices"])  # computed on the GPU, parameters at rest on the CPU
    assert offload["backend"] == "cuda:nccl,cpu:gloo"
    assert offload["grad_devices"] == ["cpu"]  # CPU DTensors: the case that needed gloo
    assert offload["norm"] == pytest.approx(offload["reference"], rel=1e-5)


def test_the_flight_recorder_dumps_into_the_run_directory(group_results):
    results, out_dir = group_results
    recorder = results["flight_recorder"]
    want = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(out_dir / "nccl_flight_recorder" / "rank_"),
    }
    for key, value in want.items():
        assert recorder[key] == os.environ.get(key, value), key  # a user's setting is kept
    # The recorder is on and holds what a timeout would dump there: the CUDA all-reduces this
    # rank issued on the NCCL group (the shortened-timeout check's two, at least).
    recorded = results["recorded"]
    assert "nccl:all_reduce" in recorded["names"] and recorded["entries"] >= 2, recorded
    assert_on_cuda(results["shorten_timeout"]["device"])
    if "TORCH_FR_DUMP_TEMP_FILE" not in os.environ:
        assert (out_dir / "nccl_flight_recorder").is_dir()


def test_the_shortened_nccl_group_still_runs_collectives(group_results):
    shortened = group_results[0]["shorten_timeout"]
    assert_on_cuda(shortened["device"])
    assert shortened["value"] == 1.0  # the all-reduces ran, on the world and on a mesh group
    # The session's timeout (dist.timeout_s=300) on the default group before; the step timeout
    # (30 s) on the default group and on both mesh groups after, as their NCCL backends report.
    assert shortened["before"]["world"] == 300.0, shortened
    assert shortened["after"] == {"world": 30.0, "a": 30.0, "b": 30.0}, shortened


def test_release_lets_the_cuda_ddp_model_go(group_results):
    release = group_results[0]["release"]
    assert_on_cuda(release["model_device"])
    assert release == {
        "kept_before_release": True,
        "kept_after_release": False,
        "model_device": "cuda:0",
    }


@pytest.mark.timeout(240)
def test_a_short_run_with_the_default_watchdog_exits_promptly(tmp_path):
    run_dir = tmp_path / "run"
    launch = run_cli(
        [*LAUNCHES["watchdog_short_run"].keys, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        nproc=LAUNCHES["watchdog_short_run"].nproc,
        fork=False,
    )
    ended = time.time()
    assert launch.returncode == 0, launch.output
    probe = read_probe(run_dir)
    assert_on_cuda(probe["device"], probe["batch_devices"])
    # The watchdog is on by default (health.hang_timeout_s=1200) and stopped at the end: the
    # process did not wait for its thread or its faulthandler timer.
    assert "watchdog armed on rank 0: timeout 1200 s" in (run_dir / "hang_rank0.log").read_text()
    assert "made no progress" not in launch.output
    # run_cli's timeout bounds the whole launch; prompt is from the end of training (the probe,
    # written as fit returns) to the end of torchrun: the session's teardown and the exit.
    exit_s = ended - (run_dir / PROBE_FILE.format(rank=0)).stat().st_mtime
    assert exit_s < 60, exit_s
    assert (run_dir / "nccl_flight_recorder").is_dir()


# ---------------------------------------------------------------------- deterministic kernels (3)

_DETERMINISTIC_SCRIPT = """
import os, torch, torchvision
from torch import nn
from sdnet_trainer.runtime import rng
from sdnet_trainer.errors import ConfigError
rng.seed_everything(0, deterministic=True)
gpu = torch.device("cuda", 0)
resnet = torchvision.models.resnet18(num_classes=10).to(gpu).to(memory_format=torch.channels_last)
rng.check_deterministic(resnet, gpu, deterministic=True)
x = torch.randn(2, 3, 64, 64, device=gpu).to(memory_format=torch.channels_last)
resnet(x).sum().backward()
print("resnet devices:", next(resnet.parameters()).device, x.device)
print("resnet backward ok")
pooled = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(2)).to(gpu)
try:
    rng.check_deterministic(pooled, gpu, deterministic=True)
except ConfigError as err:
    print("refused:", err)
try:
    pooled(torch.randn(2, 3, 9, 9, device=gpu)).sum().backward()
except RuntimeError as err:
    print("torch raised:", "deterministic" in str(err))
"""


def test_deterministic_check_agrees_with_torchs_cuda_kernels():
    # A fresh process: use_deterministic_algorithms and the cuBLAS workspace are process-wide.
    done = subprocess.run(
        [sys.executable, "-c", _DETERMINISTIC_SCRIPT],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # ResNets pool to 1x1, a mean: their backward runs deterministically, as the check says.
    assert "resnet backward ok" in done.stdout
    (devices,) = [line for line in done.stdout.splitlines() if line.startswith("resnet devices:")]
    assert_on_cuda(devices.split()[2:])
    # A real 2x2 pool: refused by the check, and torch's backward indeed raises.
    assert "refused: loop.deterministic=true" in done.stdout
    assert "torch raised: True" in done.stdout


# ---------------------------------------------------------------------- CPU checkpoint on CUDA (4)


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
        run_id="gpu-rng",
    )


def test_a_cpu_checkpoint_resumes_on_cuda_with_a_derived_cuda_stream(tmp_path):
    seed, step = 11, 5
    written = RunState(step=step)
    saver = _checkpointer(tmp_path, written, rng.RngState(torch.device("cpu")))
    torch.manual_seed(3)
    random.seed(3)
    saver.save(written)
    saver.close()
    expected_cpu = torch.rand(4)

    torch.cuda.manual_seed(123)  # whatever the CUDA stream was before the resume
    resumed = RunState()
    loader = _checkpointer(
        tmp_path, resumed, rng.RngState(GPU, seed=seed, rank=0, step=lambda: resumed.step)
    )
    assert loader.resume(resumed) is not None  # no "Missing key rng/rank0.cuda"
    loader.close()
    draws = torch.rand(4, device=GPU)
    assert_on_cuda(draws)
    assert torch.equal(torch.rand(4), expected_cpu)
    with torch.cuda.device(GPU):
        torch.cuda.manual_seed(rng.derive_seed(seed, rank=0, step=step))
    assert torch.equal(draws, torch.rand(4, device=GPU))


# ---------------------------------------------------------------------- LOCAL_RANK (5)


def test_local_rank_beyond_the_gpus_is_a_config_error(monkeypatch, tmp_path):
    count = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_RANK", str(count))
    cfg = Config()
    cfg.dist.device = "cuda"
    with pytest.raises(ConfigError, match=rf"LOCAL_RANK={count} .* shows {count} CUDA device"):
        validate_dist(cfg)
    launch = run_cli(
        [*LAUNCHES["local_rank_beyond"].keys, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env={"LOCAL_RANK": str(count)},
        fork=False,
    )
    assert launch.returncode == 2, launch.output
    assert f"LOCAL_RANK={count} needs GPU {count}" in launch.output
    assert "invalid device ordinal" not in launch.output


# ---------------------------------------------------------------------- profiler (15)


def test_the_profiler_never_traces_the_autotuning_step(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)  # process-wide: put back after
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)).to(GPU)
    cfg = ProfileConfig(enabled=True, wait=0, warmup=0, active=2)
    profiler = StepProfiler(cfg, output_dir=tmp_path, rank=0, device=GPU)
    assert_on_cuda(model)
    with profiler:
        for _ in range(5):
            model(torch.randn(4, 3, 32, 32, device=GPU)).sum().backward()
            profiler.step()
    (trace,) = (tmp_path / "profile").glob("rank0.*.pt.trace.json*")
    text = gzip.decompress(trace.read_bytes()) if trace.suffix == ".gz" else trace.read_bytes()
    # Steps 0 and 1 untraced (autotuning, start-up); 2 and 3 recorded.
    assert b"ProfilerStep#2" in text and b"ProfilerStep#3" in text
    assert b"ProfilerStep#0" not in text and b"ProfilerStep#1" not in text
