"""Several "nodes" on one machine: each node's launcher is its own process tree, as on a cluster.

Two torchrun agents meet through c10d rendezvous (the command docs/multinode.md gives for N nodes),
or through a static master address set the way the Kubeflow operator sets it, and must train
exactly like both processes on one node; submitit's local executor (the stand-in for Hydra's
SLURM launcher) starts tasks without torchrun and must do the same.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.support import FINAL_STATE, TINY, cli_env, free_port, run_cli

TARGET = "trainer._target_=tests.support.RecordingTrainer"
# No checkpoint at the end: the runs are compared by what RecordingTrainer saves (final.pt).
COMMON = TINY + [
    TARGET,
    "loop.max_steps=6",
    "loop.global_batch_size=32",
    "checkpoint.save_on_exit=false",
]
AGENT_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def one_agent(tmp_path_factory) -> dict:
    """The reference: two processes on one node (forked ready-imported, tests/forked.py)."""
    tmp_path = tmp_path_factory.mktemp("one_agent")
    launch = run_cli(COMMON + [f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, nproc=2)
    assert launch.returncode == 0, launch.output
    return torch.load(tmp_path / "run" / FINAL_STATE, weights_only=True)


def _assert_same_training(run: dict, reference: dict) -> None:
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-7)
    for name, value in reference["params"].items():
        torch.testing.assert_close(run["params"][name], value, rtol=1e-5, atol=1e-7)
    for key in ("val/loss", "val/top1"):
        assert run["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-5)


def _start_agent(
    cmd: list[str], *, cwd, log, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """One "node": its own session (so its whole process tree can be killed), output to ``log``
    (a file: a pipe nobody reads while the other agent is awaited could fill and block)."""
    # An SDNET_RUN_ID from the calling shell would name the run instead of the launch under test.
    full_env = {k: v for k, v in {**cli_env(), **(env or {})}.items() if k != "SDNET_RUN_ID"}
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd, cwd=cwd, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_all(procs: list[subprocess.Popen], logs: list) -> None:
    """Wait for every agent, then kill whatever is left of every process tree; fail with all the
    agents' output if one timed out (AGENT_TIMEOUT_S) or failed."""
    deadline = time.monotonic() + AGENT_TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = "\n---\n".join(Path(log).read_text() for log in logs)
    assert all(proc.returncode == 0 for proc in procs), output


def test_two_agents_with_c10d_rendezvous_train_like_one_agent(tmp_path, one_agent):
    rdzv_id = f"sdnet-{uuid.uuid4().hex[:8]}"
    endpoint = f"127.0.0.1:{free_port()}"
    agent = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        "-m",
        "sdnet_trainer",
        *COMMON,
        f"run.root={tmp_path / 'outputs'}",
        "run.name=multinode",
    ]
    logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    _wait_all([_start_agent(agent, cwd=tmp_path, log=log) for log in logs], logs)

    # No run dir on the command line: both nodes agreed on outputs/<run.name>/<rdzv id>.
    assert [p.name for p in (tmp_path / "outputs" / "multinode").iterdir()] == [rdzv_id]
    run_dir = tmp_path / "outputs" / "multinode" / rdzv_id
    assert "world size 2" in (run_dir / "train.log").read_text()
    _assert_same_training(torch.load(run_dir / FINAL_STATE, weights_only=True), one_agent)


def test_static_rendezvous_from_operator_environment_trains_like_one_agent(tmp_path, one_agent):
    """The static --node_rank/--master_addr form, given as the Kubeflow operator gives it
    (deploy/k8s/pytorchjob.yaml): PET_* variables that torchrun reads as its options, and the
    operator's own RANK/WORLD_SIZE per pod, which torchrun replaces for its workers."""
    port = free_port()
    agent = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "-m",
        "sdnet_trainer",
        *COMMON,
        f"run.root={tmp_path / 'outputs'}",
        "run.name=static",
        "run.id=job-1",
    ]
    node_env = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
    }
    logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    _wait_all(
        [
            _start_agent(
                agent,
                cwd=tmp_path,
                log=logs[rank],
                env={**node_env, "PET_NODE_RANK": str(rank), "RANK": str(rank)},
            )
            for rank in range(2)
        ],
        logs,
    )

    run_dir = tmp_path / "outputs" / "static" / "job-1"
    assert "world size 2" in (run_dir / "train.log").read_text()
    _assert_same_training(torch.load(run_dir / FINAL_STATE, weights_only=True), one_agent)


def test_submitit_tasks_without_torchrun_train_like_one_agent(tmp_path, one_agent):
    pytest.importorskip("submitit")  # the `slurm` extra: hydra-submitit-launcher
    sweep_dir = tmp_path / "sweep"
    launch = run_cli(
        [
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.tasks_per_node=2",
            "hydra.launcher.timeout_min=3",
            f"hydra.sweep.dir={sweep_dir}",
            *COMMON,
        ],
        cwd=tmp_path,
        timeout=AGENT_TIMEOUT_S,
    )
    assert launch.returncode == 0, launch.output
    # submitit started two plain processes; sdnet_trainer.distributed.launchers gave them ranks.
    assert "world size 2" in (sweep_dir / "0" / "train.log").read_text()
    _assert_same_training(torch.load(sweep_dir / "0" / FINAL_STATE, weights_only=True), one_agent)
