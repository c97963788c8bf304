"""Worker for tests/distributed/test_checkpoint.py, on 2 ranks (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node=2 _checkpoint_worker.py DIR

1. DIR/roundtrip: every rank saves a replicated model + optimizer state and its own rng/rank{r},
   sync to sync/ (step 1) and async to async/ (step 2); then every rank loads both back and
   compares. Each rank also writes expected_rank{r}.pt for the test's single-process checks.
   The sync manager belongs to run ``roundtrip`` (it holds the folder's lock): a manager of another
   run on the same folder must be refused on every rank.
   Each rank records in io_rank{r}.json the checkpoint shards it opened for reading while saving
   and while verifying a resume (of a copy of the sync checkpoint in verify/), and the bytes it
   staged for the async save; then one shard of the copy is corrupted (same size) and resuming it
   must fail on every rank naming that file.
2. DIR/kill: step 1 is committed; during the save of step 2 rank 1 SIGKILLs itself once rank 0
   has started writing its shard. The launch therefore fails: the test reads what is on disk.

One launch for both, as starting processes is the slow part.

The state builders are imported by the test for its single-process checks.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict import get_state_dict

from sdnet_trainer.checkpoint import LOCK, CheckpointManager
from sdnet_trainer.checkpoint.disk import state_nbytes
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.lazy import freeze_imports

# Big enough that saving the replicated tensors twice would show in the checkpoint's size.
WIDTH = 256
KILL_RUN = "kill-run"  # the run id of the killed save, which the test then plays again


def model_and_optimizer(*, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(WIDTH, WIDTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def trained_state(rank: int) -> dict[str, Any]:
    """The state a DDP Trainer would save on ``rank``: model and optimizer (identical on every
    rank), this rank's RNG state, counters."""
    model, optimizer = model_and_optimizer()
    model(torch.ones(4, WIDTH)).square().mean().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        f"rng/rank{rank}": torch.Generator().manual_seed(100 + rank).get_state(),
        "counters": {"step": 7, "epoch": 1, "samples": 7 * 64},
    }


def empty_state(rank: int) -> dict[str, Any]:
    """Same structure as ``trained_state``, other values: what a fresh process loads into."""
    model, optimizer = model_and_optimizer(seed=1)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        f"rng/rank{rank}": torch.zeros(5056, dtype=torch.uint8),
        "counters": {"step": 0, "epoch": 0, "samples": 0},
    }


