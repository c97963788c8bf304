"""Real faults on 2 processes (gloo): a killed rank, preemption and resume on another world size,
non-finite losses, a hung rank, a killed torchrun agent, a backend without its device, a checkpoint
that cannot be written. FaultTrainer and SignalTrainer (tests/support.py) inject them. The faults
inside the training loop run forked ready-imported (tests/forked.py); a restart after a killed
rank and a killed agent are torchrun's, under torchrun.

The killed rank's run and one of the resumes on another world size keep their checkpoints in
object storage (a local S3 server, the ``s3`` fixture of tests/conftest.py), the others on disk:
the same guarantees, from either."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import pytest
import torch

from sdnet_trainer.checkpoint import CheckpointManager
from sdnet_trainer.cli import EXIT_CHECKPOINT
from tests.support import (
    FINAL_STATE,
    S3_CREDENTIALS,
    TINY,
    checkpoint_names,
    child_processes,
    kill_processes,
    process_command,
    read_jsonl,
    run_cli,
    seen_samples,
    start_command,
    torchrun_command,
    wait_until,
)

TARGET = "trainer._target_=tests.support.FaultTrainer"
# 256 samples / global batch 32 = 8 steps per epoch.
COMMON = TINY + [TARGET, "loop.global_batch_size=32", "loop.eval_at_end=false", "sched=cosine"]


def _final(run_dir):
    return torch.load(run_dir / FINAL_STATE, weights_only=True)


def test_rank_killed_while_its_async_save_uploads_restarts_and_ends_bitwise_equal(
    tmp_path, s3, caplog, monkeypatch
):
    """Checkpoints in S3, saved asynchronously: rank 1 is SIGKILLed while the save of step 6
    uploads (its shard written, the save not finished). torchrun restarts both ranks, which
    resume on their own (checkpoint.resume=auto) from step 4, the newest committed step, never
    the uncommitted 6, and end bitwise equal to a run without faults (on disk, saved
    synchronously). The store's endpoint comes from checkpoint.storage_options, the credentials
    from the environment."""
    args = COMMON + ["loop.max_steps=10", "checkpoint.every_n_steps=2"]
    clean = run_cli(args + [f"hydra.run.dir={tmp_path / 'clean'}"], cwd=tmp_path, nproc=2)
    assert clean.returncode == 0, clean.output
    store = f"{s3.url}/run/checkpoints"
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the run is told it, the credentials it finds
    killed = run_cli(
        args
        + [
            f"hydra.run.dir={tmp_path / 'killed'}",
            f"checkpoint.dir={store}",
            "checkpoint.async_save=true",
            f"+checkpoint.storage_options.endpoint_url={s3.endpoint}",
        ],
        cwd=tmp_path,
        nproc=2,
        torchrun_args=("--max-restarts=1",),
        env={"SDNET_TEST_KILL_IN_UPLOAD": "1:6"},
    )
    assert killed.returncode == 0, killed.output
    assert "failed (exitcode: -9) local_rank: 1" in killed.output, killed.output
    assert f"skipping checkpoint {store}/step_00000006: no manifest.json" in killed.output
    assert f"resumed from {store}/step_00000004: step 4" in killed.output, killed.output
    expected, got = _final(tmp_path / "clean"), _final(tmp_path / "killed")
    for name, value in expected["params"].items():
        assert torch.equal(got["params"][name], value), name
    assert got["losses"] == expected["losses"][4:]  # the restarted attempt ran steps 5..10
    assert not (tmp_path / "killed" / "checkpoints").exists()  # nothing on the local disk
    # The credentials are nowhere in what the run wrote or said: its folder, the manifests, logs.
    secret = S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"].encode()
    assert secret not in killed.output.encode()
    assert not [
        p for p in (tmp_path / "killed").rglob("*") if p.is_file() and secret in p.read_bytes()
    ]
    manifest = s3.fs.cat(s3.key(f"{store}/step_00000010/manifest.json"))
    assert s3.endpoint.encode() in manifest and secret not in manifest  # its config, no secret
    # One object of the newest step lost: a resume takes the previous committed step, saying so.
    s3.fs.rm(s3.key(f"{store}/step_00000010/__1_0.distcp"))
    reader = CheckpointManager(
        store,
        keep_last=3,
        async_save=False,
        rank=0,
        world_size=1,
        storage_options={"endpoint_url": s3.endpoint},
    )
    with caplog.at_level(logging.WARNING, logger="sdnet_trainer.checkpoint"):
        chosen = reader.resolve_resume("auto")
    reader.close()
    assert chosen is not None and chosen.step == 8
    warning = next(r.getMessage() for r in caplog.records if "resume=auto" in r.getMessage())
    assert f"{store}/step_00000010" in warning and "__1_0.distcp is missing" in warning


NO_DROPOUT = {"SDNET_TEST_DROPOUT": "0"}  # re-derived random streams would make dropout differ


@pytest.fixture(scope="module")
def uninterrupted_8_steps(tmp_path_factory):
    """The run directory of 8 steps in one process, without dropout: the reference of both
    world-size changes."""
    tmp = tmp_path_factory.mktemp("ref")
    reference = run_cli(
        COMMON + ["loop.max_steps=8", f"hydra.run.dir={tmp / 'ref'}"], cwd=tmp, env=NO_DROPOUT
    )
    assert reference.returncode == 0, reference.output
    return tmp / "ref"


@pytest.mark.parametrize("first, second, storage", [(2, 1, "s3"), (1, 2, "disk")])
def test_resume_on_another_world_size_visits_each_sample_once(
    tmp_path, uninterrupted_8_steps, first, second, storage, request
):
    args = COMMON + ["loop.max_steps=8", f"hydra.run.dir={tmp_path / 'run'}"]
    where = f"{tmp_path / 'run' / 'checkpoints'}"
    if storage == "s3":  # the bucket's endpoint and credentials come from the environment
        where = f"{request.getfixturevalue('s3').url}/run"
        args.append(f"checkpoint.dir={where}")
    env = NO_DROPOUT
    # Preempted during step 2: the ranks agree during step 3, save it and exit with 143.
    stopped = run_cli(
        args,
        cwd=tmp_path,
        nproc=first if first > 1 else None,
        env={**env, "SDNET_TEST_SIGTERM": "0:2"},
    )
    assert stopped.returncode == 143 and "SIGTERM: stopped at step 3" in stopped.output, (
        stopped.output
    )
    resumed = run_cli(args, cwd=tmp_path, nproc=second if second > 1 else None, env=env)
    assert resumed.returncode == 0, resumed.output
    assert f"resumed from {where}/step_00000003: step 3" in resumed.output, resumed.output
    assert f"written by {first} ranks; random streams re-derived" in resumed.output

    seen = seen_samples(tmp_path / "run")
    assert sorted(seen) == list(range(256))  # the whole epoch, every sample exactly once
    expected, got = _final(uninterrupted_8_steps), _final(tmp_path / "run")
    assert got["losses"] == pytest.approx(expected["losses"][3:], rel=1e-4)
    for name, value in expected["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-6)


def test_nonfinite_on_one_rank_aborts_every_rank_naming_the_step(tmp_path):
    run = run_cli(
        COMMON + ["loop.max_steps=6", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        nproc=2,
        env={"SDNET_TEST_NAN": "1:3"},
    )
    assert run.returncode == 3, run.output
    assert "non-finite loss or gradients at step 3 on rank 1: loss" in run.output


def _saved_tensors(step_dir, tmp_path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors by their path (DCP's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)

    walk("", torch.load(out, weights_only=False))
    return flat


def test_nonfinite_skip_on_one_rank_skips_on_every_rank(tmp_path):
    """Rank 1's loss is NaN at step 3: both ranks skip the update on the device (the fused
    optimizer's found_inf), so the weights, the optimizer state and the weights' average saved
    after step 3 are bitwise those saved after step 2; step 4 trains on."""
    args = ["health.nonfinite=skip", "checkpoint.every_n_steps=1", "checkpoint.keep_last=10"]
    ema = ["model.ema.enabled=true", "model.ema.warmup_steps=1"]
    run = run_cli(
        COMMON + ["loop.max_steps=6", *args, *ema, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        nproc=2,
        env={"SDNET_TEST_NAN": "1:3"},
    )
    assert run.returncode == 0, run.output
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["train/nonfinite_steps"] for r in rows if r["step"] == 6 and "train/loss" in r] == [
        1.0
    ]
    saved = {
        step: _saved_tensors(tmp_path / "run" / "checkpoints" / f"step_{step:08d}", tmp_path)
        for step in (2, 3, 4)
    }
    moved = [k for k in saved[2] if k.startswith(("/model", "/optim", "/ema"))]
    assert {k.split("/")[1] for k in moved} == {"model", "optim", "ema"}, sorted(saved[2])
    assert all(torch.equal(saved[2][k], saved[3][k]) for k in moved)
    assert not all(torch.equal(saved[3][k], saved[4][k]) for k in moved)  # step 4 trained


def test_hung_rank_ends_every_rank_with_stack_dumps(tmp_path):
    started = time.monotonic()
    run = run_cli(
        COMMON
        + ["loop.max_steps=6", "health.hang_timeout_s=3", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        nproc=2,
        env={"SDNET_TEST_SLEEP": "1:3"},
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert run.returncode != 0
    assert elapsed < 60, elapsed  # the process group's own timeout is 30 minutes
    dumps = {rank: (tmp_path / "run" / f"hang_rank{rank}.log").read_text() for rank in (0, 1)}
    for rank in (0, 1):  # each names the phase it was stuck in, then dumps every thread's stack
        assert "made no progress" in dumps[rank] and "of step 3" in dumps[rank]
        assert "most recent call first" in dumps[rank]
    # rank 0 ran out first, waiting in the gradients' all-reduce; the hung rank sleeps in its loss
    assert "'forward/backward (gradient reduction)' of step 3" in dumps[0]
    assert "in compute_loss" in dumps[1]


# ---------------------------------------------------------------------- the launcher and our exits

SIGNALS = TINY + [
    "trainer._target_=tests.support.SignalTrainer",
    "loop.global_batch_size=32",
    "loop.eval_at_end=false",
    "sched=cosine",
]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_workers_die_with_a_killed_torchrun_agent(tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    args = SIGNALS + [
        "loop.max_steps=1000",
        "checkpoint.every_n_steps=1",
        f"hydra.run.dir={run_dir}",
    ]
    log = tmp_path / "torchrun.log"
    agent = start_command(
        torchrun_command(args, nproc=2),
        cwd=tmp_path,
        log=log,
        env={"SDNET_TEST_STEP_DELAY": "0.1"},
    )
    workers: dict[int, str] = {}
    try:
        wait_until(
            lambda: len(checkpoint_names(checkpoints)) >= 2 or agent.poll() is not None,
            timeout=180,
            what="two checkpoints",
        )
        assert agent.poll() is None, log.read_text()
        workers = {
            pid: command
            for pid, command in child_processes(agent.pid).items()
            if "sdnet_trainer" in command
        }
        assert len(workers) == 2, workers
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=30)
        at_kill = checkpoint_names(checkpoints)
        wait_until(
            lambda: all(process_command(pid) != command for pid, command in workers.items()),
            timeout=10,
            what="the workers to die with their agent",
        )
        time.sleep(2)  # orphans would commit a checkpoint every step, several a second
        assert checkpoint_names(checkpoints) <= at_kill
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        kill_processes(workers)


def test_nccl_without_gpus_is_a_config_error_on_every_rank(tmp_path):
    # The CPU lane hides any GPU from this test (tests/conftest.py): a machine without GPUs.
    run = run_cli(
        TINY
        + [
            "dist.device=auto",
            "dist.backend=nccl",
            "loop.max_steps=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        nproc=2,
    )
    assert run.returncode == 2, run.output
    message = (
        "config error: dist.backend=nccl needs CUDA devices, but dist.device=auto resolved to "
        "cpu: torch.cuda.is_available() is False on this machine"
    )
    assert message in run.output, run.output
    assert "ProcessGroupNCCL" not in run.output and "sdnet_trainer/" not in run.output


@pytest.mark.parametrize("nproc", [None, 2])
def test_checkpoint_error_ends_every_rank_with_one_line(tmp_path, nproc):
    run = run_cli(
        SIGNALS
        + ["loop.max_steps=6", "checkpoint.every_n_steps=2", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        nproc=nproc,
        env={"SDNET_TEST_CHECKPOINT_ERROR": "4"},
    )
    lines = [line for line in run.output.splitlines() if "checkpoint error: " in line]
    assert all(
        line.endswith("OSError: [Errno 28] No space left on device")
        and "cannot save step 4 to " in line
        for line in lines
    ), lines
    assert "sdnet_trainer/" not in run.output  # no traceback through our code
    assert run.returncode == EXIT_CHECKPOINT == 5, run.output
    assert "Traceback" not in run.output
    if nproc is None:
        assert len(lines) == 1
    else:
        assert len(lines) == 2 and sum(line.startswith("[rank1]") for line in lines) == 1
