"""Hostile checkpoints: every file a resume or an export reads must be a regular file inside the
checkpoint folder, and a corrupted one is detected before it is loaded.

Each attack is crafted from a real checkpoint written by CheckpointManager. The file outside the
checkpoint is a real DCP shard whose tensor holds SENTINEL, so a read of it would show in the
loaded values; each test first shows that DCP's own reader falls for the attack.
"""

from __future__ import annotations

import json
import logging
import pickle
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from sdnet_trainer import Trainer, compose
from sdnet_trainer.checkpoint import (
    MANIFEST,
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    find_checkpoint,
    read_checkpoint,
)
from sdnet_trainer.errors import ConfigError
from tests.support import TINY

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SIZE = 1000
SENTINEL = 666.0
SHARD = "__0_0.distcp"


def manager(directory: Path) -> CheckpointManager:
    return CheckpointManager(directory, keep_last=5, async_save=False, rank=0, world_size=1)


@pytest.fixture
def ckpts(tmp_path) -> Path:
    """A checkpoint directory with step 1 (w = 1) and step 2 (w = 2)."""
    directory = tmp_path / "ckpts"
    saver = manager(directory)
    for step in (1, 2):
        saver.save(step, {"w": torch.full((SIZE,), float(step))})
    return directory


@pytest.fixture
def outside(tmp_path) -> Path:
    """A shard outside any checkpoint, laid out like the real ones, holding SENTINEL."""
    manager(tmp_path / "sentinel").save(1, {"w": torch.full((SIZE,), SENTINEL)})
    path = tmp_path / "outside" / "evil.distcp"
    path.parent.mkdir()
    path.write_bytes((tmp_path / "sentinel" / "step_00000001" / SHARD).read_bytes())
    return path


def fix_manifest(folder: Path, *, drop: tuple[str, ...] = ()) -> None:
    """What an attacker does after editing files: sizes and checksums made to match again."""
    manifest = json.loads((folder / MANIFEST).read_text())
    files = []
    for entry in manifest["files"]:
        if entry["name"] in drop:
            continue
        data = (folder / entry["name"]).read_bytes()  # follows a symlink, as an attacker would
        files.append({**entry, "bytes": len(data), "crc32": zlib.crc32(data)})
    manifest["files"] = files
    (folder / MANIFEST).write_text(json.dumps(manifest))


def point_storage_at(folder: Path, relative_path: str) -> None:
    """Rewrite every storage entry of ``.metadata`` to read ``relative_path`` (the test trusts
    this file: plain pickle is fine here)."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    metadata.storage_data = {
        index: replace(info, relative_path=relative_path)
        for index, info in metadata.storage_data.items()
    }
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def dcp_plain_read(folder: Path) -> torch.Tensor:
    """What DCP's own reader loads from ``folder``: shows the attack is real."""
    target = {"w": torch.zeros(SIZE)}
    dcp.load(target, storage_reader=FileSystemReader(folder), no_dist=True)
    return target["w"]


def assert_refused_everywhere(
    ckpts: Path, folder: Path, message: str, *, resolved: Checkpoint | None = None
) -> None:
    """Resume by path, export's checkpoint=, and a load of an already resolved Checkpoint
    (``resolved``, else the folder read now, sizes only) are all refused with ``message``, and the
    outside file's values never arrive."""
    with pytest.raises(ConfigError) as by_path:
        manager(ckpts).resolve_resume(str(folder))
    assert "checkpoint.resume=" in str(by_path.value) and message in str(by_path.value)
    with pytest.raises(ConfigError) as export:
        find_checkpoint(folder, key="checkpoint")
    assert "checkpoint=" in str(export.value) and message in str(export.value)
    target = {"w": torch.zeros(SIZE)}
    checkpoint = resolved or read_checkpoint(folder)  # what a caller may hold before loading
    with pytest.raises(CheckpointError) as load:
        manager(ckpts).load(checkpoint, target)
    assert message in str(load.value)
    assert not torch.any(target["w"] == SENTINEL)


def assert_auto_falls_back(ckpts: Path, caplog, message: str) -> None:
    with caplog.at_level(logging.WARNING, logger="sdnet_trainer.checkpoint"):
        chosen = manager(ckpts).resolve_resume("auto")
    assert chosen is not None and chosen.step == 1
    warning = next(r.getMessage() for r in caplog.records if "resume=auto" in r.getMessage())
    assert str(ckpts / "step_00000002") in warning and message in warning
    target = {"w": torch.zeros(SIZE)}
    manager(ckpts).load(chosen, target)
    assert torch.equal(target["w"], torch.full((SIZE,), 1.0))


# ---------------------------------------------------------------------- reads outside


def test_absolute_storage_path_is_refused(ckpts, outside, caplog):
    folder = ckpts / "step_00000002"
    point_storage_at(folder, str(outside))
    fix_manifest(folder)
    assert torch.all(dcp_plain_read(folder) == SENTINEL)  # DCP alone reads the outside file
    message = f".metadata entry w points to '{outside}', outside the checkpoint"
    assert_refused_everywhere(ckpts, folder, message)
    assert_auto_falls_back(ckpts, caplog, message)


