"""The pipeline runs that ``bench_pipeline.py`` times: every schedule and micro-batch count
at one pipeline depth (the world size), in one process group.

Each rank holds one stage of an ``nn.Sequential`` of identical stage layers, split and driven by
the project's own pipeline code (``split_model``, ``build_pipeline``, ``Pipeline.train_step``).
A stage layer is a tiny Linear (so the stage has parameters and real tensors cross the stages)
followed by a layer that sleeps ``--forward-ms`` in forward and twice that in backward: the stage's
device time, with no CPU contention between ranks however many share the cores.

A step is timed from its earliest start to its latest end over all ranks (the ranks share one
machine, so their monotonic clocks agree), after a barrier; the first step of every run is a
warm-up (it also infers the stages' shapes) and is reported apart. Rank 0 writes every run's step
times to ``--out`` (JSON). Not meant to be run by hand, but it can be:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \
        scripts/bench/_pipeline_worker.py --microbatches 1 2 4 --out /tmp/pp2.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sdnet_trainer.config.schema import DistConfig, PipelineConfig
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.distributed.ops import all_gather_objects
from sdnet_trainer.distributed.pipeline import build_pipeline, split_model

SCHEDULES = ("GPipe", "1F1B")
WIDTH = 16  # features per sample: enough for real tensors, too few to cost measurable time
MICRO_BATCH = 4  # samples per micro-batch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument(
        "--forward-ms", type=float, default=20.0, help="forward time per micro-batch and stage"
    )
    p.add_argument(
        "--steps", type=int, default=5, help="timed steps per run, after one warm-up step"
    )
    p.add_argument("--out", type=Path, required=True, help="JSON file written by rank 0")
    return p.parse_args()


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take a fixed time without using the CPU."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepStage(nn.Module):
    """One pipeline stage's work: t_f per micro-batch forward, t_b = 2 t_f backward (the usual
    ratio: backward computes gradients for both the inputs and the weights)."""

    def __init__(self, forward_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.forward_s = forward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.linear(x), self.forward_s, 2 * self.forward_s)


def supported(schedule: str, pp: int, microbatches: int) -> bool:
    # torch's 1F1B refuses fewer micro-batches than stages (its warm-up needs one per stage).
    return not (schedule == "1F1B" and microbatches < pp)


def time_steps(
    schedule: str, microbatches: int, forward_s: float, steps: int, pp: int, rank: int
) -> list[float]:
    """Seconds of each step (warm-up first), the same list on every rank."""
    cfg = PipelineConfig(
        schedule=schedule, microbatches=microbatches, split_points=[str(i) for i in range(1, pp)]
    )
    torch.manual_seed(0)
    model = nn.Sequential(*[SleepStage(forward_s) for _ in range(pp)])
    ids, modules, num_stages = split_model(
        model, cfg, model_name="sleep_stages", pp_rank=rank, pp=pp
    )
    world = dist.group.WORLD
    assert world is not None  # distributed_session has initialized the default group
    pipeline = build_pipeline(
        list(modules),
        ids,
        num_stages,
        cfg,
        group=world,
        device=torch.device("cpu"),
        loss_fn=F.mse_loss,
    )
    inputs = torch.randn(microbatches * MICRO_BATCH, WIDTH)
    targets = torch.randn(microbatches * MICRO_BATCH, WIDTH)
    spans = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.monotonic()
        pipeline.train_step(inputs, targets)
        end = time.monotonic()
        model.zero_grad(set_to_none=True)
        # CLOCK_MONOTONIC is one clock for every process on the machine: the step runs from the
        # first rank's start (stage 0's first forward) to the last rank's end.
        marks = all_gather_objects((start, end))
        spans.append(max(e for _, e in marks) - min(s for s, _ in marks))
    return spans


def main() -> None:
    args = parse_args()
    with distributed_session(DistConfig()) as env:
        pp = env.world_size
        runs = []
        for schedule in SCHEDULES:
            for m in args.microbatches:
                run = {
                    "schedule": schedule,
                    "pp": pp,
                    "microbatches": m,
                    "forward_ms": args.forward_ms,
                }
                if supported(schedule, pp, m):
                    spans = time_steps(
                        schedule, m, args.forward_ms / 1000, args.steps, pp, env.rank
                    )
                    run.update(warmup_s=spans[0], step_s=spans[1:])
                runs.append(run)
                gc.collect()  # drop the run's stages before the next builds its own
        if env.is_main:
            args.out.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
