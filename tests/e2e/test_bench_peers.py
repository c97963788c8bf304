"""scripts/bench/bench_peers.py end to end, on its cheapest workload: the Trainer side must launch
through the real CLI with every pinned key taking effect, and a missing peer package must be
reported in its cell, not fail the run. The driver's main runs in this process (the subject is
its launches, each a torchrun of its own, not the driver's start-up)."""

from __future__ import annotations

import importlib.util
import json

from tests.support import bench_main_in_process


def test_bench_peers_times_the_trainer_beside_the_hand_written_loop(tmp_path, monkeypatch, capfd):
    out = tmp_path / "bench"
    sides = ["hand", "trainer"]
    if importlib.util.find_spec("lightning") is None:
        sides.append("lightning")  # not installed in the test extra: its cell says how to install
    argv = ["--workload", "gpt", "--sides", ",".join(sides)]
    # One process per launch: the driver's launches, pinned keys and table are the subject; each
    # further rank is an interpreter's start-up (seconds of CPU) and nothing the test checks.
    argv += ["--nproc", "1", "--rounds-other", "1", "--warmup", "2", "--steps", "10"]
    argv += ["--timeout", "300"]
    argv += ["--out", str(out)]
    code, output = bench_main_in_process(
        "bench_peers", argv, cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd
    )
    assert code == 0, output
    results = {p.stem: json.loads(p.read_text()) for p in (out / "gpt").glob("r1_*.json")}
    assert {"r1_hand", "r1_trainer"} <= set(results), output
    hand, trainer = results["r1_hand"], results["r1_trainer"]
    # The same timed window, batch and initial weights on both sides, a throughput each.
    for key in ("steps", "warmup", "per_rank_batch", "world_size", "init_checksum"):
        assert trainer[key] == hand[key], key
    assert trainer["throughput"] > 0 and hand["throughput"] > 0
    table = output[output.index("gpt: tokens/s") :]
    assert any(line.split()[:1] == ["trainer"] for line in table.splitlines())
    if "lightning" in sides:
        assert "pip install -e '.[bench]'" in table
