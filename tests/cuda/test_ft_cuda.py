"""Replica groups on CUDA: the gradients cross the groups on torchft's NCCL group run in a
subprocess (``ProcessGroupBabyNCCL``, ``fault_tolerance.replica_backend=auto``), in buckets.

Each group is a process of its own running the room (sdnet_trainer/ft/room.py) around a small
CUDA model, against a lighthouse in the test's process. NCCL refuses two ranks of one
communicator on one device, so two groups need two GPUs; on one GPU the test runs one group
whose NCCL subprocess is killed during a step (what a peer's death does to a survivor's
communicator): that step is discarded, and the process goes on.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.support import assert_on_cuda

pytestmark = [pytest.mark.cuda, pytest.mark.gpu_second]

STEPS, KILL_AT = 6, 3
TIMEOUT_S = 240


def _group(address: str, group: int, groups: int, out: str, kill: str) -> None:
    """One replica group: STEPS steps of SGD on a Linear model on cuda:group; ``kill`` is
    "self" (SIGKILL this process before step KILL_AT's reduction), "nccl" (kill the NCCL
    subprocess there) or ""."""
    from sdnet_trainer.checkpoint.parts import ModelState, Part
    from sdnet_trainer.config.fault_tolerance import FaultToleranceConfig, FTTimeoutsConfig
    from sdnet_trainer.ft.room import FaultTolerance

    device = torch.device("cuda", group % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 256).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = FaultToleranceConfig(
        enabled=True, lighthouse=address, groups=groups, min_groups=1, replica_group=group,
        bucket_mb=0.25, timeouts=FTTimeoutsConfig(connect_s=10, step_s=20, quorum_s=60),
    )  # fmt: skip
    room = FaultTolerance(
        cfg, group_rank=0, group_size=1, distributed=False, after_load=lambda: None, step=0,
        parts={"model": Part(ModelState(model))}, device=device,
    )  # fmt: skip
    committed = []
    try:
        for step in range(1, STEPS + 1):
            room.begin_step()
            optimizer.zero_grad()
            x = torch.full((8, 512), float(group + step), device=device)
            model(x).square().mean().backward()
            if step == KILL_AT and kill == "self":
                os.kill(os.getpid(), signal.SIGKILL)
            if step == KILL_AT and kill == "nccl":
                room.pg._p.kill()  # torchft's NCCL subprocess
            room.reduce_gradients(model)
            if room.should_commit():
                optimizer.step()
                committed.append(step)
        torch.cuda.synchronize()
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save({"backend": room.backend, "committed": committed, "params": params}, out)
    finally:
        room.close()


def _run(tmp_path: Path, groups: int, kills: list[str]) -> list[dict | None]:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000
    )
    spawn = multiprocessing.get_context("spawn")
    outs = [tmp_path / f"g{g}.pt" for g in range(groups)]
    procs = [
        spawn.Process(target=_group, args=(server.address(), g, groups, str(outs[g]), kills[g]))
        for g in range(groups)
    ]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(TIMEOUT_S)
            assert proc.exitcode is not None, "a group did not finish in time"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        server.shutdown()
    return [torch.load(out, weights_only=False) if out.exists() else None for out in outs]


def test_one_group_survives_the_death_of_its_nccl_subprocess(tmp_path):
    (result,) = _run(tmp_path, 1, ["nccl"])
    assert result is not None and result["backend"] == "nccl"
    assert_on_cuda(list(result["params"].values()))
    # The steps before commit through NCCL; the one whose collective died is discarded, and the
    # process lives on to the end (whether a lone group's next quorum rebuilds its NCCL group is
    # torchft's quorum's to say: not asserted).
    assert result["committed"][: KILL_AT - 1] == list(range(1, KILL_AT))
    assert KILL_AT not in result["committed"]


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="two replica groups on NCCL need two GPUs (NCCL refuses two ranks on one device)",
)
def test_two_groups_on_nccl_agree_and_the_survivor_of_a_kill_goes_on(tmp_path):
    both = _run(tmp_path / "both", 2, ["", ""])
    assert all(r is not None and r["backend"] == "nccl" for r in both)
    a, b = (r["params"] for r in both)  # type: ignore[index]
    assert_on_cuda(list(a.values()))
    assert all(torch.equal(a[k], b[k].to(a[k].device)) for k in a)
    survivor, dead = _run(tmp_path / "kill", 2, ["", "self"])
    assert dead is None and survivor is not None
    assert_on_cuda(list(survivor["params"].values()))
    assert KILL_AT not in survivor["committed"] and survivor["committed"][-1] == STEPS