def tensors(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Flat {dotted key: tensor clone} of the tensors in a nested state dict."""
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            flat[f"{prefix}{key}"] = value.detach().clone()
    return flat


def tensors_in_place(state: dict[str, Any]) -> list[torch.Tensor]:
    found = []
    for value in state.values():
        if isinstance(value, dict):
            found += tensors_in_place(value)
        elif isinstance(value, torch.Tensor):
            found.append(value)
    return found


def assert_same(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    got, want = tensors(loaded), tensors(expected)
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert loaded["counters"] == expected["counters"]
    assert loaded["optim"]["param_groups"] == expected["optim"]["param_groups"]


# ---------------------------------------------------------------------- test-only hooks

_writes_may_start = threading.Event()
_writes_may_start.set()
_original_write_data = FileSystemWriter.write_data


def _gated_write_data(self, plan, planner):
    # Holds DCP's writer until the main thread says so: an async save then cannot finish before
    # the test mutates the live tensors, so only staging can explain an unchanged checkpoint.
    assert _writes_may_start.wait(timeout=60)
    return _original_write_data(self, plan, planner)


def _dying_write_data(self, plan, planner):
    # Rank 1 dies mid-save: once rank 0 has started writing its shard into the staging folder.
    deadline = time.monotonic() + 30
    while not (Path(self.path) / "__0_0.distcp").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


class ShardReads:
    """Records the shard files (``*.distcp``) this process opens for reading, by any of Python's
    ways to open a file, while ``phase`` is set: who reads which shard, for the commit and the
    resume's verification."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.reads: dict[str, list[str]] = {}
        self._os_open, self._io_open = os.open, io.open

    def install(self) -> None:
        def os_open(path, flags, *args, **kwargs):
            if flags & os.O_ACCMODE == os.O_RDONLY:
                self._record(path)
            return self._os_open(path, flags, *args, **kwargs)

        def io_open(file, mode="r", *args, **kwargs):
            if "r" in mode and "+" not in mode:
                self._record(file)
            return self._io_open(file, mode, *args, **kwargs)

        os.open, io.open, builtins.open = os_open, io_open, io_open

    def _record(self, path: object) -> None:
        name = os.path.basename(os.fsdecode(path)) if isinstance(path, (str, os.PathLike)) else ""
        if self.phase is not None and name.endswith(".distcp"):
            self.reads.setdefault(self.phase, []).append(name)


_reads = ShardReads()
_staged_bytes: list[int] = []
_original_stage = DefaultStager.stage


def _measured_stage(self, state_dict, **kwargs):
    # The bytes this rank's stager copies into host memory (kept for the run).
    staged = _original_stage(self, state_dict, **kwargs)
    _staged_bytes.append(state_nbytes(staged))
    return staged


# ---------------------------------------------------------------------- modes


def roundtrip(directory: Path, rank: int, world_size: int) -> None:
    directory.mkdir(exist_ok=True)
    sync = CheckpointManager(
        directory / "sync",
        keep_last=3,
        async_save=False,
        rank=rank,
        world_size=world_size,
        run_id="roundtrip",
    )
    try:
        CheckpointManager(
            directory / "sync",
            keep_last=3,
            async_save=False,
            rank=rank,
            world_size=world_size,
            run_id="second",
        )
    except ConfigError as exc:
        assert "run 'roundtrip'" in str(exc) and LOCK in str(exc), exc
        print(f"rank {rank}: second run refused", flush=True)
    else:
        raise AssertionError("a second run was given a folder that another run holds")
    asyn = CheckpointManager(
        directory / "async", keep_last=3, async_save=True, rank=rank, world_size=world_size
    )
    state = trained_state(rank)
    torch.save(tensors(state), directory / f"expected_rank{rank}.pt")
    full_bytes = state_nbytes(state)
    _reads.install()
    _reads.phase = "save"
    sync.save(1, state, meta={"kind": "sync"})

    FileSystemWriter.write_data = _gated_write_data
    DefaultStager.stage = _measured_stage
    _writes_may_start.clear()
    asyn.save(2, state, meta={"kind": "async"})
    DefaultStager.stage = _original_stage
    assert not (directory / "async" / "step_00000002").exists(), "async save blocked until written"
    for value in tensors_in_place(state):
        value.add_(1000)  # the training loop keeps going while the save is written
    _writes_may_start.set()
    asyn.wait()
    _reads.phase = None
    FileSystemWriter.write_data = _original_write_data

    reference = trained_state(rank)
    for manager in (sync, asyn):
        checkpoint = manager.latest()
        assert checkpoint is not None and checkpoint.world_size == world_size, checkpoint
        assert all(checkpoint.has_key(f"rng/rank{r}") for r in range(world_size))
        loaded = empty_state(rank)
        manager.load(checkpoint, loaded)
        assert_same(loaded, reference)
        print(
            f"rank {rank}: {checkpoint.meta['kind']} checkpoint step {checkpoint.step} loaded",
            flush=True,
        )
    # Rank 0 resolves checkpoint.resume and every rank follows, errors included.
    assert sync.resolve_resume("auto").path == directory / "sync" / "step_00000001"
    try:
        sync.resolve_resume(str(directory / "sync" / "step_00000009"))
    except ConfigError as exc:
        assert "checkpoint.resume" in str(exc) and "does not exist" in str(exc), exc
    else:
        raise AssertionError("a missing resume path was accepted")
    verify_shared(directory, rank, world_size)
    (directory / f"io_rank{rank}.json").write_text(
        json.dumps(
            {
                "reads": _reads.reads,
                "staged_bytes": _staged_bytes,
                "full_bytes": full_bytes,
            }
        )
    )
    sync.close()
    asyn.close()


def verify_shared(directory: Path, rank: int, world_size: int) -> None:
    """Resume with verification from a copy of the sync checkpoint: the shards' reads are recorded;
    then a shard of the copy is damaged (same size, so only its checksum can tell) and resuming it
    must fail on every rank, naming the file."""
    copy = directory / "verify" / "step_00000001"
    if rank == 0:
        shutil.copytree(directory / "sync" / "step_00000001", copy)
    dist.barrier()
    manager = CheckpointManager(
        directory / "verify", keep_last=3, async_save=False, rank=rank, world_size=world_size
    )
    _reads.phase = "verify"
    assert manager.resolve_resume("auto").path == copy
    _reads.phase = None
    dist.barrier()
    damaged = copy / f"__{world_size - 1}_0.distcp"
    if rank == 0:
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
    dist.barrier()
    try:
        manager.resolve_resume(str(copy))
    except ConfigError as exc:
        assert f"{damaged.name} does not match its checksum" in str(exc), exc
        print(f"rank {rank}: corrupt shard {damaged.name} named", flush=True)
    else:
        raise AssertionError("a corrupted shard passed verification")
    assert manager.resolve_resume("auto") is None  # the only checkpoint there is damaged
    manager.close()


def kill(directory: Path, rank: int, world_size: int) -> None:
    manager = CheckpointManager(
        directory, keep_last=3, async_save=False, rank=rank, world_size=world_size, run_id=KILL_RUN
    )
    state = {
        "weight": torch.full((WIDTH, WIDTH), 1.0),
        f"rng/rank{rank}": torch.full((8,), float(rank)),
    }
    manager.save(1, state, meta={"value": 1})
    if rank == 1:
        FileSystemWriter.write_data = _dying_write_data
    state["weight"].fill_(2.0)
    manager.save(2, state, meta={"value": 2})
    raise AssertionError("the save of step 2 should not have finished")


def main() -> None:
    directory = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        roundtrip(directory / "roundtrip", rank, world_size)
        print(f"rank {rank}: roundtrip passed", flush=True)
        kill(directory / "kill", rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main()
