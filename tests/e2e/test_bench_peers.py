"""scripts/bench/bench_peers.py end to end, on its cheapest workload: the Trainer side must launch
through the real CLI with every pinned key taking effect, and a missing peer package must be
reported in its cell, not fail the run."""

from __future__ import annotations

import importlib.util
import json
import sys

from tests.support import REPO, run_command


def test_bench_peers_times_the_trainer_beside_the_hand_written_loop(tmp_path):
    out = tmp_path / "bench"
    sides = ["hand", "trainer"]
    if importlib.util.find_spec("lightning") is None:
        sides.append("lightning")  # not installed in the test extra: its cell says how to install
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_peers.py"), "--workload", "gpt"]
    cmd += ["--sides", ",".join(sides), "--rounds-other", "1", "--warmup", "2", "--steps", "10"]
    launch = run_command([*cmd, "--out", str(out)], cwd=tmp_path, timeout=300)
    assert launch.returncode == 0, launch.output
    results = {p.stem: json.loads(p.read_text()) for p in (out / "gpt").glob("r1_*.json")}
    assert {"r1_hand", "r1_trainer"} <= set(results), launch.output
    hand, trainer = results["r1_hand"], results["r1_trainer"]
    # The same timed window, batch and initial weights on both sides, a throughput each.
    for key in ("steps", "warmup", "per_rank_batch", "world_size", "init_checksum"):
        assert trainer[key] == hand[key], key
    assert trainer["throughput"] > 0 and hand["throughput"] > 0
    table = launch.output[launch.output.index("gpt: tokens/s") :]
    assert any(line.split()[:1] == ["trainer"] for line in table.splitlines())
    if "lightning" in sides:
        assert "pip install -e '.[bench]'" in table
