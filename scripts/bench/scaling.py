"""Weak scaling of a recipe over processes on one machine: throughput, speedup, efficiency.

What it measures
    The recipe (default ``quickstart``) trained through the real CLI at 1, 2, ... ``--max-procs``
    processes with the per-rank batch fixed (weak scaling: ``loop.micro_batch_size`` stays, the
    global batch is N x micro-batch). Throughput is the run's ``summary/samples_per_s`` from its
    metrics.jsonl (samples over time spent inside training steps, all ranks; evaluation and
    checkpointing excluded). speedup(N) = throughput(N) / throughput(1); ideal = N;
    efficiency = speedup / N. Below 1 the extra processes lose time to gradient all-reduce,
    stragglers, and on a CPU machine to sharing cores, caches and memory bandwidth.

How
    Every point is one ``python -m torch.distributed.run --standalone --nproc_per_node=N -m
    sdnet_trainer +recipe=NAME`` launch (the 1-process point too, so all points carry the same
    DDP machinery) with ``OMP_NUM_THREADS=1``, ``loop.max_steps=--steps``, no evaluation, no
    checkpoint, ``loop.micro_batch_size=--micro-batch`` and ``loop.global_batch_size=N x micro``
    with ``loop.grad_accum_steps=1`` (sdnet_trainer.distributed.batching.batch_layout's rule for a
    fixed micro-batch without elastic). ``--override`` passes more Hydra overrides to every run.

Outputs (under ``--out``): scaling.csv (procs, samples_per_s, speedup, ideal, efficiency),
scaling.png (speedup against the ideal line; needs matplotlib: ``pip install
'sdnet_trainer[plots]'``), and each run's directory procs{N}/ with its log.

Run (from the repository root)
    python scripts/bench/scaling.py                       # quickstart, 1..os.cpu_count() processes
    python scripts/bench/scaling.py --max-procs 2 --steps 100 --out /tmp/scaling
    python scripts/bench/scaling.py --recipe resnet18_cifar10 --override data=synthetic

Exit status 0 with the table printed; 1 if a launch fails or times out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import REPO, LaunchError, timed_launch  # noqa: E402  (the same launch and load accounting)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--recipe", default="quickstart", help="recipe name (recipes/NAME.yaml)")
    p.add_argument(
        "--max-procs",
        type=int,
        default=os.cpu_count() or 1,
        help="largest process count (default os.cpu_count())",
    )
    p.add_argument("--steps", type=int, default=100, help="training steps per run (default 100)")
    p.add_argument(
        "--micro-batch", type=int, default=32, help="per-rank batch, kept fixed (default 32)"
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra override for every run (repeatable)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="output directory (default: a new temp dir)"
    )
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per launch before it is killed"
    )
    args = p.parse_args()
    if args.max_procs < 1 or args.steps < 1 or args.micro_batch < 1:
        p.error("--max-procs, --steps and --micro-batch must be positive")
    return args


def command(args: argparse.Namespace, procs: int, run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={procs}",
        "-m",
        "sdnet_trainer",
        f"+recipe={args.recipe}",
        f"loop.max_steps={args.steps}",
        "loop.max_epochs=null",
        f"loop.micro_batch_size={args.micro_batch}",
        f"loop.global_batch_size={procs * args.micro_batch}",
        "loop.grad_accum_steps=1",
        "loop.eval_at_end=false",
        "loop.eval_every_n_steps=null",
        "loop.eval_at_epoch_end=false",
        "checkpoint.save_on_exit=false",
        "checkpoint.resume=none",
        "logging.progress_bar=off",
        *args.override,
        f"hydra.run.dir={run_dir}",
    ]


def throughput(run_dir: Path) -> float:
    """``summary/samples_per_s`` from the run's metrics.jsonl (written once, at the end)."""
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    values = [row["summary/samples_per_s"] for row in rows if "summary/samples_per_s" in row]
    if not values:
        raise LaunchError(f"{run_dir}/metrics.jsonl has no summary/samples_per_s")
    return values[-1]


def table(rows: list[dict]) -> str:
    lines = [f"{'procs':>5}{'samples/s':>12}{'speedup':>9}{'ideal':>7}{'efficiency':>12}"]
    for r in rows:
        lines.append(
            f"{r['procs']:>5}{r['samples_per_s']:>12.1f}{r['speedup']:>9.3f}{r['ideal']:>7}"
            f"{r['efficiency']:>12.3f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """speedup against the ideal line; False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    procs = [r["procs"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot(procs, procs, "--", color="grey", label="ideal")
    ax.plot(procs, [r["speedup"] for r in rows], "o-", label="measured")
    for r in rows:
        ax.annotate(
            f"{r['efficiency']:.0%}",
            (r["procs"], r["speedup"]),
            textcoords="offset points",
            xytext=(4, -12),
        )
    ax.set_xlabel("processes")
    ax.set_ylabel("speedup (samples/s over 1 process)")
    ax.set_xticks(procs)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> int:
    args = parse_args()
    out = (args.out or Path(tempfile.mkdtemp(prefix="scaling_"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"scaling: +recipe={args.recipe}, 1..{args.max_procs} processes, {args.steps} steps, "
        f"{args.micro_batch} samples per rank per step; output in {out}",
        flush=True,
    )
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
    )
    rows: list[dict] = []
    for procs in range(1, args.max_procs + 1):
        run_dir = out / f"procs{procs}"
        try:
            seconds, other = timed_launch(
                command(args, procs, run_dir), out / f"procs{procs}.log", args.timeout
            )
            rate = throughput(run_dir)
        except LaunchError as err:
            print(f"scaling: launch failed: {err}", file=sys.stderr)
            return 1
        base = rows[0]["samples_per_s"] if rows else rate
        rows.append(
            {
                "procs": procs,
                "samples_per_s": rate,
                "speedup": rate / base,
                "ideal": procs,
                "efficiency": rate / base / procs,
            }
        )
        load = f", other processes used {other:.2f} cores" if other is not None else ""
        print(
            f"  {procs} process(es): {rate:.1f} samples/s ({seconds:.0f} s launch{load})",
            flush=True,
        )

    with open(out / "scaling.csv", "w", newline="") as f:
        writer = csv.DictWriter(
            f, fieldnames=["procs", "samples_per_s", "speedup", "ideal", "efficiency"]
        )
        writer.writeheader()
        writer.writerows(rows)
    print()
    print(table(rows))
    print(f"\n{out / 'scaling.csv'}")
    if plot(rows, out / "scaling.png", f"{args.recipe}: weak scaling, {args.micro_batch} per rank"):
        print(out / "scaling.png")
    else:
        print("(no plot: matplotlib is not installed; pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
