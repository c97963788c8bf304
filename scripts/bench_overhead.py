"""Per-step overhead of the Trainer against the hand-written DDP loop it replaces.

What it measures
    The median training-step time of ``sdnet_trainer`` (the CLI, ``+recipe=quickstart``) divided
    by the median step time of ``scripts/_handwritten_ddp.py``, a plain DDP loop a user would write
    by hand. Target: <= 1.02, i.e. the Trainer adds at most 2% per step.

How
    Both sides train the same model (torchvision ResNet-18 with the CIFAR stem, seeded with
    ``torch.manual_seed(0)``) on the same synthetic data (``SyntheticImages``, 2048 train samples,
    32x32) with the same per-rank batch (32), the same SGD (lr 0.05, momentum 0.9, weight decay
    5e-4, constant lr), fp32, no accumulation, no clipping, no evaluation. The Trainer keeps its
    logging defaults (a log point every 10 steps, TensorBoard and metrics.jsonl on): that is
    part of what is being measured.

    Step time is measured the same way on both sides: wall time from just before fetching the
    batch to just after ``zero_grad``, averaged over windows of 10 steps per rank, then the max
    over ranks (the Trainer's ``perf/step_s`` in metrics.jsonl; the hand-written script computes
    the same). The first ``--warmup-windows`` windows of every run are dropped.

    The two sides run alternately (trainer, hand-written, trainer, ...) ``--rounds`` times each,
    each run a fresh ``torchrun --standalone`` launch with ``OMP_NUM_THREADS=1``, so slow drift of
    the machine (other jobs, thermal) hits both sides alike. The ratio is taken between the
    medians of all remaining windows of each side.

Run (from the repository root; about 5 minutes on 2 CPU cores with the defaults)
    /work/venv/bin/python scripts/bench_overhead.py
    /work/venv/bin/python scripts/bench_overhead.py --steps 80 --rounds 5 --out /tmp/bench

Exit status: 0 whether the target is met or not (this is a measurement); 1 if a launch fails or
times out. Every launch's output is kept under ``--out`` (trainer_r*/, hand_r*.json, *.log).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HAND_SCRIPT = REPO / "scripts" / "_handwritten_ddp.py"
TARGET = 1.02

# One definition of the workload, handed to both sides explicitly so they cannot drift apart.
PER_RANK_BATCH = 32
SEED = 0
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 5e-4
LOG_EVERY = 10  # the Trainer's default logging.log_every_n_steps; also the window length


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating (default 3)")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (default 2)")
    p.add_argument("--warmup-windows", type=int, default=1,
                   help=f"windows of {LOG_EVERY} steps dropped at the start of every run (default 1)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: a new temp dir)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch before it is killed")
    args = p.parse_args()
    if args.steps <= args.warmup_windows * LOG_EVERY:
        p.error(f"--steps={args.steps} leaves no window after {args.warmup_windows} warm-up window(s)")
    return args


def torchrun(nproc: int) -> list[str]:
    # The torchrun of this interpreter's environment; `python -m torch.distributed.run` is the same.
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return launcher + ["--standalone", f"--nproc_per_node={nproc}"]


def trainer_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return torchrun(args.nproc) + [
        "-m", "sdnet_trainer", "+recipe=quickstart",
        # The workload, spelled out so it matches _handwritten_ddp.py whatever the recipe says.
        "model=resnet18_cifar", "data=synthetic", "data.train_size=2048", "data.synthetic_seed=1234",
        "precision=fp32", "optim=sgd", f"optim.lr={LR}", f"optim.momentum={MOMENTUM}",
        f"optim.weight_decay={WEIGHT_DECAY}", "optim.clip_grad_norm=null", "optim.clip_grad_value=null",
        "sched=constant",  # the hand-written loop has no schedule; the lr stays the same on both sides
        f"loop.seed={SEED}", f"loop.max_steps={args.steps}", "loop.grad_accum_steps=1",
        f"loop.global_batch_size={PER_RANK_BATCH * args.nproc}",
        # No evaluation anywhere in (or after) the timed steps.
        "loop.eval_at_end=false", "loop.eval_at_epoch_end=false", "loop.eval_every_n_steps=null",
        # Logging stays at its defaults (log_every_n_steps=10, tensorboard=true): only where it goes.
        f"hydra.run.dir={run_dir}",
    ]


def hand_command(args: argparse.Namespace, out_json: Path) -> list[str]:
    return torchrun(args.nproc) + [
        str(HAND_SCRIPT), f"--steps={args.steps}", f"--batch-size={PER_RANK_BATCH}", f"--lr={LR}",
        f"--momentum={MOMENTUM}", f"--weight-decay={WEIGHT_DECAY}", f"--seed={SEED}",
        f"--log-every={LOG_EVERY}", f"--out={out_json}",
    ]


def launch(cmd: list[str], log_path: Path, timeout: float) -> float:
    """Run one torchrun launch to completion; its output goes to ``log_path``. Returns seconds.

    torchrun starts its own worker processes, so the launch gets its own process group and a
    timeout kills that whole group, not just torchrun.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1")  # 2 processes on 2 cores: one thread each
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise LaunchError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n(see {log_path})")
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise LaunchError(f"exit code {rc}: {' '.join(cmd)}\n" + "\n".join(tail))
    return time.perf_counter() - started


