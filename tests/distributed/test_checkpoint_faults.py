"""Checkpoint folder faults: two runs on one checkpoint folder (the lock) and a full disk.

Single-process tests use CheckpointManager / Checkpointer directly; one test launches two real
torchrun runs into the same checkpoint.dir at once.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from sdnet_trainer import Trainer
from sdnet_trainer.checkpoint import (
    LOCK,
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    read_checkpoint,
)
from sdnet_trainer.checkpoint.disk import StagingWriter
from sdnet_trainer.config import CheckpointConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.training.checkpointer import Checkpointer
from tests.support import TINY, run_cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def manager(
    directory: Path, run_id: str | None, *, async_save: bool = False, keep_last: int = 3
) -> CheckpointManager:
    return CheckpointManager(
        directory,
        keep_last=keep_last,
        async_save=async_save,
        rank=0,
        world_size=1,
        run_id=run_id,
    )


def lock_of(directory: Path) -> dict:
    return json.loads((directory / LOCK).read_text())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------------- the lock


def test_a_second_run_is_refused_naming_the_first(tmp_path):
    first = manager(tmp_path, "run-a")
    first.save(1, {"w": torch.ones(3)})
    assert lock_of(tmp_path)["run_id"] == "run-a"
    with pytest.raises(ConfigError) as refused:
        manager(tmp_path, "run-b")
    message = str(refused.value)
    for part in (
        f"checkpoint.dir={tmp_path} is in use by run 'run-a'",
        f"host {socket.gethostname()}",
        f"pid {os.getpid()}",
        f"lock file {tmp_path / LOCK}",
        "wait for that run to finish",
        f"delete {tmp_path / LOCK}",
    ):
        assert part in message, message
    # The first run keeps its folder and its lock; once it closes, the folder is free.
    first.save(2, {"w": torch.full((3,), 2.0)})
    assert [c.step for c in first.checkpoints()] == [1, 2]
    first.close()
    assert not (tmp_path / LOCK).exists()
    second = manager(tmp_path, "run-b")
    assert lock_of(tmp_path)["run_id"] == "run-b"
    second.close()


def test_a_second_checkpointer_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")  # one torchrun launch

    def checkpointer(run_id: str) -> Checkpointer:
        return Checkpointer(
            CheckpointConfig(),
            directory=tmp_path,
            parts={},
            rank=0,
            world_size=1,
            meta={},
            run_id=run_id,
        )

    first = checkpointer("run-a")
    with pytest.raises(ConfigError, match="in use by run 'run-a'"):
        checkpointer("run-b")
    restarted = checkpointer("run-a")  # torchrun restarted the same run's workers
    restarted.close()
    first.close()
    assert not (tmp_path / LOCK).exists()


def test_the_same_run_takes_the_lock_over(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")  # torchrun restarts keep its run id
    before = manager(tmp_path, "run-a")
    token = lock_of(tmp_path)["token"]
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.checkpoint"):
        after = manager(tmp_path, "run-a")
    assert "held by the same run 'run-a'" in caplog.text
    assert lock_of(tmp_path)["token"] != token
    before.close()  # the earlier holder no longer owns the file: it stays
    assert lock_of(tmp_path)["run_id"] == "run-a"
    after.close()
    assert not (tmp_path / LOCK).exists()


def test_the_same_run_id_from_another_launch_is_refused(tmp_path, monkeypatch):
    """Two launches started in the same second get the same default (time-based) run id; only
    the same torchrun launch (its rendezvous id) may take the lock over."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")
    first = manager(tmp_path, "2026-11-22_10-00-00")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-2")
    with pytest.raises(ConfigError, match="in use by run '2026-11-22_10-00-00'"):
        manager(tmp_path, "2026-11-22_10-00-00")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # a plain process: no launch to be the same as
    with pytest.raises(ConfigError, match="in use by run '2026-11-22_10-00-00'"):
        manager(tmp_path, "2026-11-22_10-00-00")
    first.close()


