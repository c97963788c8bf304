"""CheckpointManager: DCP save/load, atomic commit, validation, pruning, resume, load safety.

Single-process tests run here without a process group (DCP's no_dist path). The two-rank tests
share one 2-process launch of tests/distributed/_checkpoint_worker.py (gloo): it saves sync and
async, loads back on both ranks, then has rank 1 SIGKILLed in the middle of a save.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import shutil
import threading
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from sdnet_trainer.checkpoint import LOCK, MANIFEST, CheckpointError, CheckpointManager, disk, files
from sdnet_trainer.errors import ConfigError
from tests.distributed import _checkpoint_worker as worker
from tests.support import run_cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

WORKER = Path(worker.__file__)


def manager(
    directory: Path, *, keep_last: int = 3, async_save: bool = False, run_id: str | None = None
) -> CheckpointManager:
    return CheckpointManager(
        directory, keep_last=keep_last, async_save=async_save, rank=0, world_size=1, run_id=run_id
    )


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def checkpoint_bytes(path: Path) -> int:
    return sum(f["bytes"] for f in json.loads((path / MANIFEST).read_text())["files"])


# ---------------------------------------------------------------------- round trip


def _training_state(
    seed: int, *, lr: float
) -> tuple[nn.Module, torch.optim.Optimizer, object, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (10 + seed), growth_interval=7 + seed)
    return model, optimizer, scheduler, scaler


def _full_state(model, optimizer, scheduler, scaler, *, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "sched": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "step": step,
        # Per-rank generator states, nested as the Trainer stores them (a 0-dim tensor too).
        "rng/rank0": {
            "torch": torch.get_rng_state(),
            "gauss": torch.tensor(0.25 + step, dtype=torch.float64),
        },
    }


@pytest.mark.parametrize("async_save", [False, True])
def test_single_process_round_trip_is_exact(tmp_path, async_save):
    model, optimizer, scheduler, scaler = _training_state(0, lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    saved = _full_state(model, optimizer, scheduler, scaler, step=3)
    ckpts = manager(tmp_path, async_save=async_save)
    ckpts.save(3, saved, meta={"step": 3, "batch": {"global": 64, "world_size": 1}})
    ckpts.close()

    latest = manager(tmp_path).latest()
    assert latest is not None and (latest.step, latest.world_size) == (3, 1)
    assert latest.meta == {"step": 3, "batch": {"global": 64, "world_size": 1}}
    fresh = _training_state(1, lr=0.7)
    target = _full_state(*fresh, step=0)
    manager(tmp_path).load(latest, target)

    # Primitive leaves come back with their values and types (int stays int, None stays None).
    for key in ("sched", "scaler", "step"):
        assert target[key] == saved[key] and repr(target[key]) == repr(saved[key]), key
    assert target["optim"]["param_groups"] == saved["optim"]["param_groups"]
    assert (
        latest.has_key("rng/rank0")
        and latest.has_key("rng/rank0.gauss")
        and not latest.has_key("rng")
    )
    for key in ("torch", "gauss"):
        assert torch.equal(target["rng/rank0"][key], saved["rng/rank0"][key])
    # ...and into live objects: parameters, momentum buffers, schedule, scaler.
    model2, optimizer2, scheduler2, scaler2 = fresh
    set_state_dict(
        model2, optimizer2, model_state_dict=target["model"], optim_state_dict=target["optim"]
    )
    scheduler2.load_state_dict(target["sched"])
    scaler2.load_state_dict(target["scaler"])
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(
            optimizer.state[p]["momentum_buffer"], optimizer2.state[q]["momentum_buffer"]
        )
    assert scheduler2.get_last_lr() == scheduler.get_last_lr() and scheduler2.last_epoch == 3
    assert scaler2.get_scale() == scaler.get_scale() and scaler2.get_growth_interval() == 7


def test_async_save_returns_once_staged(tmp_path, monkeypatch):
    # DCP's writer is held until the live tensor has changed; what it writes must be the old value.
    release = threading.Event()
    write_data = FileSystemWriter.write_data

    def held_write_data(self, plan, planner):
        assert release.wait(timeout=30)
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held_write_data)
    live = {"w": torch.arange(6.0), "counters": {"step": 1}}
    ckpts = manager(tmp_path, async_save=True)
    ckpts.save(1, live)
    assert not (tmp_path / "step_00000001").exists()  # returned before the write
    live["w"].add_(100)
    live["counters"]["step"] = 2
    release.set()
    ckpts.wait()
    target = {"w": torch.zeros(6), "counters": {"step": 0}}
    ckpts.load(ckpts.latest(), target)
    assert torch.equal(target["w"], torch.arange(6.0)) and target["counters"] == {"step": 1}


def test_manifest_lists_every_file_with_its_size(tmp_path):
    ckpts = manager(tmp_path)
    ckpts.save(42, {"w": torch.ones(10)}, meta={"note": "x"})
    folder = tmp_path / "step_00000042"
    manifest = json.loads((folder / MANIFEST).read_text())
    on_disk = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != MANIFEST}
    assert {f["name"]: f["bytes"] for f in manifest["files"]} == on_disk
    assert ".metadata" in on_disk and "__0_0.distcp" in on_disk
    assert (manifest["format_version"], manifest["step"], manifest["world_size"]) == (2, 42, 1)
    for entry in manifest["files"]:
        assert entry["crc32"] == zlib.crc32((folder / entry["name"]).read_bytes()), entry
    assert manifest["meta"] == {"note": "x"} and manifest["created"] > 0
    with pytest.raises(ValueError, match="JSON"):
        ckpts.save(43, {"w": torch.ones(1)}, meta={"bad": object()})


# ---------------------------------------------------------------------- pruning and replacing


@pytest.mark.parametrize("async_save", [False, True])
def test_keep_last_keeps_the_newest(tmp_path, async_save):
    ckpts = manager(tmp_path, keep_last=2, async_save=async_save)
    for step in (10, 20, 30, 40):
        ckpts.save(step, {"w": torch.full((3,), float(step))})
    ckpts.close()
    assert listing(tmp_path) == ["step_00000030", "step_00000040"]
    assert [c.step for c in manager(tmp_path).checkpoints()] == [30, 40]


def test_only_this_runs_stale_staging_is_removed_after_a_commit(tmp_path):
    ckpts = manager(tmp_path, run_id="run-a")
    own = [ckpts.staging_dir(5), ckpts.staging_dir(99)]  # crashed saves of this run
    others = [
        ".staging_step_00000005.run-b-0123abcd",  # another run's: perhaps a save in progress
        ".staging_step_00000003",  # unnamed: not known to be this run's
    ]
    for path in own + [tmp_path / name for name in others]:
        path.mkdir()
    (tmp_path / ".trash_step_00000001.0123abcd").mkdir()  # an interrupted deletion
    ckpts.save(7, {"w": torch.ones(2)})
    ckpts.close()
    assert listing(tmp_path) == sorted(others + ["step_00000007"])


def test_saving_a_step_again_replaces_it(tmp_path):
    ckpts = manager(tmp_path)
    ckpts.save(5, {"w": torch.full((3,), 1.0)})
    ckpts.save(5, {"w": torch.full((3,), 2.0)})
    assert listing(tmp_path) == ["step_00000005"]
    target = {"w": torch.zeros(3)}
    ckpts.load(ckpts.latest(), target)
    assert torch.equal(target["w"], torch.full((3,), 2.0))


def test_pruning_deletes_in_the_background(tmp_path, monkeypatch):
    # Deleting a large checkpoint takes minutes on a network filesystem: the save that prunes it
    # returns at once, the folder already out of sight; close() waits for the deletion.
    release = threading.Event()
    deleting: list[Path] = []
    remove_tree = files.remove_tree

    def held_remove_tree(path: Path) -> None:
        if path.name.startswith(".trash_"):
            deleting.append(path)
            assert release.wait(timeout=10), "the save waited for the deletion"
        remove_tree(path)

    monkeypatch.setattr(files, "remove_tree", held_remove_tree)
    ckpts = manager(tmp_path, keep_last=1)
    ckpts.save(1, {"w": torch.ones(3)})
    ckpts.save(2, {"w": torch.full((3,), 2.0)})  # prunes step 1
    assert [p.name.split(".")[1] for p in deleting] == ["trash_step_00000001"]
    assert [c.step for c in ckpts.checkpoints()] == [2]
    assert not (tmp_path / "step_00000001").exists()
    release.set()
    ckpts.close()
    assert listing(tmp_path) == ["step_00000002"]


def test_checksum_of_a_file_not_written_front_to_back_is_read_back(tmp_path):
    # The writer checksums the bytes on their way to the file; a seek voids that sum, and the
    # file is then read back by the rank that wrote it.
    written = disk._ChecksummingFileSystem()
    with written.create_stream(tmp_path / "appended", "wb") as stream:
        stream.write(b"abc")
        stream.write(memoryview(b"def"))
    with written.create_stream(tmp_path / "patched", "wb") as stream:
        stream.write(b"abcdef")
        stream.seek(0)
        stream.write(b"X")
    assert written.written == {"appended": (6, zlib.crc32(b"abcdef")), "patched": None}
    assert disk.read_checksum(tmp_path, "patched") == (6, zlib.crc32(b"Xbcdef"))
    written.rename(tmp_path / "appended", tmp_path / "renamed")
    assert written.written["renamed"] == (6, zlib.crc32(b"abcdef"))


# ---------------------------------------------------------------------- validation and resume


@pytest.fixture
def damaged(tmp_path) -> dict[str, Path]:
    """step 1 valid; step 2 without manifest; step 3 with a truncated shard; a crashed staging."""
    ckpts = manager(tmp_path)
    for step in (1, 2, 3):
        ckpts.save(step, {"w": torch.arange(1000.0)})
    shutil.copytree(tmp_path / "step_00000003", tmp_path / ".staging_step_00000004")
    (tmp_path / "step_00000002" / MANIFEST).unlink()
    shard = tmp_path / "step_00000003" / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    return {
        "dir": tmp_path,
        "no_manifest": tmp_path / "step_00000002",
        "truncated": tmp_path / "step_00000003",
        "size": size,
    }


def test_incomplete_checkpoints_are_skipped_with_the_reason(damaged, caplog):
    with caplog.at_level(logging.WARNING, logger="sdnet_trainer.checkpoint"):
        found = manager(damaged["dir"]).checkpoints()
    assert [c.step for c in found] == [1]
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    assert f"{damaged['no_manifest']}: no manifest.json" in warnings
    assert (
        f"{damaged['truncated']}: __0_0.distcp is {damaged['size'] // 2} bytes, manifest.json "
        f"says {damaged['size']}" in warnings
    )
    assert "staging" not in warnings  # staging folders are not checkpoints: ignored silently
    assert manager(damaged["dir"]).resolve_resume("auto").step == 1


def test_resume_path_must_be_a_complete_checkpoint(damaged):
    ckpts = manager(damaged["dir"])
    with pytest.raises(ConfigError) as missing:
        ckpts.resolve_resume(str(damaged["no_manifest"]))
    assert re.search(
        rf"checkpoint\.resume=.*{damaged['no_manifest']}.*no manifest\.json", str(missing.value)
    )
    with pytest.raises(ConfigError) as truncated:
        ckpts.resolve_resume(str(damaged["truncated"]))
    message = str(truncated.value)
    assert "checkpoint.resume" in message and str(damaged["truncated"]) in message
    assert (
        f"__0_0.distcp is {damaged['size'] // 2} bytes, manifest.json says {damaged['size']}"
        in message
    )
    with pytest.raises(ConfigError, match=r"checkpoint\.resume=.*does not exist"):
        ckpts.resolve_resume(str(damaged["dir"] / "step_00000777"))
    # A checkpoint directory stands for its newest valid checkpoint (the rule export follows too).
    assert ckpts.resolve_resume(str(damaged["dir"])).path == damaged["dir"] / "step_00000001"
    (damaged["dir"] / "step_00000001" / MANIFEST).write_text("{not json")
    with pytest.raises(ConfigError, match=r"checkpoint\.resume=.*unreadable manifest\.json"):
        ckpts.resolve_resume(str(damaged["dir"] / "step_00000001"))
    with pytest.raises(
        ConfigError,
        match=r"checkpoint\.resume=.*holds no usable checkpoint \(step_00000003: .*"
        r"step_00000002: no manifest\.json.*; step_00000001: unreadable",
    ):
        ckpts.resolve_resume(str(damaged["dir"]))
    assert ckpts.resolve_resume("auto") is None  # nothing valid left


def test_resume_none_auto_and_path(tmp_path):
    ckpts = manager(tmp_path / "ckpts")
    assert ckpts.resolve_resume("none") is None
    assert ckpts.resolve_resume("auto") is None  # empty directory
    ckpts.save(3, {"w": torch.ones(1)})
    assert ckpts.resolve_resume("auto").step == 3
    assert ckpts.resolve_resume("none") is None
    by_path = ckpts.resolve_resume(str(tmp_path / "ckpts" / "step_00000003"))
    assert by_path.step == 3 and by_path.path == tmp_path / "ckpts" / "step_00000003"


# ---------------------------------------------------------------------- loading


def test_missing_keys_fail_unless_optional(tmp_path):
    ckpts = manager(tmp_path)
    ckpts.save(1, {"w": torch.ones(3), "rng/rank0": torch.full((2,), 7)})
    checkpoint = ckpts.latest()
    assert checkpoint.has_key("rng/rank0") and not checkpoint.has_key("rng/rank1")
    with pytest.raises(CheckpointError, match=rf"{checkpoint.path}.*rng/rank1"):
        ckpts.load(checkpoint, {"w": torch.zeros(3), "rng/rank1": torch.zeros(2, dtype=torch.long)})
    untouched = torch.full((2,), -1)
    target = {"w": torch.zeros(3), "rng/rank1": untouched}
    ckpts.load(checkpoint, target, optional_keys=["rng/rank1"])
    assert torch.equal(target["w"], torch.ones(3)) and target["rng/rank1"] is untouched
    assert torch.equal(untouched, torch.full((2,), -1))


UNPICKLED: list[str] = []


def _record_unpickling(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class Payload:
    """Stands for a malicious object: unpickling it runs a function."""

    def __reduce__(self):
        return _record_unpickling, ("payload",)


def test_safe_planner_refuses_pickled_objects(tmp_path):
    ckpts = manager(tmp_path)
    ckpts.save(1, {"w": torch.ones(2), "obj": Payload()})
    checkpoint = ckpts.latest()
    UNPICKLED.clear()
    with pytest.raises(CheckpointError, match=rf"{checkpoint.path}.*'obj' is not plain data"):
        ckpts.load(checkpoint, {"w": torch.zeros(2), "obj": None})
    assert UNPICKLED == []
    # DCP's default planner would have run it: the guard is what stops it.
    dcp.load(
        {"obj": None}, checkpoint_id=checkpoint.path, planner=DefaultLoadPlanner(), no_dist=True
    )
    assert UNPICKLED == ["payload"]


def test_dcp_metadata_is_unpickled_with_an_allowlist(tmp_path):
    ckpts = manager(tmp_path)
    ckpts.save(1, {"w": torch.ones(2)})
    checkpoint = ckpts.latest()
    (checkpoint.path / ".metadata").write_bytes(pickle.dumps(Payload()))
    UNPICKLED.clear()
    with pytest.raises(CheckpointError, match="_record_unpickling is not allowed in DCP metadata"):
        checkpoint.has_key("w")
    with pytest.raises(CheckpointError, match=rf"cannot load checkpoint {checkpoint.path}"):
        ckpts.load(checkpoint, {"w": torch.zeros(2)})
    assert UNPICKLED == []


def test_unreadable_shard_names_the_checkpoint(tmp_path):
    ckpts = manager(tmp_path)
    ckpts.save(1, {"w": torch.ones(100)})
    checkpoint = ckpts.latest()
    shard = checkpoint.path / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))  # same size: the manifest check passes
    assert ckpts.latest() == checkpoint
    with pytest.raises(CheckpointError, match=rf"cannot load checkpoint {checkpoint.path}"):
        ckpts.load(checkpoint, {"w": torch.zeros(100)})


def test_async_save_error_is_logged_and_raised_by_wait(tmp_path, caplog):
    ckpts = manager(tmp_path, async_save=True)
    with caplog.at_level(logging.ERROR, logger="sdnet_trainer.checkpoint"):
        ckpts.save(
            1, {"w": torch.ones(2), "fn": lambda: None}
        )  # not picklable: fails in the writer
        with pytest.raises(Exception, match="pickle"):
            ckpts.wait()
    assert "async checkpoint of step 1 failed" in caplog.text
    assert ckpts.latest() is None
    ckpts.wait()  # raised once, then cleared
    ckpts.save(2, {"w": torch.ones(2)})
    ckpts.close()
    assert ckpts.latest().step == 2


# ---------------------------------------------------------------------- two ranks (gloo)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("two_ranks")
    launch = run_cli([str(directory)], cwd=directory, nproc=2, script=WORKER, timeout=180)
    return {"dir": directory, "returncode": launch.returncode, "output": launch.output}


def test_two_ranks_save_sync_and_async_and_load_back(two_ranks):
    output = two_ranks["output"]
    for rank in (0, 1):
        # Each rank loaded both checkpoints (its own rng key) and compared them exactly; the async
        # one was written after the live tensors had changed: its content proves staging.
        assert f"rank {rank}: sync checkpoint step 1 loaded" in output, output
        assert f"rank {rank}: async checkpoint step 2 loaded" in output, output
        assert f"rank {rank}: roundtrip passed" in output, output
    for folder in ("sync/step_00000001", "async/step_00000002"):
        path = two_ranks["dir"] / "roundtrip" / folder
        manifest = json.loads((path / MANIFEST).read_text())
        assert manifest["world_size"] == 2
        assert {"__0_0.distcp", "__1_0.distcp"} <= {f["name"] for f in manifest["files"]}
        # Each rank checksummed its own shards; the manifest holds the files' real crc32.
        for entry in manifest["files"]:
            data = (path / entry["name"]).read_bytes()
            assert (entry["bytes"], entry["crc32"]) == (len(data), zlib.crc32(data)), entry


def _io_records(two_ranks) -> list[dict]:
    return [
        json.loads((two_ranks["dir"] / "roundtrip" / f"io_rank{rank}.json").read_text())
        for rank in (0, 1)
    ]


def test_two_ranks_commit_reads_no_shard_and_share_the_verification(two_ranks):
    records = _io_records(two_ranks)
    for rank, record in enumerate(records):
        # Saving (sync and async): every rank checksums what it writes as it writes it; rank 0's
        # commit reads no shard, its own or another rank's.
        assert record["reads"].get("save", []) == [], (rank, record["reads"])
    # Resuming with verification: the checksums are read once, each shard by one rank only, and
    # rank 0 does not read them all.
    verified = [sorted(record["reads"].get("verify", [])) for record in records]
    shards = sorted(
        p.name
        for p in (two_ranks["dir"] / "roundtrip" / "verify" / "step_00000001").iterdir()
        if p.suffix == ".distcp"
    )
    assert sorted(verified[0] + verified[1]) == shards == ["__0_0.distcp", "__1_0.distcp"]
    assert verified[0] and verified[1], verified
    output = two_ranks["output"]
    for rank in (0, 1):
        # A shard damaged after the commit (its size kept) still fails verification on every
        # rank, naming the file, whichever rank read it.
        assert f"rank {rank}: corrupt shard __1_0.distcp named" in output, output


def test_two_ranks_async_save_stages_only_what_the_rank_writes(two_ranks):
    records = _io_records(two_ranks)
    full = records[0]["full_bytes"]
    staged = [record["staged_bytes"] for record in records]
    assert all(len(s) == 1 for s in staged), staged  # one async save
    staged_bytes = [s[0] for s in staged]
    print(f"full state {full} bytes; staged per rank {staged_bytes}")
    # Under DDP every rank holds the whole replicated state, but DCP writes each replicated tensor
    # once: each rank stages about half (its share plus its own rng entry), not all of it.
    for rank_bytes in staged_bytes:
        assert 0.3 * full < rank_bytes < 0.7 * full, (staged_bytes, full)
    assert sum(staged_bytes) >= full  # everything is staged by some rank


def test_two_ranks_refuse_a_second_run_on_every_rank(two_ranks):
    output = two_ranks["output"]
    for rank in (0, 1):
        # A manager of another run on the folder that run 'roundtrip' holds: one ConfigError on
        # every rank, naming the holder (rank 0 decides and broadcasts).
        assert f"rank {rank}: second run refused" in output, output
    assert not (two_ranks["dir"] / "roundtrip" / "sync" / LOCK).exists()  # released on close


@pytest.mark.parametrize("folder", ["sync", "async"])
def test_one_process_loads_a_two_rank_checkpoint(two_ranks, folder):
    ckpts = manager(two_ranks["dir"] / "roundtrip" / folder)
    checkpoint = ckpts.resolve_resume("auto")
    assert checkpoint.world_size == 2 and checkpoint.has_key("rng/rank1")
    target = worker.empty_state(0)
    ckpts.load(checkpoint, target)
    expected = torch.load(two_ranks["dir"] / "roundtrip" / "expected_rank0.pt", weights_only=True)
    got = worker.tensors(target)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    # Rank 1's RNG state is there too, and it differs from rank 0's.
    rank1 = {"rng/rank1": torch.zeros(5056, dtype=torch.uint8)}
    ckpts.load(checkpoint, rank1)
    expected1 = torch.load(two_ranks["dir"] / "roundtrip" / "expected_rank1.pt", weights_only=True)
    assert torch.equal(rank1["rng/rank1"], expected1["rng/rank1"])
    assert not torch.equal(rank1["rng/rank1"], expected["rng/rank0"])


def test_replicated_tensors_are_saved_once(two_ranks, tmp_path):
    two_rank = checkpoint_bytes(two_ranks["dir"] / "roundtrip" / "sync" / "step_00000001")
    manager(tmp_path).save(1, worker.trained_state(0))
    one_rank = checkpoint_bytes(tmp_path / "step_00000001")
    replicated = sum(
        t.numel() * t.element_size()
        for k, t in worker.tensors(worker.trained_state(0)).items()
        if not k.startswith("rng/")
    )
    print(
        f"checkpoint bytes: 1 rank {one_rank}, 2 ranks {two_rank}, replicated tensors {replicated}"
    )
    # Two ranks add one RNG state and a second shard file, not a second copy of the model.
    assert one_rank < two_rank < one_rank + replicated // 4


def test_rank_killed_during_save_leaves_the_previous_checkpoint(two_ranks, caplog):
    assert two_ranks["returncode"] != 0  # rank 1 was SIGKILLed in the middle of step 2's save
    directory = two_ranks["dir"] / "kill"
    # The same run, restarted: it owns the staging folder the killed save left behind.
    ckpts = manager(directory, run_id=worker.KILL_RUN)
    staging = ckpts.staging_dir(2)
    assert [p for p in directory.iterdir() if p.name.startswith(".staging")] == [staging]
    assert (staging / "__0_0.distcp").exists()  # rank 0 had started writing step 2
    assert [c.step for c in ckpts.checkpoints()] == [1]
    checkpoint = ckpts.resolve_resume("auto")
    assert checkpoint.step == 1 and checkpoint.meta == {"value": 1}
    target = {"weight": torch.zeros(worker.WIDTH, worker.WIDTH), "rng/rank0": torch.zeros(8)}
    ckpts.load(checkpoint, target)
    assert torch.equal(target["weight"], torch.ones(worker.WIDTH, worker.WIDTH))
    # The next save of step 2 starts from a clean staging folder.
    ckpts.save(2, {"weight": torch.full((2,), 2.0)})
    ckpts.close()
    assert listing(directory) == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in (directory / "step_00000002").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        MANIFEST,
    ]
    metadata = FileSystemReader(directory / "step_00000002").read_metadata()
    assert metadata.state_dict_metadata.keys() == {"weight"}
