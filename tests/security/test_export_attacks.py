"""sdnet_trainer.export on hostile checkpoints: a checkpoint is untrusted input.

Each test copies a real checkpoint and edits it as an attacker would: a linked output folder, files
export must not replace, a Trainer class whose module runs code on import, interpolations in the
stored config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from sdnet_trainer import Config, Trainer, compose
from sdnet_trainer.checkpoint import MANIFEST, read_checkpoint
from sdnet_trainer.export import (
    EXIT_BAD_INPUT,
    EXIT_EXPORT_FAILED,
    EXPORT_MANIFEST,
    ExportError,
    escape_interpolations,
    training_config,
)
from sdnet_trainer.export.cli import main
from tests.support import TINY, cli_env

safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="the export extra is not installed"
)

ZEN = "Beautiful is better than ugly."  # what `import this` prints


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint of the tiny CNN, written by sdnet_trainer.Trainer after one step."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose(
        TINY
        + [
            "loop.max_steps=1",
            "loop.global_batch_size=32",
            "loop.eval_at_end=false",
            "logging.trackers=[jsonl]",
        ]
    )
    Trainer(cfg, output_dir=run_dir).fit()
    (step,) = (run_dir / "checkpoints").glob("step_*")
    return step


def _copy(
    checkpoint: Path, dest: Path, edit: Callable[[dict[str, Any]], None] | None = None
) -> Path:
    """A copy of ``checkpoint`` in ``dest``, its manifest's meta changed by ``edit``."""
    copy = dest / checkpoint.name
    shutil.copytree(checkpoint, copy, ignore=shutil.ignore_patterns("export"))
    if edit is not None:
        manifest = json.loads((copy / MANIFEST).read_text())
        edit(manifest["meta"])
        (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy.resolve()


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry below ``folder``: a file's bytes, a link's target."""
    return {
        str(p.relative_to(folder)): os.readlink(p) if p.is_symlink() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


# ---------------------------------------------------------------------- the output folder


@pytest.mark.parametrize("named", [False, True], ids=["default_out", "out_argument"])
def test_a_linked_output_folder_is_refused(checkpoint, tmp_path, capsys, named):
    ckpt = _copy(checkpoint, tmp_path / "ckpts")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.yaml").write_bytes(b"precious: true\n")
    (ckpt / "export").symlink_to(outside, target_is_directory=True)
    before = _snapshot(outside)

    args = [f"checkpoint={ckpt}", "format=pt,safetensors"]
    assert main(args + ([f"out={ckpt / 'export'}"] if named else [])) == EXIT_BAD_INPUT

    err = capsys.readouterr().err
    assert f"{ckpt / 'export'} is a symbolic link" in err
    assert _snapshot(outside) == before  # byte for byte, and nothing added (no staging folder)


@pytest.mark.parametrize("name", ["config.yaml", "model.pt"])
def test_a_linked_target_file_is_refused(checkpoint, tmp_path, capsys, name):
    ckpt = _copy(checkpoint, tmp_path / "ckpts")
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(outside)
    # Even listed by a (forged) manifest, a link is not replaced.
    (out / EXPORT_MANIFEST).write_text(
        json.dumps({"written_by": "sdnet_trainer.export", "files": {name: {}}})
    )
    before = _snapshot(out)

    assert main([f"checkpoint={ckpt}", f"out={out}"]) == EXIT_BAD_INPUT

    assert f"{out / name} is a symbolic link" in capsys.readouterr().err
    assert outside.read_bytes() == b"precious\n"
    assert _snapshot(out) == before


def test_a_foreign_file_is_not_overwritten(checkpoint, tmp_path, capsys):
    ckpt = _copy(checkpoint, tmp_path / "ckpts")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pt").write_bytes(b"someone else's weights")
    before = _snapshot(out)

    assert main([f"checkpoint={ckpt}", f"out={out}"]) == EXIT_BAD_INPUT

    err = capsys.readouterr().err
    assert f"{out / 'model.pt'} exists and was not written by an earlier export" in err
    assert _snapshot(out) == before


@pytest.mark.parametrize(
    "manifest",
    ['{"files": {"model.pt": {}}}', "not json", '["model.pt"]'],
    ids=["other_writer", "not_json", "not_an_object"],
)
def test_a_foreign_export_manifest_is_refused(checkpoint, tmp_path, capsys, manifest):
    ckpt = _copy(checkpoint, tmp_path / "ckpts")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pt").write_bytes(b"someone else's weights")
    (out / EXPORT_MANIFEST).write_text(manifest)
    before = _snapshot(out)

    assert main([f"checkpoint={ckpt}", f"out={out}"]) == EXIT_BAD_INPUT

    assert f"{out / EXPORT_MANIFEST} was not written by sdnet_trainer.export" in (
        capsys.readouterr().err
    )
    assert _snapshot(out) == before


def test_an_earlier_exports_files_are_replaced_and_others_kept(checkpoint, tmp_path, capsys):
    ckpt = _copy(checkpoint, tmp_path / "ckpts")
    out = tmp_path / "absent" / "out"  # created by the export

    assert main([f"checkpoint={ckpt}", f"out={out}", "format=pt"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", EXPORT_MANIFEST, "model.pt"]
    (out / "notes.txt").write_text("mine")
    (out / "model.pt").write_bytes(b"stale")

    # Its own earlier files are replaced; a file of another name is left alone.
    assert main([f"checkpoint={ckpt}", f"out={out}", "format=pt,safetensors"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml",
        EXPORT_MANIFEST,
        "model.pt",
        "model.safetensors",
        "notes.txt",
    ]
    assert (out / "model.pt").read_bytes() != b"stale" and (out / "notes.txt").read_text() == "mine"
    manifest = json.loads((out / EXPORT_MANIFEST).read_text())
    assert manifest["written_by"] == "sdnet_trainer.export"
    assert sorted(manifest["files"]) == ["config.yaml", "model.pt", "model.safetensors"]
    assert manifest["files"]["model.pt"]["step"] == read_checkpoint(ckpt).step

    # A foreign file of a name this export writes is refused before any work.
    (out / "model.pt2").write_bytes(b"someone else's program")
    before = _snapshot(out)
    capsys.readouterr()
    assert main([f"checkpoint={ckpt}", f"out={out}", "format=torch_export"]) == EXIT_BAD_INPUT
    assert f"{out / 'model.pt2'} exists and was not written" in capsys.readouterr().err
    assert _snapshot(out) == before


def test_a_failed_export_leaves_no_files(checkpoint, tmp_path, monkeypatch):
    ckpt = _copy(checkpoint, tmp_path / "ckpts")
    out = tmp_path / "out"

    def fail(*_: Any) -> None:
        raise ExportError("format=safetensors: failing on purpose")

    monkeypatch.setattr("sdnet_trainer.export.writers.write_safetensors", fail)
    assert main([f"checkpoint={ckpt}", f"out={out}", "format=pt,safetensors"]) == (
        EXIT_EXPORT_FAILED
    )
    assert list(out.iterdir()) == []  # neither model.pt nor a staging folder


# ---------------------------------------------------------------------- the Trainer class

EVIL_MODULE = """\
from pathlib import Path

Path(__file__).with_name("MARKER").write_text("imported")

from sdnet_trainer import Trainer


class EvilTrainer(Trainer):
    pass
"""


def _export(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m sdnet_trainer.export`` as a user runs it: its working directory first on the
    module search path."""
    return subprocess.run(
        [sys.executable, "-m", "sdnet_trainer.export", *args],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _record_trainer(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(meta: dict[str, Any]) -> None:
        meta["trainer"] = name
        meta["config"]["trainer"]["_target_"] = name

    return edit


@pytest.mark.parametrize("recorded", ["evil_trainer.EvilTrainer", "this.Trainer"])
def test_a_recorded_trainer_is_never_imported(checkpoint, tmp_path, recorded):
    (tmp_path / "evil_trainer.py").write_text(EVIL_MODULE)
    ckpt = _copy(checkpoint, tmp_path / "ckpts", _record_trainer(recorded))

    done = _export([f"checkpoint={ckpt}", f"out={tmp_path / 'out'}"], cwd=tmp_path)

    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "MARKER").exists()
    assert ZEN not in done.stdout + done.stderr
    assert f"the checkpoint records the Trainer class {recorded!r}" in done.stderr
    assert f"pass trainer={recorded}" in done.stderr
    assert (
        "sdnet_trainer.training.trainer.Trainer.build_model builds"
        in (tmp_path / "out" / "config.yaml").read_text()
    )


def test_trainer_argument_rebuilds_with_the_named_class(checkpoint, tmp_path):
    (tmp_path / "evil_trainer.py").write_text(EVIL_MODULE)
    ckpt = _copy(checkpoint, tmp_path / "ckpts", _record_trainer("evil_trainer.EvilTrainer"))

    # The user names the class: then, and only then, its module is imported.
    done = _export(
        [f"checkpoint={ckpt}", f"out={tmp_path / 'out'}", "trainer=evil_trainer.EvilTrainer"],
        cwd=tmp_path,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "MARKER").exists()
    assert (
        "evil_trainer.EvilTrainer.build_model builds"
        in (tmp_path / "out" / "config.yaml").read_text()
    )


# ---------------------------------------------------------------------- the stored config


def test_a_stored_interpolation_stays_literal_text(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home-sentinel"))

    def edit(meta: dict[str, Any]) -> None:
        meta["config"]["run"]["name"] = "${oc.env:HOME}"

    ckpt = _copy(checkpoint, tmp_path / "ckpts", edit)
    out = tmp_path / "out"

    assert main([f"checkpoint={ckpt}", f"out={out}"]) == 0

    text = (out / "config.yaml").read_text()
    assert "\\${oc.env:HOME}" in text and "home-sentinel" not in text
    # Loading the exported file gives back the literal text, not a live interpolation.
    loaded = OmegaConf.load(out / "config.yaml")
    assert loaded.run.name == "${oc.env:HOME}"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), loaded))
    assert isinstance(cfg, Config) and cfg.run.name == "${oc.env:HOME}"
    # Nothing else changes.
    original = training_config(read_checkpoint(checkpoint))
    assert dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=original.run.name)) == (
        original
    )


