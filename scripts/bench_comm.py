"""Gradient communication options side by side: bytes sent, step time, and loss.

What it measures
    For each ``comm.hook`` option on the same model, data and world size: the bytes each rank
    hands to the collectives per optimizer step (``GradientComm.bytes_per_step``: the payload,
    not wire traffic; see its docstring), the median step time (max over ranks), and the loss
    after ``--steps`` steps (training loss of the last 10 steps, averaged over ranks), with
    ratios against ``none``. (No held-out loss: ResNet's BatchNorm running statistics mean
    little after a few dozen steps.)

    Variants: none, fp16, bf16, powersgd rank 1, powersgd rank 4, local_sgd period 4. PowerSGD
    starts after ``--steps // 4`` plain steps: torch advises about a tenth of a whole training
    run, and compressing from the first few steps of a fresh network is exactly what it warns
    against (rank 1 with error feedback then diverges on this workload); local SGD from step 0;
    the rest is the schema's defaults.

How
    One ``torchrun --standalone`` launch of this same file with ``--worker`` (gloo, CPU,
    ``OMP_NUM_THREADS=1``). Each worker builds every variant (model, DDP, GradientComm, SGD) from
    the same seed and interleaves their steps (variant 1 step 1, variant 2 step 1, ...), so
    whatever else the machine does while the benchmark runs hits all variants alike. Batches are
    made before timing starts; a step is forward, backward (with the hook's communication),
    ``optimizer.step``, ``after_optimizer_step`` and ``zero_grad``. Steps before the hooks'
    steady state (PowerSGD's plain steps, and at least 5) are left out of the median.

    Default workload: torchvision ResNet-18 with the CIFAR stem (11.2M parameters, 45 MB of fp32
    gradients per step) on 32x32 synthetic images, 16 per rank: big enough that gradient traffic
    is a visible share of a step even on CPU loopback. ``--model simple_cnn`` (the quickstart
    model, 95k parameters) runs in seconds but its communication is lost in the noise.

    This drives DDP + GradientComm directly. Once the Trainer builds GradientComm from
    ``comm.*``, each variant can instead be a CLI run (``torchrun -m sdnet_trainer
    model=resnet18_cifar comm.hook=powersgd comm.powersgd.rank=4 ...``) reading
    ``comm/bytes_per_step`` and ``perf/step_s`` from metrics.jsonl; the interleaving here is
    what a set of separate runs cannot do on a shared machine.

Run (from the repository root; about 5 minutes on 2 CPU cores with the defaults)
    python scripts/bench_comm.py
    python scripts/bench_comm.py --steps 60 --batch-size 8 --nproc 2 --out /tmp/bench_comm

Exit status 0 with the table printed; 1 if the launch fails or times out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEED = 0
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 5e-4
MIN_WARMUP_STEPS = 5
LAST_STEPS = 10  # the training loss is averaged over this many final steps


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per variant (default 40)")
    p.add_argument("--batch-size", type=int, default=16, help="per rank (default 16)")
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument("--model", choices=("resnet18_cifar", "simple_cnn"), default="resnet18_cifar")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: a new temp dir)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds before the launch is killed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < MIN_WARMUP_STEPS + LAST_STEPS:
        p.error(f"--steps must be at least {MIN_WARMUP_STEPS + LAST_STEPS}")
    return args


def variants(steps: int) -> dict:
    """name -> CommConfig, in table order."""
    from sdnet_trainer.config.schema import CommConfig, LocalSGDConfig, PowerSGDConfig

    start = plain_steps(steps)
    return {
        "none": CommConfig(hook="none"),
        "fp16": CommConfig(hook="fp16"),
        "bf16": CommConfig(hook="bf16"),
        "powersgd r1": CommConfig(hook="powersgd", powersgd=PowerSGDConfig(rank=1, start_iter=start)),
        "powersgd r4": CommConfig(hook="powersgd", powersgd=PowerSGDConfig(rank=4, start_iter=start)),
        "local_sgd p4": CommConfig(hook="local_sgd", local_sgd=LocalSGDConfig(period=4, start_step=0)),
    }


def plain_steps(steps: int) -> int:
    """PowerSGD's plain all-reduce steps before compression starts."""
    return max(2, steps // 4)


def warmup_steps(steps: int) -> int:
    """Steps left out of the median: start-up, and PowerSGD's uncompressed steps."""
    return max(MIN_WARMUP_STEPS, plain_steps(steps))


# ---------------------------------------------------------------------- the worker (under torchrun)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from sdnet_trainer.config.schema import ModelConfig
    from sdnet_trainer.data import SyntheticImages
    from sdnet_trainer.distributed.comm import GradientComm
    from sdnet_trainer.distributed.malloc import pin_malloc_thresholds
    from sdnet_trainer.models import build_model

    pin_malloc_thresholds()  # as the Trainer does on the CPU
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_cfg = (ModelConfig(name="resnet18", cifar_stem=True) if args.model == "resnet18_cifar"
                 else ModelConfig(name="simple_cnn"))

    # Every rank's batches for every step, made before any timing: rank r of step s gets samples
    # [(s * world + r) * batch, ...) of one dataset, so the ranks see different data.
    data = SyntheticImages(args.steps * world * args.batch_size, image_size=32, channels=3, num_classes=10,
                           seed=1234, split="train")

    def batch(step: int):
        first = (step * world + rank) * args.batch_size
        items = [data[i] for i in range(first, first + args.batch_size)]
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])

    batches = [batch(s) for s in range(args.steps)]

    runs = {}
    for name, cfg in variants(args.steps).items():
        torch.manual_seed(SEED)
        model = DistributedDataParallel(build_model(model_cfg))
        comm = GradientComm(model, cfg)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
        runs[name] = {"model": model, "comm": comm, "optimizer": optimizer, "times": [], "losses": []}

    for step in range(args.steps):
        inputs, targets = batches[step]
        for run in runs.values():  # interleaved: see the module docstring
            model, comm, optimizer = run["model"], run["comm"], run["optimizer"]
            started = time.perf_counter()
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            comm.after_optimizer_step(model.parameters())
            optimizer.zero_grad(set_to_none=True)
            run["times"].append(time.perf_counter() - started)
            run["losses"].append(loss.item())

    results = {}
    for name, run in runs.items():
        # Per-rank numbers, gathered: the step time is gated by the slowest rank.
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {"times": run["times"], "losses": run["losses"]})
        results[name] = {
            "bytes_per_step": run["comm"].bytes_per_step(),
            "step_s": [max(ts) for ts in zip(*(r["times"] for r in per_rank))],
            "train_loss": statistics.mean(l for r in per_rank for l in r["losses"][-LAST_STEPS:]),
            "first_loss": statistics.mean(r["losses"][0] for r in per_rank),
        }
    if rank == 0:
        params = sum(p.numel() for p in runs["none"]["model"].parameters())
        (args.out / "bench_comm.json").write_text(json.dumps(
            {"world_size": world, "model": args.model, "params": params, "batch_size": args.batch_size,
             "steps": args.steps, "variants": results}, indent=1))
    # DDP still alive when its group goes away can abort gloo at exit: drop it first.
    runs.clear()
    gc.collect()
    dist.destroy_process_group()


