"""Gradient communication options side by side: bytes sent, step time, and loss.

What it measures
    For each ``comm.hook`` option on the same workload and world size: the bytes each rank hands
    to the collectives per optimizer step (``comm/bytes_per_step`` at the last step, i.e. in the
    steady state; the payload, not wire traffic: see ``GradientComm.bytes_per_step``), the median
    step time (``perf/step_s``, max over ranks), and the training loss of the last 5 steps (mean
    over ranks), with ratios against ``none``. (No held-out loss: ResNet's BatchNorm running
    statistics mean little after a few dozen steps.)

    Options: none, fp16, bf16, powersgd rank 1, powersgd rank 4, local_sgd period 4. PowerSGD
    starts after ``--steps // 4`` plain steps: torch advises about a tenth of a whole training
    run, and compressing from the first few steps of a fresh network is exactly what it warns
    against (rank 1 with error feedback then diverges on this workload). Local SGD starts at
    step 0, so every one of its steps is local; the rest is the schema's defaults.

How
    Each option is one run of the real command line, ``python -m torch.distributed.run
    --standalone --nproc_per_node=N -m sdnet_trainer ... comm.hook=...`` (gloo, CPU,
    ``OMP_NUM_THREADS=1``), the Trainer wiring ``comm.*`` itself, with a metrics.jsonl row after
    every step (``logging.log_every_n_steps=1``) and no evaluation, checkpoint or TensorBoard.
    Steps before the hooks' steady state (PowerSGD's plain steps, and at least 5) are left out
    of the median. The runs follow one another, so a change in what else the machine does
    between runs shows in their step times: each run's line gives how many cores other processes
    used meanwhile.

    Default workload: torchvision ResNet-18 with the CIFAR stem (``model=resnet18_cifar``, 11.2M
    parameters, 45 MB of fp32 gradients per step) on 32x32 synthetic images, 16 per rank, SGD
    (lr 0.05, momentum 0.9, weight decay 5e-4) at a constant rate: big enough that gradient
    traffic is a visible share of a step even on CPU loopback. ``--recipe NAME`` replaces it with
    ``+recipe=NAME`` (with the recipe's own global batch unless --batch-size is given); config
    overrides after ``--`` replace or add keys, e.g. ``-- model=simple_cnn`` (the quickstart
    model, 95k parameters: runs in seconds, but its communication is lost in the noise). The
    ``comm.*`` keys are set here.

Run (from the repository root; about 3 minutes on 2 CPU cores with the defaults)
    python scripts/bench/bench_comm.py
    python scripts/bench/bench_comm.py --steps 40 --batch-size 8 --nproc 2 --out /tmp/bench_comm
    python scripts/bench/bench_comm.py --recipe quickstart --steps 40

Exit status 0 with the table printed; 1 if a run fails or times out (the other options still
run, and the table shows which failed).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _launch import (
    LaunchError,
    timed_launch,
    torchrun,
)  # scripts/ is on sys.path when run as a script

MIN_WARMUP_STEPS = 5
LAST_STEPS = 5  # the training loss is averaged over this many final steps
PER_RANK_BATCH = 16

# The default workload: config groups, then the keys that differ from their defaults.
WORKLOAD = [
    "model=resnet18_cifar",
    "data=synthetic",
    "optim=sgd",
    "sched=constant",
    "precision=fp32",
    "parallel=ddp",
    "optim.lr=0.05",
    "optim.momentum=0.9",
    "optim.weight_decay=5e-4",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per option (default 24)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"per rank (default {PER_RANK_BATCH}; with --recipe, the recipe's global batch)",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument(
        "--recipe", default=None, help="run +recipe=NAME instead of the default workload"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="output directory (default: a new temp dir)"
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per run before it is killed"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, after --; they replace the workload's keys",
    )
    args = p.parse_args()
    if args.steps < MIN_WARMUP_STEPS + LAST_STEPS:
        p.error(f"--steps must be at least {MIN_WARMUP_STEPS + LAST_STEPS}")
    if args.nproc < 2:
        p.error("--nproc must be at least 2: a single process has no gradient communication")
    if args.batch_size is not None and args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    for override in args.overrides:
        key = _key(override)
        if key == "comm" or key.startswith("comm.") or key.startswith("hydra."):
            p.error(f"{override}: the options set comm.* and the run directory themselves")
    return args


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def plain_steps(steps: int) -> int:
    """PowerSGD's plain all-reduce steps before compression starts."""
    return max(2, steps // 4)


def warmup_steps(steps: int) -> int:
    """Steps left out of the median: start-up, and PowerSGD's uncompressed steps."""
    return max(MIN_WARMUP_STEPS, plain_steps(steps))


def options(steps: int) -> dict[str, list[str]]:
    """name -> its comm.* overrides, in table order."""
    start = plain_steps(steps)
    powersgd = ["comm.hook=powersgd", f"comm.powersgd.start_iter={start}"]
    return {
        "none": ["comm.hook=none"],
        "fp16": ["comm.hook=fp16"],
        "bf16": ["comm.hook=bf16"],
        "powersgd r1": powersgd + ["comm.powersgd.rank=1"],
        "powersgd r4": powersgd + ["comm.powersgd.rank=4"],
        "local_sgd p4": [
            "comm.hook=local_sgd",
            "comm.local_sgd.period=4",
            "comm.local_sgd.start_step=0",
        ],
    }


def workload(args: argparse.Namespace) -> list[str]:
    """The workload and the run's length and batch, the user's overrides in place of keys they
    name."""
    base = [f"+recipe={args.recipe}"] if args.recipe else list(WORKLOAD)
    batch = args.batch_size or (None if args.recipe else PER_RANK_BATCH)
    run = [
        f"loop.max_steps={args.steps}",
        "loop.max_epochs=null",
        "loop.grad_accum_steps=1",
        "loop.micro_batch_size=null",
    ]
    if batch is not None:
        run.append(f"loop.global_batch_size={batch * args.nproc}")
    # Training only, a metrics row every step; nothing saved or resumed (--out may be reused).
    run += [
        "loop.eval_at_end=false",
        "loop.eval_at_epoch_end=false",
        "loop.eval_every_n_steps=null",
        "logging.log_every_n_steps=1",
        "logging.trackers=[jsonl]",
        "logging.progress_bar=off",
        "checkpoint.every_n_steps=null",
        "checkpoint.every_n_minutes=null",
        "checkpoint.resume=none",
        "checkpoint.save_on_exit=false",
    ]
    merged = {_key(o): o for o in base + run}
    merged.update(
        {_key(o): o for o in args.overrides}
    )  # later overrides of a key would be ambiguous
    return list(merged.values())


def command(args: argparse.Namespace, comm: list[str], run_dir: Path) -> list[str]:
    return torchrun(
        args.nproc, "-m", "sdnet_trainer", *workload(args), *comm, f"hydra.run.dir={run_dir}"
    )


def check_comm(run_dir: Path, comm: list[str]) -> None:
    """The resolved config must hold the option's comm.* keys."""
    from omegaconf import OmegaConf  # the Trainer's own dependency

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    for override in comm:
        key, value = override.split("=", 1)
        if str(OmegaConf.select(cfg, key)) != value:
            raise LaunchError(
                f"{run_dir}: the run resolved {key}={OmegaConf.select(cfg, key)}, not {value}"
            )


def read_run(run_dir: Path, steps: int) -> dict:
    """The option's figures from the run's metrics.jsonl (rank 0 writes it, every rank's
    numbers)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = sorted((r for r in rows if "perf/step_s" in r), key=lambda r: r["step"])
    if [r["step"] for r in train] != list(range(1, steps + 1)):
        raise LaunchError(
            f"{path}: expected a training row for each of steps 1-{steps}, "
            f"got steps {[r['step'] for r in train]}"
        )
    if "comm/bytes_per_step" not in train[-1]:
        raise LaunchError(
            f"{path}: no comm/bytes_per_step at step {steps}: the Trainer built no GradientComm"
        )
    skip = warmup_steps(steps)
    result = {
        "bytes_per_step": train[-1]["comm/bytes_per_step"],
        "step_s": [r["perf/step_s"] for r in train],
        "median_step_s": statistics.median(r["perf/step_s"] for r in train[skip:]),
        "train_loss": statistics.mean(r["train/loss"] for r in train[-LAST_STEPS:]),
        "first_loss": train[0]["train/loss"],
    }
    summary = [r["summary/samples_per_s"] for r in rows if "summary/samples_per_s" in r]
    if summary:
        result["samples_per_s"] = summary[-1]
    return result


def describe(run_dir: Path, nproc: int) -> str:
    """Model, parameters and batch of a run, from its log and resolved config."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    found = re.search(
        r"model (\S+): ([\d.]+)M parameters", (run_dir / "train.log").read_text(errors="replace")
    )
    model = f"{found[1]}, {found[2]}M parameters" if found else str(cfg.model.name)
    stem = ", CIFAR stem" if OmegaConf.select(cfg, "model.cifar_stem") else ""
    return (
        f"{model}{stem}, {cfg.data.name} data, {nproc} ranks x "
        f"{cfg.loop.global_batch_size // nproc} samples"
    )


