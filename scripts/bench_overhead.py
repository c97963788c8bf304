"""Per-step overhead of the Trainer against the hand-written DDP loop it replaces.

What it measures
    The median training-step time of ``sdnet_trainer`` (the CLI, ``torchrun -m sdnet_trainer``)
    divided by the median step time of ``scripts/_handwritten_ddp.py``, a plain DDP loop a user
    would write by hand. Target: <= 1.02, i.e. the Trainer adds at most 2% per step.

How
    Both sides train the same model (torchvision ResNet-18 with the CIFAR stem, seeded with
    ``torch.manual_seed(0)``) on the same synthetic data (``SyntheticImages``, 2048 train samples,
    32x32) with the same per-rank batch (32), the same SGD (lr 0.05, momentum 0.9, weight decay
    5e-4, constant lr), fp32, no accumulation, no clipping, no evaluation. The Trainer runs from
    the root config (no recipe: recipes are presets that change) with every key of that workload
    pinned on its command line and checked in its resolved config afterwards. It keeps its
    logging defaults (a log point every 10 steps, TensorBoard and metrics.jsonl on): that is
    part of what is being measured.

    Step time is measured the same way on both sides: wall time from just before fetching the
    batch to just after ``zero_grad``, averaged over windows of 10 steps per rank, then the max
    over ranks (the Trainer's ``perf/step_s`` in metrics.jsonl; the hand-written script computes
    the same). The first ``--warmup-windows`` windows of every run are dropped.

    The two sides run alternately (trainer, hand-written, trainer, ...) ``--rounds`` times each,
    each run a fresh ``torchrun --standalone`` launch with ``OMP_NUM_THREADS=1``, so slow drift of
    the machine (other jobs, thermal) hits both sides alike. The ratio is taken between the
    medians of all remaining windows of each side. Each launch also reports how many cores
    other processes used meanwhile: on a shared machine that contention, not the Trainer,
    dominates the spread, and the script warns when it was significant.

What the Trainer does beyond the hand-written loop (all of it is part of the measurement)
    At the time of writing, per step: ``model.train()``, a constant LambdaLR ``scheduler.step()``,
    the disabled GradScaler and autocast wrappers, the total gradient norm (health check,
    clipping, ``train/grad_norm``) and one small all-reduce on which all ranks agree whether to
    step. Its hooks (the log point's all-gather, TensorBoard and jsonl writes, the heartbeat line)
    run outside its step timer, like the hand-written script's single gather at the end.
    Checkpoints are off (no periodic save, no resume, no save at exit: not per-step work).

    Both sides run DDP with ``gradient_as_bucket_view=False`` (torch's default, and the
    Trainer's parallel.ddp default because of this benchmark): with True on the CPU the gradients
    live in persistent buckets, glibc malloc's dynamic mmap threshold stays low, and the large
    activation tensors are mmapped, page-faulted and unmapped again every step (5-12% slower
    here). ``--trainer-override parallel.ddp.gradient_as_bucket_view=true`` shows that cost.

Run (from the repository root; about 5 minutes on 2 CPU cores with the defaults)
    python scripts/bench_overhead.py
    python scripts/bench_overhead.py --steps 80 --rounds 5 --out /tmp/bench
    python scripts/bench_overhead.py \
        --trainer-override parallel.ddp.gradient_as_bucket_view=true

Exit status: 0 whether the target is met or not (this is a measurement); 1 if a launch fails or
times out. Every launch's output is kept under ``--out`` (trainer_r*/, hand_r*.json, *.log).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _launch import REPO, LaunchError, timed_launch  # scripts/ is on sys.path when run as a script

HAND_SCRIPT = REPO / "scripts" / "_handwritten_ddp.py"
TARGET = 1.02
# Other processes using more than this many cores on average during a launch make its step times
# unreliable (2 training processes on 2 cores leave nothing spare): warn about it.
BUSY_WARN_CORES = 0.2

# One definition of the workload, handed to both sides explicitly so they cannot drift apart.
PER_RANK_BATCH = 32
SEED = 0
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 5e-4
LOG_EVERY = 10  # the Trainer's default logging.log_every_n_steps; also the window length


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    p.add_argument(
        "--rounds", type=int, default=3, help="runs of each side, alternating (default 3)"
    )
    p.add_argument("--nproc", type=int, default=2, help="processes per run (default 2)")
    p.add_argument(
        "--warmup-windows",
        type=int,
        default=1,
        help=f"windows of {LOG_EVERY} steps dropped at the start of every run (default 1)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="output directory (default: a new temp dir)"
    )
    p.add_argument(
        "--trainer-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra override for the Trainer side (repeatable; not a pinned key), "
        "e.g. parallel.ddp.gradient_as_bucket_view=true",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds per launch before it is killed (default 600)",
    )
    args = p.parse_args()
    for override in args.trainer_override:
        if override.split("=", 1)[0].lstrip("+~") in trainer_keys(args):
            p.error(
                f"--trainer-override {override}: that key is pinned to match the hand-written loop"
            )
    if args.steps <= args.warmup_windows * LOG_EVERY:
        p.error(
            f"--steps={args.steps} leaves no window after {args.warmup_windows} warm-up window(s)"
        )
    return args


def torchrun(nproc: int) -> list[str]:
    # The torchrun of this interpreter's environment; `python -m torch.distributed.run` is the same.
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return launcher + ["--standalone", f"--nproc_per_node={nproc}"]


# The Trainer side: no recipe (recipes are presets that change; the root config's defaults
# plus these keys pin everything), each key checked again in the run's resolved config.
# Config groups first (they replace whole sections), then the keys that must match the
# hand-written loop.
TRAINER_GROUPS = [
    "model=resnet18_cifar",
    "data=synthetic",
    "optim=sgd",
    "sched=constant",
    "precision=fp32",
    "parallel=ddp",
]


def trainer_keys(args: argparse.Namespace) -> dict[str, object]:
    return {
        # ResNet-18, 3x3 stride-1 stem, no max-pool; weights from torch.manual_seed(loop.seed).
        "model.name": "resnet18",
        "model.cifar_stem": True,
        "model.num_classes": 10,
        "model.weights": None,
        "loop.seed": SEED,
        # SyntheticImages(2048, image_size=32, channels=3, num_classes=10, seed=1234, signal=1,
        # noise=1): the data=synthetic defaults, as _handwritten_ddp.py builds them.
        "data.name": "synthetic",
        "data.train_size": 2048,
        "data.image_size": 32,
        "data.channels": 3,
        "data.num_classes": 10,
        "data.synthetic_seed": 1234,
        "data.signal": 1.0,
        "data.noise": 1.0,
        "data.shuffle": True,
        "data.drop_last": True,
        "data.num_workers": 0,
        # Plain SGD at a constant lr (the hand-written loop has no schedule), fp32, plain CE loss.
        "optim.name": "SGD",
        "optim.lr": LR,
        "optim.momentum": MOMENTUM,
        "optim.weight_decay": WEIGHT_DECAY,
        "optim.nesterov": None,
        "optim.no_decay_norm_and_bias": False,
        "optim.clip_grad_norm": None,
        "optim.clip_grad_value": None,
        "sched.name": "constant",
        "sched.warmup_steps": 0,
        "precision.dtype": "fp32",
        "loss.label_smoothing": 0.0,
        "parallel.sync_batchnorm": False,
        "loop.max_steps": args.steps,
        "loop.grad_accum_steps": 1,
        "loop.global_batch_size": PER_RANK_BATCH * args.nproc,
        "loop.deterministic": False,
        # No evaluation anywhere in (or after) the timed steps.
        "loop.eval_at_end": False,
        "loop.eval_at_epoch_end": False,
        "loop.eval_every_n_steps": None,
        # Logging as by default (pinned so the windows match the hand-written side): a log point
        # every 10 steps, metrics.jsonl (which we read) and TensorBoard on.
        "logging.log_every_n_steps": LOG_EVERY,
        "logging.jsonl": True,
        "logging.tensorboard": True,
        # No checkpoint: none saved during the timed steps, none resumed from an earlier run in
        # the same --out, and none at exit (after the last step: disk and minutes, no step time).
        "checkpoint.every_n_steps": None,
        "checkpoint.every_n_minutes": None,
        "checkpoint.resume": "none",
        "checkpoint.save_on_exit": False,
    }


def _override_value(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def trainer_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    keys = [f"{k}={_override_value(v)}" for k, v in trainer_keys(args).items()]
    return (
        torchrun(args.nproc)
        + ["-m", "sdnet_trainer"]
        + TRAINER_GROUPS
        + keys
        + args.trainer_override
        + [f"hydra.run.dir={run_dir}"]
    )


def check_trainer_config(args: argparse.Namespace, run_dir: Path) -> None:
    """The resolved config the Trainer ran with must hold every pinned key (others edit the
    configs; a changed default must not silently change the workload)."""
    from omegaconf import OmegaConf  # the Trainer's own dependency

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    wrong = {
        k: OmegaConf.select(cfg, k)
        for k, v in trainer_keys(args).items()
        if OmegaConf.select(cfg, k) != v
    }
    if wrong:
        raise LaunchError(f"the Trainer ran with a different workload than pinned: {wrong}")


def hand_command(args: argparse.Namespace, out_json: Path) -> list[str]:
    return torchrun(args.nproc) + [
        str(HAND_SCRIPT),
        f"--steps={args.steps}",
        f"--batch-size={PER_RANK_BATCH}",
        f"--lr={LR}",
        f"--momentum={MOMENTUM}",
        f"--weight-decay={WEIGHT_DECAY}",
        f"--seed={SEED}",
        f"--log-every={LOG_EVERY}",
        f"--out={out_json}",
    ]


def trainer_windows(run_dir: Path) -> list[float]:
    """``perf/step_s`` of every log point in the run's metrics.jsonl, in step order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = sorted((json.loads(line) for line in lines if line), key=lambda row: row["step"])
    # Only the training log points carry perf/step_s (not the end-of-run summary row).
    return [row["perf/step_s"] for row in rows if "perf/step_s" in row]


