"""scripts/bench/bench_checkpoint.py end to end at a tiny size: it must run through both modes on
both stores (the disk and the test's local S3 server) and print its table (a broken script fails
here, not when someone needs the figure). Its main runs in this process: the subject is the
script's machinery, not an interpreter's start-up."""

from __future__ import annotations

import importlib
import logging
import re
import warnings

from tests.support import REPO, bench_main_in_process

NUMBER = r"(\d+(\.\d+)?|nan)"


def test_bench_checkpoint_prints_async_and_sync_rows_of_disk_and_s3(
    tmp_path, monkeypatch, capfd, s3
):
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "bench"))  # to read what main changes
    bench_checkpoint = importlib.import_module("bench_checkpoint")
    argv = ["--params", "2e4", "--width", "32", "--gap", "0.05", "--saves", "2", "--rounds", "2"]
    argv += ["--stores", "disk,s3", "--s3-url", f"{s3.url}/bench"]
    # What main sets up for its process, put back for the tests that follow in this one: the
    # checkpoint logger's level and handler, a warnings filter, torch's global seed.
    ckpt_logger = logging.getLogger(bench_checkpoint.checkpoint_module.__name__)
    handlers, level = list(ckpt_logger.handlers), ckpt_logger.level
    rng = bench_checkpoint.torch.random.get_rng_state()
    try:
        with warnings.catch_warnings():
            code, out = bench_main_in_process(
                "bench_checkpoint",
                [*argv, "--dir", str(tmp_path)],
                cwd=tmp_path,
                monkeypatch=monkeypatch,
                capfd=capfd,
            )
    finally:
        for handler in ckpt_logger.handlers[:]:
            if handler not in handlers:
                ckpt_logger.removeHandler(handler)
        ckpt_logger.setLevel(level)
        bench_checkpoint.torch.random.set_rng_state(rng)
    assert code == 0, out
    # Every store and mode in each round, in an order rotated from round to round.
    rounds = re.findall(r"^round (\d) +(disk|s3) +(sync|async): blocked .* waited ", out, re.M)
    first = [("disk", "sync"), ("disk", "async"), ("s3", "sync"), ("s3", "async")]
    assert rounds == [("1", *c) for c in first] + [("2", *c) for c in first[1:] + first[:1]], out
    header = next(line for line in out.splitlines() if line.startswith("store "))
    assert header.split() == [
        "store", "mode", "saves", "first", "s", "median", "s", "min", "s", "max", "s",
        "waited", "s", "write", "MB/s", "read", "MB/s", "MB",
    ]  # fmt: skip
    for store, mode in first:
        row = re.search(rf"^{store} +{mode} +4( +{NUMBER}){{8}} *$", out, flags=re.M)
        assert row is not None, out
        blocked = [float(v) for v in row.group(0).split()[3:7]]
        assert all(v > 0 for v in blocked), row.group(0)
    assert s3.fs.ls(s3.key(f"{s3.url}/bench"))  # the s3 rows saved there
    assert re.search(r"machine load average .*before \d", out), out
    assert list(tmp_path.iterdir()) == []  # its checkpoints went into a folder it removed
