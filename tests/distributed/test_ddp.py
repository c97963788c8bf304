"""DDP under torchrun with gloo on CPU, compared against a single-process reference.

Every run here goes through the real CLI; RecordingTrainer (tests/support.py) saves the final
parameters, the per-step global losses and the number of gradient all-reduce calls per step.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import FINAL_STATE, TINY, read_jsonl, run_cli

TARGET = "trainer._target_=tests.support.RecordingTrainer"
COMMON = TINY + [TARGET, "loop.max_steps=6", "loop.global_batch_size=32"]


def _run(tmp_path, name, overrides, nproc=None) -> dict:
    run_dir = tmp_path / name
    launch = run_cli(COMMON + overrides + [f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=nproc)
    assert launch.returncode == 0, launch.output
    return torch.load(run_dir / FINAL_STATE, weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process, no process group, the whole global batch per step."""
    return _run(tmp_path_factory.mktemp("ref"), "single", [])


def _assert_same_training(run: dict, reference: dict) -> None:
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4, abs=1e-6)
    for name, value in reference["params"].items():
        torch.testing.assert_close(run["params"][name], value, rtol=1e-4, atol=1e-6)


def test_ddp_two_processes_match_one_process_on_the_concatenated_batch(tmp_path, reference):
    run = _run(tmp_path, "ddp2", [], nproc=2)
    _assert_same_training(run, reference)
    # Every step all-reduced the gradients (the tiny model fits one DDP bucket).
    assert run["allreduce_calls"] == [1] * 6
    # Evaluation over ranks (101 val samples: uneven shards) equals the single process's.
    for key in ("val/loss", "val/top1", "val/top5"):
        assert run["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-4)


# What one non-log step may cost beyond forward, backward and DDP's gradient all-reduce, counted
# over train_step and every hook (tests.support.StepCosts): (Python-level collectives, host
# synchronisations). One process: no collective; the step's one host read is the previous step's
# agreed verdict (non-finite, stop, timed save: read one step late under the default
# health.nonfinite=abort). Two processes: the verdict's small all-reduce, started asynchronously.
NON_LOG_STEP_COSTS = {1: (0, 1), 2: (1, 1)}


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_non_log_step_adds_no_collective_or_host_sync(tmp_path, reference, nproc):
    """A guard on the per-step cost: a change that adds a collective or a host synchronisation
    to the steps between log points fails here (TINY logs every 2 steps: steps 1, 3, 5 are
    non-log steps; log steps gather metrics and are not bounded)."""
    run = reference if nproc == 1 else _run(tmp_path, "ddp2_costs", [], nproc=2)
    non_log = {step: (c, h) for step, c, h in run["step_costs"] if step % 2}
    assert sorted(non_log) == [1, 3, 5]
    collectives, reads = NON_LOG_STEP_COSTS[nproc]
    # Step 1 has no earlier verdict to read.
    assert non_log == {1: (collectives, 0), 3: (collectives, reads), 5: (collectives, reads)}, run[
        "step_costs"
    ]


def test_weight_average_under_ddp_matches_one_process_and_costs_no_sync(tmp_path):
    """model.ema under DDP: the same average and val_ema/* as one process, and its per-step
    update adds no collective and no host synchronisation."""
    ema = ["model.ema.enabled=true", "model.ema.decay=0.5"]
    single, ddp = _run(tmp_path, "ema1", ema), _run(tmp_path, "ema2", ema, nproc=2)
    assert single["ema"].keys() == ddp["ema"].keys() and single["ema"]
    for name, value in single["ema"].items():
        torch.testing.assert_close(ddp["ema"][name], value, rtol=1e-4, atol=1e-6, msg=name)
        if value.is_floating_point() and "running" not in name:
            assert not torch.equal(value, single["params"][name]), name
    for key in ("val_ema/loss", "val_ema/top1"):
        assert ddp["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-4)
    collectives, reads = NON_LOG_STEP_COSTS[2]
    non_log = {step: (c, h) for step, c, h in ddp["step_costs"] if step % 2}
    assert non_log == {1: (collectives, 0), 3: (collectives, reads), 5: (collectives, reads)}


def test_accumulation_under_ddp_matches_and_syncs_only_on_the_last_micro_step(tmp_path, reference):
    run = _run(tmp_path, "ddp2_accum2", ["loop.grad_accum_steps=2"], nproc=2)
    _assert_same_training(run, reference)
    # no_sync on the first micro-step: still one all-reduce per optimizer step, not two.
    assert run["allreduce_calls"] == [1] * 6


def test_ddp_buckets_follow_bucket_cap_mb(tmp_path, reference):
    # A tiny bucket cap splits the gradients over several buckets; training is unchanged.
    run = _run(tmp_path, "ddp2_buckets", ["parallel.ddp.bucket_cap_mb=0.05"], nproc=2)
    _assert_same_training(run, reference)
    # DDP rebuilds its buckets in gradient-ready order after the first step.
    assert min(run["allreduce_calls"][1:]) > 1


def test_compiled_model_under_ddp_matches_eager(tmp_path, reference):
    # aot_eager: dynamo and AOTAutograd without C++ code generation, so the test needs no compiler
    # and stays fast; DDP then wraps the compiled module.
    run = _run(tmp_path, "ddp2_compiled", ["compile=on", "compile.backend=aot_eager"], nproc=2)
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("hook, bytes_per_param", [("none", 4), ("fp16", 2), ("bf16", 2)])
def test_comm_hooks_through_the_trainer(tmp_path, reference, hook, bytes_per_param):
    """comm.hook from the command line: the Trainer registers it on its DDP model, trains as the
    uncompressed single process does within 16-bit rounding, and logs the bytes it sends."""
    run_dir = tmp_path / hook
    launch = run_cli(
        TINY
        + [
            "loop.max_steps=6",
            "loop.global_batch_size=32",
            f"comm.hook={hook}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        nproc=2,
    )
    assert launch.returncode == 0, launch.output
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    # TINY logs every 2 steps: each row is the mean of two steps' losses.
    expected = [sum(reference["losses"][i : i + 2]) / 2 for i in (0, 2, 4)]
    assert [r["train/loss"] for r in rows] == pytest.approx(
        expected, rel=1e-2 if hook != "none" else 1e-4
    )
    params = sum(v.numel() for v in reference["params"].values())
    assert rows[-1]["comm/bytes_per_step"] == params * bytes_per_param
