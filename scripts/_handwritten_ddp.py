"""The hand-written DDP loop that ``scripts/bench_overhead.py`` compares the Trainer against.

This is the loop a user would write without the Trainer: gloo process group, ``DDP(model)``,
``DistributedSampler`` + ``DataLoader``, and forward / cross-entropy / backward / step / zero_grad.
It builds the same model (ResNet-18 with the CIFAR stem) and the same synthetic data as the
Trainer with ``model=resnet18_cifar data=synthetic`` (the data defaults), and times every step
the way the Trainer does: wall time from just before fetching the batch to just after
``zero_grad``.

Per-step times are reported per window of ``--log-every`` steps (a window also ends at the last
step), as the window's mean step time per rank and the max over ranks, like the Trainer's
``perf/step_s``. Rank 0 writes them to ``--out`` (JSON). Not meant to be run by hand, but it can be:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/_handwritten_ddp.py \
        --steps 40 --out /tmp/hand.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from sdnet_trainer.data import SyntheticImages


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--log-every", type=int, default=10, help="window length, as logging.log_every_n_steps"
    )
    p.add_argument("--out", type=Path, required=True, help="JSON file written by rank 0")
    return p.parse_args()


def build_model(seed: int) -> nn.Module:
    # Same construction order as sdnet_trainer.models.registry with model=resnet18_cifar, after the
    # same torch.manual_seed(loop.seed): identical initial weights on both sides.
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def window_means(times: list[float], log_every: int) -> list[float]:
    """Mean step time of each window; windows end at multiples of ``log_every`` and at the last
    step, exactly where the Trainer's MetricsHook flushes its StepMeter."""
    means, start = [], 0
    for step in range(1, len(times) + 1):
        if step % log_every == 0 or step == len(times):
            means.append(sum(times[start:step]) / (step - start))
            start = step
    return means


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = build_model(args.seed)
    ddp = DDP(model)
    opt = torch.optim.SGD(
        ddp.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )

    # The arguments sdnet_trainer.data.build_synthetic passes for the data=synthetic defaults.
    dataset = SyntheticImages(
        2048,
        image_size=32,
        channels=3,
        num_classes=10,
        seed=1234,
        signal=1.0,
        noise=1.0,
        split="train",
    )
    sampler: DistributedSampler[int] = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, num_workers=0, drop_last=True
    )

    def batches(
        loader: DataLoader[tuple[torch.Tensor, int]], sampler: DistributedSampler[int]
    ) -> Iterator[list[torch.Tensor]]:
        # Epoch after epoch, like the Trainer's batch generator; starting a new epoch (a new
        # loader iterator) happens inside the timed next() of the step that needs it, on both sides.
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    it = batches(loader, sampler)
    ddp.train()
    times: list[float] = []
    started_run = time.perf_counter()
    for _ in range(args.steps):
        started = time.perf_counter()
        inputs, targets = next(it)
        loss = F.cross_entropy(ddp(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    wall_s = time.perf_counter() - started_run

    # One collective after the loop (the Trainer gathers once per window, outside its step timer).
    # all_gather_object replaces every entry with that rank's list.
    per_rank: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(per_rank, times)
    if rank == 0:
        rank_windows = [window_means(t, args.log_every) for t in per_rank]
        result = {
            "side": "hand-written",
            "steps": args.steps,
            "world_size": world,
            "log_every": args.log_every,
            "window_step_s": [max(w) for w in zip(*rank_windows)],  # max over ranks
            "window_step_s_rank": rank_windows,
            "wall_s": wall_s,
            "final_loss": loss.item(),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    # DDP still alive when its group goes away can abort gloo at exit: drop it first.
    del ddp, model, opt, it, loader
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
