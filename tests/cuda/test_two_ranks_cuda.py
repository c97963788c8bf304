"""Two ranks on the one GPU of a node, over gloo with CUDA tensors, against one process.

NCCL refuses two ranks on one device, so a one-GPU node cannot run NCCL data parallelism; gloo
runs collectives on CUDA tensors (staging them through host memory), which exercises the CUDA side
of the same paths: the DDP wrapper around a CUDA module, its bucketed gradient all-reduce, the
step's agreement, the metrics' gathers, and an async checkpoint of device tensors written by both
ranks. Each run must train as one process does on the concatenated batch
(tests/distributed/test_ddp.py proves the same on the CPU), and its last checkpoint must hold the
final weights.

FSDP2 the same way: gloo has CUDA paths for the all-gather into one tensor and implements the
reduce-scatter as an all-reduce, so torch allows it; scripts/ci/gpu_check.sh runs that case in its
full profile only (GPU_CHECK_FULL=1), the one-rank NCCL run of test_fit_cuda.py covering FSDP2 on
the GPU in the default one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sdnet_trainer.checkpoint.manager import CheckpointManager
from tests.cuda._two_rank_worker import FULL_PARAMS
from tests.support import CUDA, FINAL_STATE, TINY_RUN, assert_on_cuda, read_probe, run_cli

pytestmark = pytest.mark.cuda

WORKER = Path(__file__).with_name("_two_rank_worker.py")
STEPS = 8
RUN = [
    *TINY_RUN,
    "dist.backend=gloo",
    "precision.tf32=false",  # fp32 math: the two layouts agree to rounding
    f"loop.max_steps={STEPS}",
    "loop.global_batch_size=32",
    "loop.eval_at_end=false",
    "checkpoint.every_n_steps=4",
    "checkpoint.async_save=true",
    "checkpoint.keep_last=2",
]


def _run(tmp_path: Path, name: str, device_keys: list[str], nproc: int | None) -> Path:
    out = tmp_path / name
    out.mkdir()
    launch = run_cli(
        [str(out), *device_keys, *RUN],
        cwd=tmp_path,
        nproc=nproc,
        script=WORKER,
        timeout=200,
        fork=False,
    )
    assert launch.returncode == 0, launch.output
    return out


def two_ranks_against_one(
    tmp_path: Path, device_keys: list[str], strategy: str
) -> dict[str, list[dict]]:
    """Runs the reference and the two-rank run with ``parallel=strategy``, checks that they
    trained alike and that the two-rank run's last checkpoint holds its final weights; returns
    their probes."""
    keys = [*device_keys, f"parallel={strategy}"]
    single = _run(tmp_path, "single", keys, nproc=None)
    double = _run(tmp_path, "two", keys, nproc=2)
    reference = torch.load(single / FINAL_STATE, weights_only=True)
    run = torch.load(double / FINAL_STATE, weights_only=True)
    want = torch.load(single / FULL_PARAMS, weights_only=True)
    got = torch.load(double / FULL_PARAMS, weights_only=True)

    if strategy == "ddp":
        # Every step reduced the gradients through DDP's buckets (a CUDA module: over gloo).
        assert len(run["allreduce_calls"]) == STEPS and min(run["allreduce_calls"]) >= 1, run
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-3, abs=1e-5)
    assert got.keys() == want.keys() and got
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-3, atol=1e-5, msg=name)

    # Both ranks took part in the checkpoints of steps 4 and 8 of device tensors; the last holds
    # the weights the run ended with.
    manager = CheckpointManager(
        double / "checkpoints", keep_last=2, async_save=False, rank=0, world_size=1
    )
    try:
        assert [c.step for c in manager.checkpoints()] == [4, STEPS]
        latest = manager.latest()
        assert latest is not None
        target = {"model": {k: torch.zeros_like(v) for k, v in got.items()}}
        manager.load(latest, target)
    finally:
        manager.close()
    for name, value in got.items():
        assert torch.equal(target["model"][name], value), name
    return {
        "single": [read_probe(single)],
        "two": [read_probe(double, rank) for rank in (0, 1)],
    }


@pytest.mark.timeout(300)
def test_ddp_over_gloo_with_cuda_tensors_on_one_gpu_matches_one_process(tmp_path):
    probes = two_ranks_against_one(tmp_path, CUDA, "ddp")
    for probe in probes["single"] + probes["two"]:
        # Model and batches on the GPU in every process: nothing fell back to the CPU.
        assert_on_cuda(probe["device"], probe["batch_devices"])
        assert probe["steps"] == STEPS, probe
    for rank, probe in enumerate(probes["two"]):
        assert probe["backend"] == "gloo" and probe["world_size"] == 2, probe
        assert probe["ddp"] is True and probe["model_class"] == "DistributedDataParallel", probe
        assert probe["device"] == "cuda:0", (rank, probe)
    assert probes["single"][0]["ddp"] is False and probes["single"][0]["world_size"] == 1


@pytest.mark.timeout(300)
def test_fsdp_over_gloo_with_cuda_tensors_on_one_gpu_matches_one_process(tmp_path):
    probes = two_ranks_against_one(tmp_path, CUDA, "fsdp")
    for probe in probes["single"] + probes["two"]:
        assert_on_cuda(probe["device"], probe["batch_devices"])
        assert probe["steps"] == STEPS, probe
    for probe in probes["two"]:
        # Sharded over the two ranks: FSDPModule wrappers and DTensor parameters on the GPU.
        assert probe["backend"] == "gloo" and probe["world_size"] == 2, probe
        assert probe["fsdp"] is True and probe["dtensor_params"] > 0, probe