# ---------------------------------------------------------------------- the driver


def main() -> int:
    args = parse_args()
    out = (args.out or Path(tempfile.mkdtemp(prefix="bench_comm_"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = out
    if args.worker:
        worker(args)
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_overhead import LaunchError, launch, torchrun  # the same launch and load accounting

    cmd = torchrun(args.nproc) + [str(Path(__file__).resolve()), "--worker", f"--steps={args.steps}",
                                  f"--batch-size={args.batch_size}", f"--model={args.model}", f"--out={out}"]
    print(f"bench_comm: {len(variants(args.steps))} variants interleaved, {args.steps} steps each, "
          f"{args.nproc} processes, {args.model}, per-rank batch {args.batch_size}; output in {out}", flush=True)
    os.environ.setdefault("PYTHONPATH", str(REPO))
    try:
        seconds, other = launch(cmd, out / "bench_comm.log", args.timeout)
    except LaunchError as err:
        print(f"bench_comm: launch failed: {err}", file=sys.stderr)
        return 1
    print_table(json.loads((out / "bench_comm.json").read_text()), seconds, other)
    return 0


def print_table(result: dict, seconds: float, other: float | None) -> None:
    runs = result["variants"]
    skip = warmup_steps(result["steps"])
    base = runs["none"]
    base_s = statistics.median(base["step_s"][skip:])
    print(f"\n{result['model']}, {result['params'] / 1e6:.2f}M parameters, {result['world_size']} ranks x "
          f"{result['batch_size']} samples, {result['steps']} steps (median over steps {skip + 1}-"
          f"{result['steps']}, max over ranks)\n")
    print(f"{'hook':<14}{'MB/step':>9}{'x none':>8}{'median s':>10}{'x none':>8}{'loss':>8}{'x none':>8}")
    for name, run in runs.items():
        step_s = statistics.median(run["step_s"][skip:])
        mb = run["bytes_per_step"] / 1e6
        print(f"{name:<14}{mb:>9.2f}{run['bytes_per_step'] / base['bytes_per_step']:>8.3f}{step_s:>10.3f}"
              f"{step_s / base_s:>8.3f}{run['train_loss']:>8.3f}{run['train_loss'] / base['train_loss']:>8.2f}")
    print(f"\nMB/step: payload handed to all_reduce per rank per step, steady state (local SGD: one "
          f"parameter average per 4 steps, amortised). loss: training loss of the last {LAST_STEPS} steps, "
          f"mean over ranks (first step: {base['first_loss']:.3f}). PowerSGD compresses from step "
          f"{plain_steps(result['steps']) + 1}.")
    load = f"; other processes used {other:.2f} cores meanwhile" if other is not None else ""
    print(f"({seconds:.0f} s launch{load})")


if __name__ == "__main__":
    sys.exit(main())