def print_table(results: dict[str, dict | str], args: argparse.Namespace, header: str) -> None:
    skip = warmup_steps(args.steps)
    base = results.get("none")
    base = base if isinstance(base, dict) else None
    print(
        f"\n{header}, {args.steps} steps "
        f"(median over steps {skip + 1}-{args.steps}, max over ranks)\n"
    )
    print(
        f"{'hook':<14}{'MB/step':>9}{'x none':>8}{'median s':>10}{'x none':>8}"
        f"{'loss':>8}{'x none':>8}"
    )

    def ratio(run: dict, key: str, width: int, fmt: str) -> str:
        if not base:
            return f"{'-':>{width}}"
        return f"{run[key] / base[key]:>{width}{fmt}}"

    for name, run in results.items():
        if not isinstance(run, dict):
            print(f"{name:<14}  failed: {run}")
            continue
        print(
            f"{name:<14}{run['bytes_per_step'] / 1e6:>9.2f}{ratio(run, 'bytes_per_step', 8, '.3f')}"
            f"{run['median_step_s']:>10.3f}{ratio(run, 'median_step_s', 8, '.3f')}"
            f"{run['train_loss']:>8.3f}{ratio(run, 'train_loss', 8, '.2f')}"
        )
    first = f" (first step: {base['first_loss']:.3f})" if base else ""
    print(
        f"\nMB/step: payload handed to all_reduce per rank per step at the last step, the steady "
        f"state (local SGD: one parameter average per 4 steps, amortised). loss: training loss of "
        f"the last {LAST_STEPS} steps, mean over ranks{first}. PowerSGD compresses from step "
        f"{plain_steps(args.steps) + 1}."
    )