@pytest.mark.parametrize(
    "text",
    [
        "${oc.env:HOME}",
        "${sdnet.run_id:}",
        "before ${run.root} after",
        "${",
        "\\${escaped}",
        "C:\\\\${oc.env:HOME}\\x",
        "a \\ backslash, no interpolation",
        "$ {x} and $x",
    ],
)
def test_escaped_strings_load_back_as_their_text(text):
    node = OmegaConf.create(escape_interpolations({"value": text, "items": [text]}))
    assert node.value == text and list(node["items"]) == [text]
    again = OmegaConf.create(OmegaConf.to_yaml(node))  # as config.yaml is written and read
    assert again.value == text and list(again["items"]) == [text]


def test_tokenizer_files_are_copied_under_fixed_names_only(tmp_path):
    """data.tokenizer comes from the run's config: a file is copied only if it reads as a
    tokenizer, never under its own name (one named like a weight shard cannot replace it), and
    never through a link; from a folder only the tokenizer's files are taken."""
    import base64

    from sdnet_trainer.export.hf import copy_tokenizer

    pytest.importorskip("tiktoken")
    source, out = tmp_path / "src", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    shard = "model-00001-of-00001.safetensors"
    pieces = [bytes([b]) for b in range(256)]
    bpe = "".join(f"{base64.b64encode(p).decode()} {r}\n" for r, p in enumerate(pieces))
    (source / shard).write_text(bpe)  # a tiktoken BPE file under a shard's name
    (source / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    (out / shard).write_text("weights")
    assert copy_tokenizer(source / shard, out) == ["tokenizer_config.json", "tokenizer.model"]
    assert (out / shard).read_text() == "weights"
    assert (out / "tokenizer.model").read_text() == bpe
    # A file that is no tokenizer (a key, a password file) is not copied at all.
    secret = tmp_path / "secret"
    secret.write_text("secret")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert copy_tokenizer(secret, elsewhere) == [] and not any(elsewhere.iterdir())
    # A linked tokenizer file is not followed, alone or inside a folder.
    (source / "tokenizer.json").symlink_to(secret)
    assert copy_tokenizer(source / "tokenizer.json", elsewhere) == []
    assert copy_tokenizer(source, elsewhere) == ["tokenizer_config.json"]
    assert not (elsewhere / "tokenizer.json").exists()
