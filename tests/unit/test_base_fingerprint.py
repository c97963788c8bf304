"""The fingerprint of a LoRA run's base folder (models/base_fingerprint.py): the same for the same
weights wherever the folder lies, different for another shape, another shard name, another size or
other values; a malformed weight file is an error naming it; and the check a resume and an export
make. A LoRA run resumed and exported against a changed base: tests/unit/test_lora.py."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.base_fingerprint import (
    FINGERPRINT_KEY,
    adapters_meta,
    base_fingerprint,
    check_adapters_base,
    fingerprint_differences,
)
from sdnet_trainer.models.hf_folder import INDEX_FILE

safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors not installed")

SHARDS = {
    "model-00001-of-00002.safetensors": {"embed.weight": (64, 16), "norm.weight": (16,)},
    "model-00002-of-00002.safetensors": {"head.weight": (32, 16)},
}


def _write(folder: Path, shards: dict[str, dict[str, tuple[int, ...]]], *, seed: int = 0) -> Path:
    """A sharded Hugging Face folder: each shard's tensors (seeded values) and the index."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    weight_map = {}
    for file, tensors in shards.items():
        values = {name: torch.randn(shape, generator=g) for name, shape in tensors.items()}
        safetensors_torch.save_file(values, folder / file)
        weight_map.update(dict.fromkeys(tensors, file))
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture
def base(tmp_path) -> Path:
    return _write(tmp_path / "base", SHARDS)


def test_the_same_weights_have_the_same_fingerprint_wherever_they_lie(base, tmp_path):
    first = base_fingerprint(base)
    assert base_fingerprint(base) == first
    assert base_fingerprint(Path(shutil.copytree(base, tmp_path / "moved"))) == first
    assert sorted(first["files"]) == sorted(SHARDS)
    sizes = [(base / name).stat().st_size for name in SHARDS]
    assert first["total_bytes"] == sum(sizes)
    assert fingerprint_differences(first, first) == []


def test_a_single_file_folder_has_one_file_and_no_index(tmp_path):
    folder = tmp_path / "single"
    folder.mkdir()
    safetensors_torch.save_file({"w": torch.ones(4, 4)}, folder / "model.safetensors")
    fingerprint = base_fingerprint(folder)
    assert list(fingerprint["files"]) == ["model.safetensors"]
    assert fingerprint["index_sha256"] is None


def _changed(base: Path, tmp_path: Path, change: str) -> Path:
    if change == "shape":
        shards = {**SHARDS, "model-00002-of-00002.safetensors": {"head.weight": (48, 16)}}
        return _write(tmp_path / "other", shards)
    if change == "renamed":
        renamed = {name.replace("model-", "weights-"): t for name, t in SHARDS.items()}
        return _write(tmp_path / "other", renamed)
    if change == "values":
        return _write(tmp_path / "other", SHARDS, seed=1)
    # size: the same header and values, 8 more bytes after them (what a copy cut short or
    # padded by a tool would show)
    other = Path(shutil.copytree(base, tmp_path / "other"))
    with (other / "model-00002-of-00002.safetensors").open("ab") as f:
        f.write(b"\0" * 8)
    return other


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("shape", r"model-00002-of-00002\.safetensors: its header .* differs"),
        ("renamed", r"weight files gone: model-00001.*weight files the trained base did not"),
        ("values", r"model-00001-of-00002\.safetensors: the same tensors with other values"),
        ("size", r"model-00002-of-00002\.safetensors: [\d,]+ -> [\d,]+ bytes"),
    ],
)
def test_another_base_has_another_fingerprint(base, tmp_path, change, expected):
    other = _changed(base, tmp_path, change)
    saved, now = adapters_meta(f"hf:{base}"), adapters_meta(f"hf:{other}")
    differences = "; ".join(fingerprint_differences(saved[FINGERPRINT_KEY], now[FINGERPRINT_KEY]))
    assert re.search(expected, differences), differences
    with pytest.raises(ConfigError) as refused:
        check_adapters_base(saved, now, source="checkpoint.resume=/runs/a/step_00000004")
    message = str(refused.value)
    assert message.startswith("checkpoint.resume=/runs/a/step_00000004: ")
    assert f"trained on model.weights=hf:{base}" in message
    assert f"the folder of model.weights=hf:{other} is no longer that base" in message


def _shard(base: Path) -> Path:
    return base / "model-00002-of-00002.safetensors"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\x10\0\0", r"is truncated: 3 bytes, not even the 8-byte length"),
        (
            (1 << 40).to_bytes(8, "little") + b"{}",
            r"its header length says 1,099,511,627,776 bytes",
        ),
        ((100).to_bytes(8, "little") + b"{}" + b" " * 10, r"more than the file holds \(12\)"),
        ((4).to_bytes(8, "little") + b'{"a"', r"its safetensors header is not JSON"),
        ((2).to_bytes(8, "little") + b"[]", r"its safetensors header is not a JSON object"),
    ],
)
def test_a_malformed_weight_file_is_refused_naming_it(base, content, expected):
    _shard(base).write_bytes(content)
    with pytest.raises(ConfigError, match=rf"model\.weights: {_shard(base)}.*{expected}"):
        base_fingerprint(base)


def test_a_linked_weight_file_is_refused(base, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    _shard(base).rename(outside)
    _shard(base).symlink_to(outside)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        base_fingerprint(base)


def test_the_check_between_bases_and_checkpoints(base, tmp_path, caplog):
    """The same base passes; a checkpoint from before fingerprints passes with a warning; a
    seeded base against a folder, either way round, and a malformed record are refused."""
    source = "checkpoint=/runs/a/step_00000004"
    here = adapters_meta(f"hf:{base}")
    check_adapters_base(
        here, adapters_meta(f"hf:{shutil.copytree(base, tmp_path / 'b')}"), source=source
    )
    check_adapters_base(None, here, source=source)  # not a LoRA checkpoint: nothing to check
    seeded = adapters_meta(None)
    assert seeded == {"model_entry": "adapters", "base": None, FINGERPRINT_KEY: None}
    check_adapters_base(seeded, seeded, source=source)
    with caplog.at_level(logging.WARNING, logger="sdnet_trainer.models.base_fingerprint"):
        check_adapters_base({"model_entry": "adapters", "base": "hf:/old"}, here, source=source)
    assert "saved without a fingerprint of their base" in caplog.text
    assert f"model.weights=hf:{base} is not checked" in caplog.text
    with pytest.raises(
        ConfigError, match=r"model\.weights=None.*this run's base is model\.weights=hf:"
    ):
        check_adapters_base(seeded, here, source=source)
    with pytest.raises(
        ConfigError, match=rf"weights=hf:{base}, and this run's base is model\.weights=None"
    ):
        check_adapters_base(here, seeded, source=source)
    broken = {**here, FINGERPRINT_KEY: {"version": 1, "files": "?"}}
    with pytest.raises(
        ConfigError, match=rf"{source}: its meta\.lora\.base_fingerprint is malformed"
    ):
        check_adapters_base(broken, here, source=source)
