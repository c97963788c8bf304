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
from tests.cuda.launches import LAUNCHES, TWO_RANK_STEPS
from tests.support import FINAL_STATE, assert_on_cuda, read_probe, run_cli

pytestmark = pytest.mark.cuda

WORKER = Path(__file__).with_name("_two_rank_worker.py")
STEPS = TWO_RANK_STEPS


def _run(tmp_path: Path, name: str) -> Path:
    """The launch ``LAUNCHES[name]`` through the worker, into ``tmp_path/name``: its overrides as
    registered, in their order, and its world size; the worker's one argument of its own, the
    output folder, goes first. Nothing is added to the overrides here, so no caller's keys can
    land after the shared ones and lose to them (tests/unit/test_cuda_launches.py checks each
    launch on the CPU)."""
    launch = LAUNCHES[name]
    out = tmp_path / name
    out.mkdir()
    result = run_cli(
        [str(out), *launch.keys],
        cwd=tmp_path,
        nproc=launch.nproc,
        script=WORKER,
        timeout=200,
        fork=False,
    )
    assert result.returncode == 0, result.output
    return out


def two_ranks_against_one(tmp_path: Path, single_run: str, two_ranks: str) -> dict[str, list[dict]]:
    """Runs the reference (launch ``single_run``) and the two-rank run (``two_ranks``), checks
    that they trained alike and that the two-rank run's last checkpoint holds its final weights;
    returns their probes."""
    single = _run(tmp_path, single_run)
    double = _run(tmp_path, two_ranks)
    reference = torch.load(single / FINAL_STATE, weights_only=True)
    run = torch.load(double / FINAL_STATE, weights_only=True)
    want = torch.load(single / FULL_PARAMS, weights_only=True)
    got = torch.load(double / FULL_PARAMS, weights_only=True)

    if "parallel=ddp" in LAUNCHES[two_ranks].keys:
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
    probes = two_ranks_against_one(tmp_path, "ddp_single", "ddp_two_ranks")
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
    probes = two_ranks_against_one(tmp_path, "fsdp_single", "fsdp_two_ranks")
    for probe in probes["single"] + probes["two"]:
        assert_on_cuda(probe["device"], probe["batch_devices"])
        assert probe["steps"] == STEPS, probe
    for probe in probes["two"]:
        # Sharded over the two ranks: FSDPModule wrappers and DTensor parameters on the GPU.
        assert probe["backend"] == "gloo" and probe["world_size"] == 2, probe
        assert probe["fsdp"] is True and probe["dtensor_params"] > 0, probe