def test_parent_relative_storage_path_is_refused(ckpts, outside, caplog):
    # The shard moved next to the checkpoint folder (and replaced by the sentinel's), the
    # manifest fixed up to no longer list it: the manifest check alone passes.
    folder = ckpts / "step_00000002"
    (folder / SHARD).unlink()
    (ckpts / "x.distcp").write_bytes(outside.read_bytes())
    point_storage_at(folder, "../x.distcp")
    fix_manifest(folder, drop=(SHARD,))
    assert read_checkpoint(folder).step == 2
    assert torch.all(dcp_plain_read(folder) == SENTINEL)
    message = ".metadata entry w points to '../x.distcp', outside the checkpoint"
    assert_refused_everywhere(ckpts, folder, message)
    assert_auto_falls_back(ckpts, caplog, message)


def test_unlisted_storage_file_is_refused(ckpts):
    folder = ckpts / "step_00000002"
    (folder / "extra.distcp").write_bytes((folder / SHARD).read_bytes())
    point_storage_at(folder, "extra.distcp")
    fix_manifest(folder)
    assert_refused_everywhere(
        ckpts, folder, ".metadata entry w points to 'extra.distcp', a file manifest.json does not"
    )


@pytest.mark.parametrize("name", [SHARD, ".metadata", MANIFEST])
def test_symlinked_file_is_refused(ckpts, outside, caplog, name):
    folder = ckpts / "step_00000002"
    resolved_before = read_checkpoint(folder)
    if name == SHARD:
        target = outside
    else:  # a copy of the same file elsewhere: only the link itself is wrong
        target = outside.parent / name
        target.write_bytes((folder / name).read_bytes())
    (folder / name).unlink()
    (folder / name).symlink_to(target)
    if name == SHARD:
        fix_manifest(folder)  # the outside shard's size and checksum
        assert torch.all(dcp_plain_read(folder) == SENTINEL)
    message = f"{name} is a symbolic link"
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(folder)  # even listing refuses it
    # The load of a Checkpoint resolved before the link appeared opens no link either.
    assert_refused_everywhere(ckpts, folder, message, resolved=resolved_before)
    assert_auto_falls_back(ckpts, caplog, message)


def test_special_file_is_refused(ckpts):
    folder = ckpts / "step_00000002"
    (folder / SHARD).unlink()
    (folder / SHARD).mkdir()
    with pytest.raises(CheckpointError, match=f"{SHARD} is not a regular file"):
        read_checkpoint(folder)


@pytest.mark.parametrize("name", ["../step_00000001/.metadata", "/etc/passwd", "..", ""])
def test_manifest_names_must_be_plain_file_names(ckpts, name):
    folder = ckpts / "step_00000002"
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"].append({"name": name, "bytes": 1, "crc32": 0})
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="malformed file entry"):
        read_checkpoint(folder)


# ---------------------------------------------------------------------- corruption


def zero_metadata(folder: Path) -> None:
    path = folder / ".metadata"
    path.write_bytes(bytes(path.stat().st_size))  # same size: the size check passes


def test_zeroed_metadata_falls_back_to_the_previous_checkpoint(ckpts, caplog):
    folder = ckpts / "step_00000002"
    zero_metadata(folder)
    assert manager(ckpts).latest().step == 2  # listing checks sizes only
    assert_auto_falls_back(ckpts, caplog, ".metadata does not match its checksum")
    with pytest.raises(ConfigError, match=r"checkpoint\.resume=.*\.metadata does not match"):
        manager(ckpts).resolve_resume(str(folder))
    # A directory stands for its newest checkpoint that passes: step 1, for export too.
    assert find_checkpoint(ckpts, key="checkpoint").step == 1


def test_zeroed_shard_is_detected_by_its_checksum(ckpts):
    folder = ckpts / "step_00000002"
    (folder / SHARD).write_bytes(bytes((folder / SHARD).stat().st_size))
    with pytest.raises(ConfigError, match=rf"{SHARD} does not match its checksum"):
        manager(ckpts).resolve_resume(str(folder))
    assert manager(ckpts).resolve_resume("auto").step == 1


def as_format_1(folder: Path) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["format_version"] = 1
    manifest["files"] = [{"name": f["name"], "bytes": f["bytes"]} for f in manifest["files"]]
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_format_1_checkpoints_still_load(ckpts, caplog):
    for step in (1, 2):
        as_format_1(ckpts / f"step_{step:08d}")
    chosen = manager(ckpts).resolve_resume(str(ckpts / "step_00000002"))
    target = {"w": torch.zeros(SIZE)}
    manager(ckpts).load(chosen, target)
    assert torch.equal(target["w"], torch.full((SIZE,), 2.0))
    # Without checksums, an unreadable .metadata still fails verification rather than the load.
    zero_metadata(ckpts / "step_00000002")
    assert_auto_falls_back(ckpts, caplog, "invalid load key")


def test_trainer_resume_auto_skips_a_corrupted_checkpoint(tmp_path, caplog):
    """The run-level symptom: a zeroed .metadata in the newest checkpoint used to end a
    resume=auto run with a traceback; now it resumes from the previous one."""
    common = TINY + ["loop.eval_at_end=false", "checkpoint.every_n_steps=1"]
    Trainer(compose(common + ["loop.max_steps=2"]), output_dir=tmp_path).fit()
    zero_metadata(tmp_path / "checkpoints" / "step_00000002")
    resumed = Trainer(compose(common + ["loop.max_steps=3"]), output_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="sdnet_trainer"):
        resumed.fit()
    assert resumed.state.step == 3
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "resume=auto: skipping checkpoint" in m and ".metadata does not match" in m
        for m in messages
    ), messages
    assert any(m.startswith("resumed from") and "step_00000001" in m for m in messages), messages