def write_lock(directory: Path, *, run_id: str, host: str, pid: int) -> None:
    holder = {"run_id": run_id, "host": host, "pid": pid, "created": time.time(), "token": "x"}
    (directory / LOCK).write_text(json.dumps(holder))


def test_a_stale_lock_on_this_host_is_replaced(tmp_path, caplog):
    pid = dead_pid()
    write_lock(tmp_path, run_id="crashed", host=socket.gethostname(), pid=pid)
    with caplog.at_level(logging.WARNING, logger="sdnet_trainer.checkpoint"):
        ckpts = manager(tmp_path, "run-b")
    assert f"run 'crashed' (pid {pid} on this host), no longer exists" in caplog.text
    assert lock_of(tmp_path)["run_id"] == "run-b" and lock_of(tmp_path)["pid"] == os.getpid()
    ckpts.close()


def test_another_hosts_lock_is_refused_even_with_a_dead_pid(tmp_path):
    write_lock(tmp_path, run_id="elsewhere", host="other-host.invalid", pid=dead_pid())
    with pytest.raises(ConfigError, match=r"run 'elsewhere' \(host other-host\.invalid, pid \d+"):
        manager(tmp_path, "run-b")
    assert lock_of(tmp_path)["run_id"] == "elsewhere"


def test_an_unreadable_lock_is_refused(tmp_path):
    (tmp_path / LOCK).write_text("not json")
    with pytest.raises(ConfigError, match="unreadable lock file"):
        manager(tmp_path, "run-b")


def test_a_lock_dropped_in_this_process_is_replaced(tmp_path, caplog):
    # A notebook's earlier Trainer, set up and dropped without close(): its lock names this very
    # process, which is alive, yet nothing holds the folder any more.
    kept = manager(tmp_path, "run-a")
    with pytest.raises(ConfigError, match="this process: close"):
        manager(tmp_path, "run-b")
    cycle = [kept]
    cycle.append(cycle)  # only the garbage collector frees it
    del kept, cycle
    ckpts = manager(tmp_path, "run-b")
    assert lock_of(tmp_path)["run_id"] == "run-b"
    ckpts.close()


def test_a_lock_left_open_is_released_at_exit(tmp_path):
    script = (
        "import sys; from sdnet_trainer.checkpoint import CheckpointManager\n"
        "m = CheckpointManager(sys.argv[1], keep_last=1, async_save=False, rank=0, world_size=1,"
        " run_id='no-close')\n"
        "assert (m.directory / 'checkpoint.lock').exists()\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=120)
    assert not (tmp_path / LOCK).exists()


def test_no_run_id_takes_no_lock(tmp_path):
    holder = manager(tmp_path, "run-a")
    reader = manager(tmp_path, None)  # loading only (export): no lock, no refusal
    reader.close()
    assert lock_of(tmp_path)["run_id"] == "run-a"
    holder.close()


class GatedTrainer(Trainer):
    """Before step 3, waits for the file $SDNET_TEST_GATE (at most 300 s): the run is live and
    holds its checkpoint folder while the test launches a second run into it."""

    def train_step(self):
        gate = os.environ.get("SDNET_TEST_GATE")
        if gate and self.state.step == 2:
            deadline = time.monotonic() + 300
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.1)
        return super().train_step()


