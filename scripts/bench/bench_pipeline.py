"""Pipeline bubble of the GPipe and 1F1B schedules, measured against the theory.

What it measures
    For p pipeline stages and m micro-batches per step, both GPipe and 1F1B leave each stage idle
    for p - 1 slots of (t_f + t_b) per step, while it works m of them: the bubble fraction is
    (p - 1) / (m + p - 1). This script measures it on the project's own pipeline code
    (``split_model``, ``build_pipeline``, ``Pipeline.train_step``, which drive torch's schedules)
    for every --stages and --microbatches, and prints the measured bubble beside the theory.

How
    One ``python -m torch.distributed.run --standalone`` launch per p (gloo, CPU,
    ``OMP_NUM_THREADS=1``) of ``_pipeline_worker.py``, which runs every schedule and m in
    that process group. The model is an ``nn.Sequential`` of p identical stage layers, one per
    rank: a tiny Linear (parameters, and real activations and gradients sent between stages)
    followed by a layer whose forward sleeps t_f (--forward-ms) and whose backward sleeps
    t_b = 2 t_f per micro-batch.

    Sleeping stands in for device time on purpose: with 2 CPU cores, 4 ranks doing real arithmetic
    would take turns on the cores, and the measurement would show that contention, not the
    schedule. A sleeping stage is busy for exactly m (t_f + t_b) per step whatever else runs, so

        bubble = 1 - m (t_f + t_b) / step time

    with the step time from the first rank's start to the last rank's end (the median over
    --steps steps, after one warm-up step that also infers the stages' shapes). What this adds
    to the theory is everything but the stages' work: point-to-point sends, the schedule's
    Python, sleep overshoot and barrier skew. These come with every micro-batch, so the
    difference grows with m while the theory shrinks. On real devices the stages' times also
    vary, and each wait for the slowest stage widens the bubble further.

    torch's 1F1B refuses m < p (its warm-up needs a micro-batch per stage); those rows say so.

Run (from the repository root; about 2 minutes on 2 CPU cores with the defaults)
    python scripts/bench/bench_pipeline.py
    python scripts/bench/bench_pipeline.py --stages 2 4 --microbatches 1 2 4 8 16 --csv out.csv

Exit status 0 with the table printed; 1 if a launch fails or times out.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _launch import (
    REPO,
    LaunchError,
    run_launch,
    torchrun,
)  # scripts/ is on sys.path when run as a script

WORKER = REPO / "scripts" / "bench" / "_pipeline_worker.py"
SCHEDULE_ORDER = ("GPipe", "1F1B")  # as the worker runs them
COLUMNS = ("schedule", "p", "m", "step_ms", "ideal_busy_ms", "bubble", "theory", "difference")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--stages", type=int, nargs="+", default=[2, 4], help="pipeline depths p (default 2 4)"
    )
    p.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="micro-batches per step m (default 1 2 4 8)",
    )
    p.add_argument(
        "--forward-ms",
        type=float,
        default=20.0,
        help="t_f: forward time per micro-batch and stage; backward takes 2 t_f (default 20)",
    )
    p.add_argument(
        "--steps", type=int, default=5, help="timed steps per run, after a warm-up step (default 5)"
    )
    p.add_argument("--csv", type=Path, default=None, help="also write the table here")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per launch before it is killed"
    )
    args = p.parse_args()
    if min(args.stages) < 2 or min(args.microbatches) < 1 or args.steps < 1 or args.forward_ms <= 0:
        p.error("--stages must be >= 2, --microbatches and --steps >= 1, --forward-ms > 0")
    return args


def launch(pp: int, args: argparse.Namespace, out: Path) -> list[dict]:
    """One torchrun of the worker with ``pp`` ranks; the runs it timed."""
    out_json = out / f"pp{pp}.json"
    log_path = out / f"pp{pp}.log"
    # The stages sleep rather than compute, but the schedule's Python still needs a core now and
    # then: one thread per rank (run_launch) keeps the ranks from crowding each other out.
    run_launch(
        torchrun(
            pp,
            str(WORKER),
            "--microbatches",
            *map(str, args.microbatches),
            f"--forward-ms={args.forward_ms}",
            f"--steps={args.steps}",
            f"--out={out_json}",
        ),
        log_path,
        args.timeout,
    )
    return json.loads(out_json.read_text())


def theory(pp: int, m: int) -> float:
    return (pp - 1) / (m + pp - 1)


def row(run: dict) -> dict:
    """One table row; step figures are None where the schedule cannot run."""
    pp, m = run["pp"], run["microbatches"]
    # Each rank works m forwards and m backwards per step: m (t_f + 2 t_f).
    busy_ms = m * 3 * run["forward_ms"]
    out = {
        "schedule": run["schedule"],
        "p": pp,
        "m": m,
        "step_ms": None,
        "ideal_busy_ms": busy_ms,
        "bubble": None,
        "theory": theory(pp, m),
        "difference": None,
    }
    if "step_s" in run:
        step_ms = statistics.median(run["step_s"]) * 1000
        bubble = 1 - busy_ms / step_ms
        out.update(step_ms=step_ms, bubble=bubble, difference=bubble - out["theory"])
    return out


def print_table(rows: list[dict]) -> None:
    print(
        f"{'schedule':<9}{'p':>3}{'m':>4}{'step ms':>10}{'ideal busy ms':>15}"
        f"{'measured bubble':>17}{'theory':>9}{'difference':>12}"
    )
    for r in rows:
        if r["step_ms"] is None:
            print(
                f"{r['schedule']:<9}{r['p']:>3}{r['m']:>4}{'-':>10}{r['ideal_busy_ms']:>15.0f}{'-':>17}"
                f"{r['theory']:>9.3f}   n/a: torch's 1F1B needs m >= p"
            )
            continue
        print(
            f"{r['schedule']:<9}{r['p']:>3}{r['m']:>4}{r['step_ms']:>10.1f}{r['ideal_busy_ms']:>15.0f}"
            f"{r['bubble']:>17.3f}{r['theory']:>9.3f}{r['difference']:>+12.3f}"
        )


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        # Enough digits for the figures, not the float noise of the arithmetic.
        writer.writerows(
            {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows
        )


def main() -> int:
    args = parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    t_f = args.forward_ms
    print(
        f"bench_pipeline: GPipe and 1F1B, p in {args.stages}, m in {args.microbatches}; "
        f"stages sleep t_f = {t_f:g} ms forward and t_b = {2 * t_f:g} ms backward per "
        f"micro-batch; median of {args.steps} steps after a warm-up step; logs in {out}",
        flush=True,
    )
    print(
        "measured bubble = 1 - m (t_f + t_b) / step time: the schedule's bubble plus communication "
        "and scheduling overhead (sleeping stages leave out compute variance, which real devices "
        "add); theory = (p - 1) / (m + p - 1)",
        flush=True,
    )
    started = time.perf_counter()
    runs = []
    try:
        for pp in args.stages:
            launch_started = time.perf_counter()
            runs += launch(pp, args, out)
            print(f"  p = {pp}: {time.perf_counter() - launch_started:.0f} s", flush=True)
    except LaunchError as err:
        print(f"bench_pipeline: launch failed: {err}", file=sys.stderr)
        return 1
    # One block per schedule, deeper pipelines below shallower ones.
    rows = sorted(
        (row(run) for run in runs),
        key=lambda r: (SCHEDULE_ORDER.index(r["schedule"]), r["p"], r["m"]),
    )
    print()
    print_table(rows)
    if args.csv is not None:
        write_csv(rows, args.csv)
        print(f"(table written to {args.csv})")
    print(f"({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
