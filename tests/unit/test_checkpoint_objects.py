"""Checkpoints in object storage, against a real S3 API (moto's server on 127.0.0.1, reached through
s3fs as a run reaches S3): the commit protocol without rename (the manifest, written last, is the
commit), pruning, the lock, a failed upload, and a checkpoint whose objects lie.

The multi-process cases (a rank killed while its async save uploads, a resume on another world
size from S3) are in tests/distributed/test_faults.py; export and serve from S3 in tests/e2e."""

from __future__ import annotations

import json
import logging
import pickle
import time
import zlib
from dataclasses import replace

import pytest
import torch

from sdnet_trainer import compose
from sdnet_trainer.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    disk,
    find_checkpoint,
    read_checkpoint,
)
from sdnet_trainer.checkpoint import lock as lock_module
from sdnet_trainer.checkpoint.files import folder_of
from sdnet_trainer.checkpoint.lock import LEASE_EXPIRES_S
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.preflight import validate
from tests.support import TINY

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARD = "__0_0.distcp"
SIZE = 1000


def manager(url: str, *, run_id: str | None = "run-a", async_save: bool = False, keep_last=2):
    return CheckpointManager(
        url, keep_last=keep_last, async_save=async_save, rank=0, world_size=1, run_id=run_id
    )


def state(step: int) -> dict:
    return {"w": torch.full((SIZE,), float(step)), "count": step}


def saved(m: CheckpointManager, *steps: int) -> None:
    for step in steps:
        m.save(step, state(step), meta={"step": step})
    m.wait()


def objects(s3, url: str) -> dict[str, int]:
    """{object name: bytes} directly under ``url``."""
    return {
        entry["name"].rsplit("/", 1)[-1]: entry["size"]
        for entry in s3.fs.ls(s3.key(url), detail=True, refresh=True)
        if entry["type"] == "file"
    }


def steps_in(s3, url: str) -> list[str]:
    return sorted(p.rsplit("/", 1)[-1] for p in s3.fs.ls(s3.key(url), refresh=True))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_prune_resume_and_load_through_s3(s3, async_save):
    url = f"{s3.url}/run/checkpoints"
    m = manager(url, async_save=async_save)
    saved(m, 1, 2, 3)
    assert [c.step for c in m.checkpoints()] == [2, 3]
    chosen = m.resolve_resume("auto")
    assert chosen is not None and chosen.step == 3 and chosen.meta == {"step": 3}
    target = {"w": torch.zeros(SIZE), "count": 0}
    m.load(chosen, target)
    assert torch.equal(target["w"], torch.full((SIZE,), 3.0)) and target["count"] == 3
    m.close()  # the pruned step's deletion finishes, the lock goes
    assert steps_in(s3, url) == ["step_00000002", "step_00000003"]
    # The manifest, written last, names every object of the step with its size and crc32.
    step = f"{url}/step_00000003"
    manifest = json.loads(s3.fs.cat(s3.key(f"{step}/{MANIFEST}")))
    listed = {e["name"]: (e["bytes"], e["crc32"]) for e in manifest["files"]}
    present = objects(s3, step)
    assert sorted(listed) == sorted(set(present) - {MANIFEST}) == [".metadata", SHARD]
    for name, (size, crc) in listed.items():
        data = s3.fs.cat(s3.key(f"{step}/{name}"))
        assert (len(data), zlib.crc32(data)) == (size, crc), name
    # Released: the same prefix is free for the next run.
    manager(url, run_id="run-b").close()


def test_a_step_without_its_manifest_never_counts_and_is_saved_again(s3, caplog):
    url = f"{s3.url}/ck"
    m = manager(url, keep_last=5)
    saved(m, 1, 2)
    # A save cut short: every shard uploaded, no manifest (the crash came before the commit).
    s3.fs.rm(s3.key(f"{url}/step_00000002/{MANIFEST}"))
    assert [c.step for c in m.checkpoints()] == [1]
    with caplog.at_level(logging.WARNING, logger="sdnet_trainer.checkpoint"):
        chosen = m.resolve_resume("auto")
    assert chosen is not None and chosen.step == 1
    assert any(
        f"{url}/step_00000002" in r.getMessage() and "no manifest.json" in r.getMessage()
        for r in caplog.records
    )
    # The run goes on from step 1 and saves step 2 again: every leftover goes first (here a shard
    # of a larger world that the new save would not overwrite).
    s3.fs.pipe(s3.key(f"{url}/step_00000002/__9_0.distcp"), b"a rank 9's shard")
    saved(m, 2)
    assert [c.step for c in m.checkpoints()] == [1, 2]
    assert "__9_0.distcp" not in objects(s3, f"{url}/step_00000002")
    m.close()


