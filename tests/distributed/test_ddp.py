"""DDP with gloo on CPU, compared against a single-process reference.

The main two-process run and the single-process runs go through the CLI, forked ready-imported
(tests/forked.py: the command a user types, ``torchrun -m sdnet_trainer``, trains DDP in
tests/e2e/test_cli.py and under the signal and fault tests); every other two-process
configuration trains in one shared launch of tests/distributed/_ddp_worker.py (one process group,
one Trainer per case, composed from the same overrides as on the command line): starting a
process group costs more than training this tiny model. RecordingTrainer
(tests/support.py) saves the final parameters, the per-step global losses and the number of
gradient all-reduce calls per step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support import FINAL_STATE, REPO, TINY, read_jsonl, run_cli

TARGET = "trainer._target_=tests.support.RecordingTrainer"
COMMON = TINY + [TARGET, "loop.max_steps=6", "loop.global_batch_size=32"]
EMA = ["model.ema.enabled=true", "model.ema.decay=0.5"]
HOOKS = ("none", "fp16", "bf16")
WORKER = REPO / "tests" / "distributed" / "_ddp_worker.py"

# The two-process cases of the shared launch: name -> overrides. The comm-hook cases keep the
# default Trainer (RecordingTrainer counts all-reduces with a comm hook of its own, and DDP takes
# one hook per model). The compiled case comes last, so no case trains after dynamo has run.
CASES = {
    "ema": COMMON + EMA,
    "accum2": COMMON + ["loop.grad_accum_steps=2"],
    "buckets": COMMON + ["parallel.ddp.bucket_cap_mb=0.05"],
    **{
        f"hook_{hook}": TINY
        + ["loop.max_steps=6", "loop.global_batch_size=32", f"comm.hook={hook}"]
        for hook in HOOKS
    },
    "compiled": COMMON + ["compile=on", "compile.backend=aot_eager"],
}


def _run(tmp_path, name, overrides, nproc=None) -> dict:
    run_dir = tmp_path / name
    launch = run_cli(COMMON + overrides + [f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=nproc)
    assert launch.returncode == 0, launch.output
    return torch.load(run_dir / FINAL_STATE, weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process, no process group, the whole global batch per step."""
    return _run(tmp_path_factory.mktemp("ref"), "single", [])


@pytest.fixture(scope="module")
def ddp2(tmp_path_factory) -> dict:
    """Two processes through the CLI."""
    return _run(tmp_path_factory.mktemp("ddp2"), "ddp2", [], nproc=2)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> Path:
    """Every case of CASES trained in one two-process launch; each in ``<returned>/<name>/``."""
    out = tmp_path_factory.mktemp("ddp_cases")
    spec = out / "cases.json"
    spec.write_text(json.dumps(CASES))
    launch = run_cli([str(out / "runs"), str(spec)], cwd=out, nproc=2, script=WORKER, timeout=480)
    assert launch.returncode == 0, launch.output
    return out / "runs"


def _case(cases: Path, name: str) -> dict:
    return torch.load(cases / name / FINAL_STATE, weights_only=True)


def _assert_same_training(run: dict, reference: dict) -> None:
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4, abs=1e-6)
    for name, value in reference["params"].items():
        torch.testing.assert_close(run["params"][name], value, rtol=1e-4, atol=1e-6)


def test_ddp_two_processes_match_one_process_on_the_concatenated_batch(ddp2, reference):
    run = ddp2
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
def test_a_non_log_step_adds_no_collective_or_host_sync(reference, ddp2, nproc):
    """A guard on the per-step cost: a change that adds a collective or a host synchronisation
    to the steps between log points fails here (TINY logs every 2 steps: steps 1, 3, 5 are
    non-log steps; log steps gather metrics and are not bounded)."""
    run = reference if nproc == 1 else ddp2  # the first test's runs: the same config
    non_log = {step: (c, h) for step, c, h in run["step_costs"] if step % 2}
    assert sorted(non_log) == [1, 3, 5]
    collectives, reads = NON_LOG_STEP_COSTS[nproc]
    # Step 1 has no earlier verdict to read.
    assert non_log == {1: (collectives, 0), 3: (collectives, reads), 5: (collectives, reads)}, run[
        "step_costs"
    ]


def test_weight_average_under_ddp_matches_one_process_and_costs_no_sync(tmp_path, cases):
    """model.ema under DDP: the same average and val_ema/* as one process, and its per-step
    update adds no collective and no host synchronisation."""
    single, ddp = _run(tmp_path, "ema1", EMA), _case(cases, "ema")
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


def test_accumulation_under_ddp_matches_and_syncs_only_on_the_last_micro_step(cases, reference):
    run = _case(cases, "accum2")
    _assert_same_training(run, reference)
    # no_sync on the first micro-step: still one all-reduce per optimizer step, not two.
    assert run["allreduce_calls"] == [1] * 6


def test_ddp_buckets_follow_bucket_cap_mb(cases, reference):
    # A tiny bucket cap splits the gradients over several buckets; training is unchanged.
    run = _case(cases, "buckets")
    _assert_same_training(run, reference)
    # DDP rebuilds its buckets in gradient-ready order after the first step.
    assert min(run["allreduce_calls"][1:]) > 1


def test_compiled_model_under_ddp_matches_eager(cases, reference):
    # aot_eager: dynamo and AOTAutograd without C++ code generation, so the test needs no compiler
    # and stays fast; DDP then wraps the compiled module.
    run = _case(cases, "compiled")
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("hook, bytes_per_param", [("none", 4), ("fp16", 2), ("bf16", 2)])
def test_comm_hooks_through_the_trainer(cases, reference, hook, bytes_per_param):
    """comm.hook from the config overrides: the Trainer registers it on its DDP model, trains as
    the uncompressed single process does within 16-bit rounding, and logs the bytes it sends."""
    rows = [r for r in read_jsonl(cases / f"hook_{hook}" / "metrics.jsonl") if "train/loss" in r]
    # TINY logs every 2 steps: each row is the mean of two steps' losses.
    expected = [sum(reference["losses"][i : i + 2]) / 2 for i in (0, 2, 4)]
    assert [r["train/loss"] for r in rows] == pytest.approx(
        expected, rel=1e-2 if hook != "none" else 1e-4
    )
    params = sum(v.numel() for v in reference["params"].values())
    assert rows[-1]["comm/bytes_per_step"] == params * bytes_per_param
