"""The 1B GPT is never whole on a rank: under FSDP on 4 processes each rank's peak resident memory,
over its whole setup (imports, process group, model built on the meta device, sharded, allocated
and initialised, data and optimizer), stays below half the fp32 model (the issue's bar; a whole
copy per rank, as building on the CPU first did, is 2x over it)."""

from __future__ import annotations

import json

from tests.support import REPO, run_cli

WORKER = REPO / "tests" / "distributed" / "_init_memory_worker.py"


def test_gpt_1b_under_fsdp_never_holds_the_whole_model(tmp_path):
    launch = run_cli(
        [
            str(tmp_path),
            "model=gpt_1b",
            "data=tokens",
            "parallel=fsdp",
            "data.train_size=64",
            "data.val_size=8",
            "loop.global_batch_size=4",
            "loop.max_steps=1",
            "logging.trackers=[jsonl]",
            # The FLOPs count runs the 1B model's shapes forward and backward on the meta device
            # (tests/unit/test_flops.py: the GPT counts there, never on a CPU copy), about 2
            # CPU-seconds per rank for a figure not checked here.
            "logging.flops=false",
        ],
        cwd=tmp_path,
        nproc=4,
        script=WORKER,
        timeout=540,
    )
    assert launch.returncode == 0, launch.output[-6000:]
    record = json.loads((tmp_path / "memory.json").read_text())
    full = record["full_fp32_bytes"]
    assert record["num_parameters"] == 1_041_387_520  # configs/model/gpt_1b.yaml
    ranks = record["ranks"]
    assert len(ranks) == 4
    # Every rank holds its quarter of the parameters, initialised (finite, not left empty).
    assert sum(r["param_bytes"] for r in ranks) == full
    assert all(r["finite"] for r in ranks)
    for rank in ranks:
        assert rank["peak_rss_bytes"] < full / 2, (rank, full)