def test_a_pruning_cut_short_leaves_the_newest_step_usable(s3):
    url = f"{s3.url}/ck"
    m = manager(url, keep_last=1)
    saved(m, 1)
    # Pruning deletes the manifest first: cut short there, the old step no longer counts.
    s3.fs.rm(s3.key(f"{url}/step_00000001/{MANIFEST}"))
    saved(m, 2)
    m.close()
    assert [c.step for c in manager(url, run_id=None).checkpoints()] == [2]
    assert steps_in(s3, url) == ["step_00000002"]  # the leftovers went with the next pruning


def test_damaged_steps_are_skipped_for_the_previous_committed_one_with_a_warning(s3, caplog):
    """Step 4's shard flipped, step 3's truncated, step 2's deleted: resume=auto loads step 1,
    saying for each skipped step which object failed and how."""
    url = f"{s3.url}/ck"
    m = manager(url, keep_last=5)
    saved(m, 1, 2, 3, 4)
    damages = {
        4: (lambda data: data[:-1] + bytes([data[-1] ^ 0xFF]), "does not match its checksum"),
        3: (lambda data: data[:-10], "bytes, manifest.json says"),
        2: (None, "is missing"),
    }
    for step, (damage, _) in damages.items():
        shard = s3.key(f"{url}/step_{step:08d}/{SHARD}")
        if damage is None:
            s3.fs.rm(shard)
        else:
            s3.fs.pipe(shard, damage(s3.fs.cat(shard)))
    with caplog.at_level(logging.WARNING, logger="sdnet_trainer.checkpoint"):
        chosen = m.resolve_resume("auto")
    assert chosen is not None and chosen.step == 1
    warnings = [r.getMessage() for r in caplog.records if "resume=auto" in r.getMessage()]
    for step, (_, message) in damages.items():
        assert any(f"{url}/step_{step:08d}: {SHARD} " in w and message in w for w in warnings), (
            warnings
        )
    target = state(0)
    m.load(chosen, target)
    assert torch.equal(target["w"], torch.full((SIZE,), 1.0))
    m.close()


def test_a_manifest_naming_objects_outside_its_prefix_is_refused(s3):
    url = f"{s3.url}/ck"
    m = manager(url, keep_last=5)
    saved(m, 1, 2)
    m.close()
    step = s3.key(f"{url}/step_00000002")
    original = s3.fs.cat(f"{step}/{MANIFEST}")
    for name in ["../step_00000001/__0_0.distcp", "a/b", "", ".."]:
        manifest = json.loads(original)
        manifest["files"].append({"name": name, "bytes": 1, "crc32": 0})
        s3.fs.pipe(f"{step}/{MANIFEST}", json.dumps(manifest).encode())
        with pytest.raises(CheckpointError, match="malformed file entry"):
            read_checkpoint(folder_of(f"{url}/step_00000002"))
        with pytest.raises(ConfigError, match="checkpoint=.*malformed file entry"):
            find_checkpoint(f"{url}/step_00000002", key="checkpoint")


def test_a_second_run_on_the_same_prefix_is_refused_naming_it(s3):
    url = f"{s3.url}/shared"
    first = manager(url, run_id="first")
    with pytest.raises(ConfigError) as refused:
        manager(url, run_id="second")
    assert f"checkpoint.dir={url} is in use by run 'first'" in str(refused.value)
    assert f"{url}/checkpoint.lock" in str(refused.value)
    first.close()
    manager(url, run_id="second").close()


def test_a_failed_upload_is_a_failed_save_and_the_previous_step_stays(s3, monkeypatch):
    url = f"{s3.url}/ck"
    m = manager(url, async_save=True, keep_last=5)
    saved(m, 1)
    write = disk._ChecksummedStream.write

    def broken(self, data):
        raise ConnectionResetError("the connection to the store was reset")

    monkeypatch.setattr(disk._ChecksummedStream, "write", broken)
    m.save(2, state(2))  # returns once staged in host memory: the upload fails in the background
    with pytest.raises(CheckpointError, match="cannot save step 2.*connection to the store"):
        m.wait()
    assert [c.step for c in m.checkpoints()] == [1]
    monkeypatch.setattr(disk._ChecksummedStream, "write", write)
    saved(m, 3)
    assert [c.step for c in m.checkpoints()] == [1, 3]
    m.close()


