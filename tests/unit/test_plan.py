"""``python -m sdnet_trainer --dry-run``: a 1,024-rank layout planned on this machine (its per-rank
bytes are checked against real runs in tests/distributed/test_layouts.py)."""

from __future__ import annotations

import json

import pytest

from tests.support import main_in_process

# python -m sdnet_trainer --dry-run ..., through cli.main in this process (a plan starts nothing).
pytestmark = pytest.mark.usefixtures("main_in_this_process")
LAYOUT = ["+recipe=gpt_tp_fsdp", "model=gpt_1b", "parallel.tp=8", "parallel.pp=4"]


@pytest.mark.full  # seconds: out of the quick tier
def test_a_config_error_of_the_launch_is_reported_without_it(monkeypatch, capfd):
    # The recipe's 32 sequences over 32 data-parallel ranks leave 1 per rank: not 4 micro-batches.
    code, output = main_in_process(["--dry-run", "world_size=1024", *LAYOUT], monkeypatch, capfd)
    assert code == 2, output[-3000:]
    assert "config error:" in output and "parallel.pipeline.microbatches=4" in output


@pytest.mark.full  # seconds: out of the quick tier
def test_world_size_is_required(monkeypatch, capfd):
    code, output = main_in_process(["--dry-run", *LAYOUT], monkeypatch, capfd)
    assert code == 2 and "world_size=N" in output


@pytest.mark.full  # seconds: out of the quick tier
def test_1024_ranks_of_gpt_1b_plan_in_one_process(tmp_path, monkeypatch, capfd):
    plan = tmp_path / "plan.json"
    args = ["--dry-run", "world_size=1024", *LAYOUT, "loop.global_batch_size=128", f"json={plan}"]
    code, output = main_in_process(args, monkeypatch, capfd)
    assert code == 0, output[-3000:]
    assert "pp 4 x dp_replicate 1 x dp_shard 32 x cp 1 x tp 8 (fsdp)" in output
    ranks = json.loads(plan.read_text())
    # By default the first rank of each pipeline stage: the ranks whose roles differ.
    assert [r["rank"] for r in ranks] == [0, 256, 512, 768]
    assert [r["coordinates"]["pp"] for r in ranks] == [0, 1, 2, 3]
    total = 1_041_387_520 * 4  # configs/model/gpt_1b.yaml, fp32
    for r in ranks:
        # A stage holds about a quarter of the model, split 8 x 32 ways: ~1/1024 of it, far from
        # the whole model (a layout that forgot to shard would hold 4+ GB here).
        assert 0.5 * total / 1024 < r["params"] < 2 * total / 1024
        assert r["grads"] == r["params"] and r["optim"] == 2 * r["params"]  # AdamW: 2 moments
        kinds = {c["kind"].split(" ")[0] for c in r["collectives"]}
        assert {"all_gather", "reduce_scatter", "send/recv"} <= kinds
    # The stages' parameters add up to the whole model over their 256 ranks each, plus the ones
    # tensor parallelism replicates on its 8 ranks: the position embedding and the LayerNorms
    # (18 blocks x 2 + the final one, weight and bias each).
    replicated = (2048 * 2048 + 37 * 2 * 2048) * 4
    assert sum(r["params"] for r in ranks) * 256 == total + 7 * replicated