def test_two_launches_into_one_checkpoint_dir(tmp_path):
    shared = tmp_path / "shared"
    gate = tmp_path / "gate"
    args = TINY + [
        f"trainer._target_={__name__}.GatedTrainer",
        "loop.max_steps=4",
        "loop.eval_at_end=false",
        "checkpoint.every_n_steps=1",
        f"checkpoint.dir={shared}",
    ]
    results = {}

    def first_run() -> None:
        results["first"] = run_cli(
            args + ["run.id=first", f"hydra.run.dir={tmp_path / 'first'}"],
            cwd=tmp_path,
            nproc=1,
            env={"SDNET_TEST_GATE": str(gate)},
            timeout=400,
        )

    thread = threading.Thread(target=first_run)
    thread.start()
    try:
        deadline = time.monotonic() + 300
        while not (shared / "step_00000002").exists():
            assert thread.is_alive() and time.monotonic() < deadline, results
            time.sleep(0.2)
        second = run_cli(
            args + ["run.id=second", f"hydra.run.dir={tmp_path / 'second'}"],
            cwd=tmp_path,
            nproc=2,
            timeout=300,
        )
    finally:
        gate.touch()
        thread.join()
    first = results["first"]
    # Refused on every rank with the same one-line config error (exit code 2).
    assert second.returncode == 2, second.output
    refusal = f"config error: checkpoint.dir={shared} is in use by run 'first'"
    refused = [line for line in second.output.splitlines() if refusal in line]
    assert len(refused) == 2 and refused[0].startswith("[rank1]") != refused[1].startswith(
        "[rank1]"
    ), second.output
    assert all(f"lock file {shared / LOCK}" in line for line in refused)
    # The first run went on undisturbed and finished; its checkpoints are intact.
    assert first.returncode == 0, first.output
    assert sorted(p.name for p in shared.iterdir()) == [f"step_{s:08d}" for s in (2, 3, 4)]
    for step in (2, 3, 4):
        checkpoint = read_checkpoint(shared / f"step_{step:08d}", verify=True)
        assert checkpoint.meta["config"]["run"]["id"] == "first"
    assert not (tmp_path / "second" / "checkpoints").exists()


# ---------------------------------------------------------------------- a full disk

FREE = 12_345  # what shutil.disk_usage reports in these tests


class NearlyFullFile(io.RawIOBase):
    """A file on a filesystem with ``room`` bytes left: as write(2) does, a write that does not
    fit writes what fits, and the next one fails with ENOSPC."""

    def __init__(self, path: Path, room: int) -> None:
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close()
        self._room = room

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def fileno(self) -> int:
        return self._file.fileno()

    def write(self, data) -> int:
        if self._room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = self._file.write(memoryview(data)[: self._room])
        self._room -= written
        return written

    def close(self) -> None:
        self._file.close()
        super().close()


@contextmanager
def disk_full(monkeypatch, *, room: int) -> Iterator[None]:
    """Shards written from now on find ``room`` bytes left on the disk."""
    real = FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and str(path).endswith(".distcp"):
            with io.BufferedWriter(NearlyFullFile(Path(path), room)) as stream:
                yield stream
        else:
            with real(self, path, mode) as stream:
                yield stream

    with monkeypatch.context() as patch:
        patch.setattr(FileSystem, "create_stream", create_stream)
        yield


@pytest.fixture
def little_free(monkeypatch):
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: type(usage)(usage.total, usage.total - FREE, FREE)
    )


def assert_disk_full(error: BaseException, staging: Path, needed: int) -> None:
    message = str(error)
    assert isinstance(error, CheckpointError), repr(error)
    assert message.startswith("no space left on device"), message
    assert str(staging) in message, message
    assert f"needs about {needed} bytes" in message or f"({needed} bytes)," in message, message
    assert f"({FREE} bytes) are free" in message, message
    assert not staging.exists()