def test_storage_options_carry_no_credentials_and_the_store_must_be_known():
    base = [*TINY, "checkpoint.dir=s3://bucket/run"]
    validate(
        compose([*base, "+checkpoint.storage_options.endpoint_url=http://minio:9000"]), world_size=1
    )
    allowed = "+checkpoint.storage_options.client_kwargs.aws_access_key_id=AKIA"  # an identifier
    validate(compose([*base, allowed]), world_size=1)
    for key in (
        "secret",
        "key",
        "client_kwargs.aws_secret_access_key",
        "client_kwargs.SecretAccessKey",
        "token",
        "account_key",
        "headers.Authorization",
    ):
        with pytest.raises(ConfigError, match=f"checkpoint.storage_options.{key}: credentials"):
            validate(compose([*base, f"+checkpoint.storage_options.{key}=x"]), world_size=1)
    with pytest.raises(ConfigError, match="checkpoint.dir='nosuchstore://b/run'"):
        validate(compose([*TINY, "checkpoint.dir=nosuchstore://b/run"]), world_size=1)


def test_metadata_pointing_at_an_object_the_manifest_does_not_list_is_refused(s3):
    """DCP's .metadata rewritten to read step 1's shard from step 2 (sizes and checksums in the
    manifest made to match, as a forger would): refused before any shard is opened."""
    url = f"{s3.url}/ck"
    m = manager(url, keep_last=5)
    saved(m, 1, 2)
    step = s3.key(f"{url}/step_00000002")
    metadata = pickle.loads(s3.fs.cat(f"{step}/.metadata"))  # the test trusts its own file
    metadata.storage_data = {
        index: replace(info, relative_path="../step_00000001/__0_0.distcp")
        for index, info in metadata.storage_data.items()
    }
    data = pickle.dumps(metadata)
    s3.fs.pipe(f"{step}/.metadata", data)
    manifest = json.loads(s3.fs.cat(f"{step}/{MANIFEST}"))
    for entry in manifest["files"]:
        if entry["name"] == ".metadata":
            entry.update(bytes=len(data), crc32=zlib.crc32(data))
    s3.fs.pipe(f"{step}/{MANIFEST}", json.dumps(manifest).encode())
    with pytest.raises(ConfigError, match=r"points to '\.\./step_00000001/__0_0\.distcp', outside"):
        find_checkpoint(f"{url}/step_00000002", key="checkpoint")
    target = state(0)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        m.load(read_checkpoint(folder_of(f"{url}/step_00000002")), target)
    assert torch.equal(target["w"], torch.zeros(SIZE))
    m.close()


def test_any_fsspec_url_holds_checkpoints(tmp_path):
    """memory:// (fsspec's in-process store) through the same protocol: save, prune, resume."""
    url = f"memory://{tmp_path.name}/ck"
    m = manager(url)
    saved(m, 1, 2, 3)
    chosen = m.resolve_resume("auto")
    assert chosen is not None and chosen.step == 3 and [c.step for c in m.checkpoints()] == [2, 3]
    target = state(0)
    m.load(chosen, target)
    assert torch.equal(target["w"], torch.full((SIZE,), 3.0))
    m.close()


def test_the_lock_object_is_a_lease_its_holder_renews(s3, monkeypatch, caplog):
    """A lock held from another host is refused while it is renewed, and taken over once it has
    not been for LEASE_EXPIRES_S (its node gone, as a preempted cloud node is); the holder's
    thread renews it."""
    url = f"{s3.url}/leased"
    now = time.time()
    elsewhere = {"run_id": "gone", "host": "node-7", "pid": 1, "created": now - 7200, "token": "t"}
    lock = s3.key(f"{url}/checkpoint.lock")
    s3.fs.pipe(lock, json.dumps({**elsewhere, "renewed": now - 30}).encode())
    with pytest.raises(ConfigError, match="lease is taken over once not renewed for 600 s"):
        manager(url, run_id="mine")
    s3.fs.pipe(lock, json.dumps({**elsewhere, "renewed": now - LEASE_EXPIRES_S - 60}).encode())
    monkeypatch.setattr(lock_module, "LEASE_RENEW_S", 0.1)
    with caplog.at_level(logging.WARNING, logger="sdnet_trainer.checkpoint"):
        held = manager(url, run_id="mine")
    assert "has not renewed its lease" in caplog.text and "node-7" in caplog.text
    first = json.loads(s3.fs.cat(lock))
    assert first["run_id"] == "mine"
    time.sleep(0.5)
    renewed = json.loads(s3.fs.cat(lock))
    assert renewed["token"] == first["token"] and renewed["renewed"] > first["created"]
    held.close()
    assert not s3.fs.exists(lock)