def main() -> int:
    args = parse_args()
    out = (args.out or Path(tempfile.mkdtemp(prefix="bench_comm_"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    opts = options(args.steps)
    print(
        f"bench_comm: {len(opts)} options, one run each, {args.steps} steps, "
        f"{args.nproc} processes; output in {out}",
        flush=True,
    )
    print(f"workload: {' '.join(workload(args))}", flush=True)
    started = time.perf_counter()
    results: dict[str, dict | str] = {}
    commands: dict[str, list[str]] = {}
    header = None
    for name, comm in opts.items():
        stem = name.replace(" ", "_")
        run_dir = out / stem
        shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl is appended to: start empty
        cmd = commands[name] = command(args, comm, run_dir)
        try:
            seconds, other = timed_launch(cmd, out / f"{stem}.log", args.timeout)
            check_comm(run_dir, comm)
            results[name] = read_run(run_dir, args.steps)
        except LaunchError as err:
            print(f"bench_comm: {name} failed: {err}", file=sys.stderr, flush=True)
            results[name] = f"see {out / f'{stem}.log'}"
            continue
        header = header or describe(run_dir, args.nproc)
        load = f", other processes used {other:.2f} cores meanwhile" if other is not None else ""
        print(f"  {name}: {seconds:.0f} s{load}", flush=True)
    (out / "bench_comm.json").write_text(
        json.dumps(
            {
                "nproc": args.nproc,
                "steps": args.steps,
                "warmup_steps": warmup_steps(args.steps),
                "commands": {n: shlex.join(c) for n, c in commands.items()},
                "options": results,
            },
            indent=1,
        )
    )
    print_table(results, args, header or f"{args.nproc} ranks")
    print("\nCommands (from the repository root, with OMP_NUM_THREADS=1):")
    for name, cmd in commands.items():
        print(f"  {name}: {shlex.join(cmd)}")
    print(f"({time.perf_counter() - started:.0f} s in all)")
    return 0 if all(isinstance(r, dict) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
