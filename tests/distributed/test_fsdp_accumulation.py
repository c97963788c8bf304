"""FSDP2 with gradient accumulation on 2 ranks (gloo, CPU), against a single process.

By default FSDP reduce-scatters after every micro-step's backward: after the first micro-step each
rank already holds only its shard of every gradient. With ``parallel.fsdp.grad_sync=
last_microstep`` the reduction waits for the last micro-step (the shards' gradients are still
unset, FSDP holds full-size unsharded gradients meanwhile). Both train exactly as the single
process does: the same losses and the same final parameters.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import REPO, run_cli

WORKER = REPO / "tests" / "distributed" / "_fsdp_accum_worker.py"
RUN = [
    "dist.device=cpu",
    "model=gpt_tiny",
    "model.gpt.n_layers=2",
    "data=tokens",
    "data.train_size=128",
    "optim=sgd",
    "optim.lr=0.2",
    "optim.momentum=0.9",
    "sched=constant",
    "loop.max_steps=3",
    "loop.global_batch_size=16",
    "loop.grad_accum_steps=2",
    "loop.eval_at_end=false",
    "loop.eval_at_epoch_end=false",
    "logging.trackers=[jsonl]",
    "checkpoint.save_on_exit=false",
]
CASES = {
    "every_microstep": [*RUN, "parallel=fsdp"],  # the default: no grad_sync key given
    "last_microstep": [*RUN, "parallel=fsdp", "parallel.fsdp.grad_sync=last_microstep"],
}


class Runs:
    """Launched when first asked for: both two-process cases in one launch (one process group,
    one Trainer per case: starting a group costs more than training this model), the
    single-process reference in a process of its own."""

    def __init__(self, out):
        self.out, self.launches = out, {}

    def __getitem__(self, name: str) -> dict:
        launch_name = "single" if name == "single" else "fsdp"
        if launch_name not in self.launches:  # a failed launch is not retried
            single = launch_name == "single"
            cases = {"single": [*RUN, "parallel=ddp"]} if single else CASES
            spec = self.out / f"{launch_name}.json"
            spec.write_text(json.dumps(cases))
            self.launches[launch_name] = run_cli(
                [str(self.out / launch_name), str(spec)],
                cwd=self.out,
                nproc=None if single else 2,
                script=WORKER,
                timeout=400,
            )
        launch = self.launches[launch_name]
        assert launch.returncode == 0, launch.output
        return torch.load(self.out / launch_name / f"{name}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("fsdp_accum"))


@pytest.mark.timeout(900)
def test_default_reduce_scatters_every_microstep(results):
    readings = results["every_microstep"]["after_first_microstep"]
    assert len(readings) == 2  # ranks
    for rank_readings in readings:
        assert len(rank_readings) == 3  # one per step
        for reading in rank_readings:
            assert reading and all(held for held, _, _ in reading), reading
            # Sharded: each gradient is this rank's piece of dim 0, about half of it.
            assert all(local < full for _, local, full in reading), reading
            assert sum(local for _, local, _ in reading) < 0.6 * sum(f for *_, f in reading)


@pytest.mark.timeout(900)
def test_opt_in_defers_the_reduction_to_the_last_microstep(results):
    for rank_readings in results["last_microstep"]["after_first_microstep"]:
        assert len(rank_readings) == 3
        for reading in rank_readings:
            assert reading and not any(held for held, _, _ in reading), reading


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(CASES))
def test_both_train_as_the_single_process(results, case):
    single, sharded = results["single"], results[case]
    torch.testing.assert_close(sharded["losses"], single["losses"], rtol=1e-5, atol=1e-6)
    assert sharded["params"].keys() == single["params"].keys()
    for name, value in single["params"].items():
        torch.testing.assert_close(sharded["params"][name], value, rtol=1e-4, atol=1e-6, msg=name)