class LaunchError(RuntimeError):
    pass


def trainer_windows(run_dir: Path) -> list[float]:
    """``perf/step_s`` of every log point in the run's metrics.jsonl, in step order."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [row["perf/step_s"] for row in sorted(rows, key=lambda r: r["step"]) if "perf/step_s" in row]


def hand_windows(out_json: Path) -> list[float]:
    return json.loads(out_json.read_text())["window_step_s"]


def main() -> int:
    args = parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_overhead_"))
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    expected_windows = -(-args.steps // LOG_EVERY)
    print(f"bench_overhead: {args.rounds} rounds x (trainer, hand-written), {args.steps} steps each, "
          f"{args.nproc} processes, per-rank batch {PER_RANK_BATCH}; "
          f"dropping {args.warmup_windows} warm-up window(s) of {LOG_EVERY} steps; output in {out}",
          flush=True)

    kept: dict[str, list[float]] = {"trainer": [], "hand-written": []}
    started = time.perf_counter()
    try:
        for rnd in range(args.rounds):
            # Alternate the sides so that whatever else the machine does is shared fairly.
            for side in ("trainer", "hand-written"):
                if side == "trainer":
                    run_dir = out / f"trainer_r{rnd}"
                    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl is opened for append
                    seconds = launch(trainer_command(args, run_dir), out / f"trainer_r{rnd}.log", args.timeout)
                    windows = trainer_windows(run_dir)
                else:
                    out_json = out / f"hand_r{rnd}.json"
                    out_json.unlink(missing_ok=True)
                    seconds = launch(hand_command(args, out_json), out / f"hand_r{rnd}.log", args.timeout)
                    windows = hand_windows(out_json)
                if len(windows) != expected_windows:
                    raise LaunchError(f"{side} round {rnd}: {len(windows)} windows, expected {expected_windows}")
                kept[side] += windows[args.warmup_windows:]
                shown = " ".join(f"{w:.3f}" for w in windows)
                print(f"  round {rnd + 1}/{args.rounds} {side:<12} {seconds:6.1f} s  window step s: {shown}",
                      flush=True)
    except LaunchError as err:
        print(f"bench_overhead: launch failed: {err}", file=sys.stderr)
        return 1

    print()
    print(f"{'side':<14}{'windows':>8}{'median s':>11}{'min s':>9}{'max s':>9}")
    for side, values in kept.items():
        print(f"{side:<14}{len(values):>8}{statistics.median(values):>11.4f}{min(values):>9.4f}"
              f"{max(values):>9.4f}")
    ratio = statistics.median(kept["trainer"]) / statistics.median(kept["hand-written"])
    print()
    print(f"overhead ratio (trainer / hand-written, median step time): {ratio:.3f}")
    print(f"target <= {TARGET}: {'PASS' if ratio <= TARGET else 'FAIL'}")
    print(f"({time.perf_counter() - started:.0f} s in all; logs and metrics in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
