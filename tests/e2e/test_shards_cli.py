"""Shards from the command line: the converter, then training with data.name=shards on 2
processes, locally and from http:// URLs, step for step like the ImageFolder it came from.

The converter's command starts as a user types it (``python -W error -m
sdnet_trainer.data.shards``) twice: the first conversion and ``-h``. Its other runs check what its
``__main__`` does with their arguments (skips, usage errors, the default shard size, ``--help``):
they run that ``__main__`` forked ready-imported (tests/forked.py), without an interpreter's
start-up each (seconds of importing torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.shards import DEFAULT_SHARD_SIZE, build_shards
from tests.forked import run_forked, run_module_apart
from tests.support import TINY, cli_env, read_jsonl, run_cli
from tests.unit.test_shards import _folder, range_server

CONVERTER = "sdnet_trainer.data.shards"


def _run_quiet(args: list[str], *, cwd) -> subprocess.CompletedProcess:
    """``python -W error -m sdnet_trainer.data.shards ARGS`` with stdout and stderr apart: any
    warning (runpy's about sys.modules included) is an error, and stderr must stay empty."""
    return subprocess.run(
        [sys.executable, "-W", "error", "-m", CONVERTER, *args],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _run_quiet_forked(args: list[str], *, cwd) -> subprocess.CompletedProcess:
    """_run_quiet's command, its ``__main__`` forked ready-imported with warnings as errors."""
    return run_module_apart(CONVERTER, args, cwd=cwd, timeout=120, warnings_as_errors=True)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The folder converted to shards of 4 by the command as a user types it: no warning (an
    error here), nothing on stderr, a report of what it wrote."""
    base = tmp_path_factory.mktemp("shards_cli")
    src = _folder(base / "folder")
    out = base / "shards"
    args = [str(src), str(out), "shard_size=4"]
    first = _run_quiet(args, cwd=base)
    assert first.returncode == 0, first.stderr
    assert first.stderr == ""
    assert json.loads(first.stdout.strip().splitlines()[-1])["train"]["written"] == 6
    return base, src, out, args


def test_converter_command_skips_what_is_done(converted):
    base, _, out, args = converted
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    again = run_forked(args, cwd=base, module=CONVERTER, timeout=120)
    assert again.returncode == 0, again.output
    report = json.loads(again.output.strip().splitlines()[-1])
    assert report["train"] == {"samples": 21, "shards": 6, "written": 0, "skipped": 6}
    assert report["val"]["written"] == 0 and report["classes"] == 3
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    bad = run_forked(args[:-2], cwd=base, module=CONVERTER, timeout=120)  # SRC only
    assert bad.returncode == 2 and "usage:" in bad.output and "Traceback" not in bad.output
    bad = run_forked([*args, "shards=4"], cwd=base, module=CONVERTER, timeout=120)
    assert bad.returncode == 2 and "unknown: shards" in bad.output


def test_converter_command_needs_only_src_and_out(converted):
    base, src, out, _ = converted
    done = _run_quiet_forked([str(src), str(base / "default")], cwd=base)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["train"] == {"samples": 21, "shards": 1, "written": 1, "skipped": 0}
    assert report["val"] == {"samples": 6, "shards": 1, "written": 1, "skipped": 0}
    # The same samples, in the same order, as the shards of 4 written above.
    whole, _ = build_shards(DataConfig(name="shards", root=str(base / "default")))
    split, _ = build_shards(DataConfig(name="shards", root=str(out)))
    assert whole.keys == split.keys and whole.targets == split.targets
    assert [whole.read(i) for i in range(len(whole))] == [split.read(i) for i in range(len(split))]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_converter_command_help(converted, flag):
    """Either flag prints the help on stdout, nothing on stderr, no warning: ``-h`` through the
    command as a user types it, ``--help`` through its ``__main__`` forked (the flag is read by
    the same ``main``; the interpreter's start-up is the same as -h's)."""
    base = converted[0]
    shown = (_run_quiet if flag == "-h" else _run_quiet_forked)([flag], cwd=base)
    assert shown.returncode == 0 and shown.stderr == ""
    assert shown.stdout.startswith("usage: python -m sdnet_trainer.data.shards")
    assert f"(default {DEFAULT_SHARD_SIZE})" in shown.stdout


def _losses(root, run_dir, *, data_name: str) -> list[float]:
    launch = run_cli(
        TINY
        + [
            "data=imagefolder",
            f"data.name={data_name}",
            f"data.root={root}",
            "data.image_size=16",
            "data.num_classes=3",
            "model.num_classes=3",
            "data.num_workers=1",
            "loop.global_batch_size=6",
            "loop.max_steps=6",
            "logging.log_every_n_steps=1",
            "checkpoint.save_on_exit=false",  # the runs are compared by their losses
            f"hydra.run.dir={run_dir}",
        ],
        cwd=run_dir.parent,
        nproc=2,
    )
    assert launch.returncode == 0, launch.output
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return [row["train/loss"] for row in rows if "train/loss" in row]


def test_two_processes_train_on_shards_like_on_the_folder(converted):
    base, src, out, _ = converted
    folder = _losses(src, base / "folder_run", data_name="imagefolder")
    assert len(folder) == 6
    assert _losses(out, base / "shards_run", data_name="shards") == pytest.approx(folder, rel=1e-6)
    with range_server(out) as url:
        remote = _losses(url, base / "http_run", data_name="shards")
    assert remote == pytest.approx(folder, rel=1e-6)