def hand_windows(out_json: Path) -> list[float]:
    return json.loads(out_json.read_text())["window_step_s"]


def run_once(
    side: str, rnd: int, args: argparse.Namespace, out: Path
) -> tuple[list[float], float, float | None]:
    """One launch of ``side``: (window step times, launch seconds, cores used by others)."""
    if side == "trainer":
        run_dir = out / f"trainer_r{rnd}"
        shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl is opened for append
        seconds, other = timed_launch(
            trainer_command(args, run_dir), out / f"trainer_r{rnd}.log", args.timeout
        )
        check_trainer_config(args, run_dir)
        windows = trainer_windows(run_dir)
    else:
        out_json = out / f"hand_r{rnd}.json"
        out_json.unlink(missing_ok=True)
        seconds, other = timed_launch(
            hand_command(args, out_json), out / f"hand_r{rnd}.log", args.timeout
        )
        windows = hand_windows(out_json)
    expected = -(-args.steps // LOG_EVERY)  # a window every LOG_EVERY steps, plus a partial last
    if len(windows) != expected:
        raise LaunchError(f"{side} round {rnd}: {len(windows)} windows, expected {expected}")
    return windows, seconds, other


def main() -> int:
    args = parse_args()
    out = (args.out or Path(tempfile.mkdtemp(prefix="bench_overhead_"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"bench_overhead: {args.rounds} rounds x (trainer, hand-written), {args.steps} steps each, "
        f"{args.nproc} processes, per-rank batch {PER_RANK_BATCH}; "
        f"dropping {args.warmup_windows} warm-up window(s) of {LOG_EVERY} steps; output in {out}",
        flush=True,
    )
    if args.trainer_override:
        print(f"trainer overrides: {' '.join(args.trainer_override)}", flush=True)

    kept: dict[str, list[float]] = {"trainer": [], "hand-written": []}
    other_load: list[float] = []
    started = time.perf_counter()
    try:
        for rnd in range(args.rounds):
            # Alternate the sides so that whatever else the machine does is shared fairly.
            for side in ("trainer", "hand-written"):
                windows, seconds, other = run_once(side, rnd, args, out)
                kept[side] += windows[args.warmup_windows :]
                shown = " ".join(f"{w:.3f}" for w in windows)
                load = ""
                if other is not None:
                    other_load.append(other)
                    load = f"  (other processes: {other:.2f} cores)"
                print(
                    f"  round {rnd + 1}/{args.rounds} {side:<12} {seconds:6.1f} s  window step s: "
                    f"{shown}{load}",
                    flush=True,
                )
    except LaunchError as err:
        print(f"bench_overhead: launch failed: {err}", file=sys.stderr)
        return 1

    print()
    print(f"{'side':<14}{'windows':>8}{'median s':>11}{'min s':>9}{'max s':>9}")
    for side, values in kept.items():
        print(
            f"{side:<14}{len(values):>8}{statistics.median(values):>11.4f}{min(values):>9.4f}"
            f"{max(values):>9.4f}"
        )
    ratio = statistics.median(kept["trainer"]) / statistics.median(kept["hand-written"])
    print()
    print(f"overhead ratio (trainer / hand-written, median step time): {ratio:.3f}")
    print(f"target <= {TARGET}: {'PASS' if ratio <= TARGET else 'FAIL'}")
    # The fastest windows are the least disturbed by anything else running: a cross-check.
    print(f"(ratio of the fastest windows: {min(kept['trainer']) / min(kept['hand-written']):.3f})")
    if other_load and max(other_load) > BUSY_WARN_CORES:
        print(
            f"warning: other processes used up to {max(other_load):.2f} cores during the launches; "
            f"step times then include their contention and the ratio is noisy. Rerun on an "
            f"otherwise idle machine, or with more --rounds."
        )
    print(f"({time.perf_counter() - started:.0f} s in all; logs and metrics in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
