"""scripts/bench/bench_checkpoint.py end to end at a tiny size: it must run through both modes and
print its table (a broken script fails here, not when someone needs the figure)."""

from __future__ import annotations

import re
import sys

from tests.support import REPO, run_command

NUMBER = r"(\d+(\.\d+)?|nan)"


def test_bench_checkpoint_prints_async_and_sync_rows(tmp_path):
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_checkpoint.py")]
    cmd += ["--params", "2e4", "--width", "32", "--gap", "0.05", "--saves", "2", "--rounds", "2"]
    launch = run_command([*cmd, "--dir", str(tmp_path)], cwd=tmp_path, timeout=300)
    assert launch.returncode == 0, launch.output
    out = launch.output
    # Both modes in each round, alternating which goes first.
    rounds = re.findall(r"^round (\d) +(sync|async): blocked .* waited ", out, flags=re.M)
    assert rounds == [("1", "sync"), ("1", "async"), ("2", "async"), ("2", "sync")], out
    header = next(line for line in out.splitlines() if line.startswith("mode "))
    assert header.split() == [
        "mode", "saves", "first", "s", "median", "s", "min", "s", "max", "s", "waited", "s",
        "write", "MB/s", "read", "MB/s", "MB",
    ]  # fmt: skip
    for mode in ("sync", "async"):
        row = re.search(rf"^{mode} +4( +{NUMBER}){{8}} *$", out, flags=re.M)
        assert row is not None, out
        blocked = [float(v) for v in row.group(0).split()[2:6]]
        assert all(v > 0 for v in blocked), row.group(0)
    assert re.search(r"machine load average .*before \d", out), out
    assert list(tmp_path.iterdir()) == []  # its checkpoints went into a folder it removed