# 1000 floats fit the writer's buffer: the error comes from its flush. 100_000 floats go through
# torch's zip writer, which reports a lost write as "unexpected pos".
@pytest.mark.parametrize("numel", [1000, 100_000])
@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, little_free, numel, async_save
):
    ckpts = manager(tmp_path, "run-a", async_save=async_save)
    ckpts.save(1, {"w": torch.ones(numel)})
    ckpts.wait()
    state = {"w": torch.full((numel,), 2.0), "step": 2}
    with disk_full(monkeypatch, room=1000):
        if async_save:
            ckpts.save(2, state)  # returns once staged: the error comes with the next wait()
            with pytest.raises(CheckpointError) as failed:
                ckpts.wait()
        else:
            with pytest.raises(CheckpointError) as failed:
                ckpts.save(2, state)
    assert_disk_full(failed.value, ckpts.staging_dir(2), needed=numel * 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK, "step_00000001"]
    checkpoint = ckpts.resolve_resume("auto")
    assert checkpoint.step == 1
    target = {"w": torch.zeros(numel)}
    ckpts.load(checkpoint, target)
    assert torch.equal(target["w"], torch.ones(numel))
    # Space again: saving goes on.
    ckpts.save(2, state)
    ckpts.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


def test_async_disk_full_surfaces_at_close(tmp_path, monkeypatch, little_free):
    ckpts = manager(tmp_path, "run-a", async_save=True)
    with disk_full(monkeypatch, room=0):
        ckpts.save(1, {"w": torch.ones(1000)})
        with pytest.raises(CheckpointError, match="^no space left on device") as failed:
            ckpts.close()
    assert_disk_full(failed.value, ckpts.staging_dir(1), needed=4000)
    assert list(tmp_path.iterdir()) == []  # the lock is released too


def test_disk_full_writing_the_manifest(tmp_path, monkeypatch, little_free):
    ckpts = manager(tmp_path, "run-a")
    ckpts.save(1, {"w": torch.ones(10)})
    real_open = open

    def full_open(path, mode="r", *args, **kwargs):
        if str(path).endswith(f"{MANIFEST}.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_open)
    with pytest.raises(CheckpointError) as failed:
        ckpts.save(2, {"w": torch.ones(10)})
    monkeypatch.undo()
    assert_disk_full(failed.value, ckpts.staging_dir(2), needed=40)
    assert [c.step for c in ckpts.checkpoints()] == [1]
    ckpts.close()


def pickled_failures(monkeypatch, writer: type) -> None:
    """``writer.write_data`` raises its failure as another rank's reaches rank 0: pickled, which
    drops the exception's chain."""
    real = writer.write_data

    def write_data(self, plan, planner):
        try:
            return real(self, plan, planner)
        except Exception as exc:
            failure = exc
        raise pickle.loads(pickle.dumps(failure))  # outside the except: no __context__

    monkeypatch.setattr(writer, "write_data", write_data)


def test_disk_full_on_another_rank_keeps_its_errno(tmp_path, monkeypatch, little_free):
    # The writer re-raises the full disk hidden in torch's zip-writer error as the OSError, which
    # pickles with its errno.
    pickled_failures(monkeypatch, StagingWriter)
    ckpts = manager(tmp_path, "run-a")
    with disk_full(monkeypatch, room=1000), pytest.raises(CheckpointError) as failed:
        ckpts.save(1, {"w": torch.ones(100_000)})
    assert_disk_full(failed.value, ckpts.staging_dir(1), needed=400_000)
    assert "[Errno 28]" in str(failed.value.__cause__)
    ckpts.close()


@pytest.mark.parametrize("free", [FREE, 10**12])
def test_a_bare_lost_write_is_a_full_disk_only_without_room(tmp_path, monkeypatch, free):
    # torch's "unexpected pos" without its chain: a full disk only when the filesystem has less
    # room than the save needs.
    pickled_failures(monkeypatch, FileSystemWriter)
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: type(usage)(free, 0, free))
    ckpts = manager(tmp_path, "run-a")
    with disk_full(monkeypatch, room=1000), pytest.raises(CheckpointError) as failed:
        ckpts.save(1, {"w": torch.ones(100_000)})
    if free == FREE:
        assert_disk_full(failed.value, ckpts.staging_dir(1), needed=400_000)
    else:
        assert str(failed.value).startswith(f"cannot save step 1 to {ckpts.staging_dir(1)}")
        assert "unexpected pos" in str(failed.value)
    ckpts.close()
