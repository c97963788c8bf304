"""Does parallel=auto rank layouts as they run? Estimated against measured step times.

What it measures
    For six layouts of the same workload on the same ranks: the step time the planner estimates
    (``sdnet_trainer.plan.estimate``, with this machine's constants from
    ``python -m sdnet_trainer.plan.calibrate`` run first, under the same launch) and the step
    time measured by the real command line (the median of ``global batch / perf/samples_per_s``
    over the log points after the first, each layout run ``--rounds`` times in alternating
    order, the median of the rounds). It prints both columns, their ranks, Spearman's rank
    correlation between them, and the estimate's error per layout.

    Layouts (4 ranks): DDP 4; FSDP 4; FSDP 4 with 4 accumulation steps; FSDP 2 x TP 2; TP 4;
    DDP 2 x 2 pipeline stages (1F1B, 4 micro-batches). Workload: ``model=gpt_small`` (3.3M
    parameters) on ``data=tokens``, AdamW, a global batch of 32 sequences of 128 tokens.

How
    Each launch is ``python -m torch.distributed.run --standalone --nproc_per_node=4 -m
    sdnet_trainer ...`` (gloo, CPU, ``OMP_NUM_THREADS=1``) with a metrics.jsonl row every 4
    steps and no evaluation or checkpoint; the calibration is ``-m sdnet_trainer.plan.calibrate``
    under the same launcher, so its compute figure is a rank's while the others compute too.
    Each line of the table gives the cores other processes used while that layout ran.

Run (from the repository root; about 6 minutes on 2 CPU cores)
    python scripts/bench/bench_plan.py
    python scripts/bench/bench_plan.py --steps 24 --rounds 3 --out /tmp/bench_plan

Exit status 0 with the table printed; 1 if a launch fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _launch import REPO, LaunchError, timed_launch, torchrun

sys.path.insert(0, str(REPO))


WORKLOAD = [
    "model=gpt_small",
    "data=tokens",
    "data.seq_len=128",
    "data.vocab_size=256",
    "optim=adamw",
    "loop.global_batch_size=32",
    "loop.eval_every_n_steps=null",
    "loop.eval_at_epoch_end=false",
    "checkpoint.save_on_exit=false",
    "logging.trackers=[jsonl]",
    "logging.log_every_n_steps=4",
    "logging.flops=false",
]
NPROC = 4
LAYOUTS = {
    "ddp 4": ["parallel=ddp"],
    "fsdp 4": ["parallel=fsdp"],
    "fsdp 4, 4 accum": ["parallel=fsdp", "loop.grad_accum_steps=4"],
    "fsdp 2 x tp 2": ["parallel=fsdp", "parallel.tp=2"],
    "tp 4": ["parallel.tp=4", "parallel.dp_replicate=1"],
    "ddp 2 x pp 2": [
        "parallel.pp=2",
        "parallel.pipeline.schedule=1F1B",
        "parallel.pipeline.microbatches=4",
    ],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=20, help="steps per launch (default 20)")
    p.add_argument("--rounds", type=int, default=2, help="launches per layout (default 2)")
    p.add_argument("--out", type=Path, default=None, help="folder for the runs and bench.json")
    return p.parse_args()


def calibrate(out: Path) -> Path:
    path = out / "calibration.json"
    cmd = torchrun(NPROC, "-m", "sdnet_trainer.plan.calibrate", f"out={path}")
    timed_launch(cmd, out / "calibrate.log", timeout=600)
    return path


def estimated(calibration: Path) -> dict[str, dict[str, float]]:
    """The planner's step time of each layout, and its parts (seconds)."""
    import torch

    from sdnet_trainer.config import compose
    from sdnet_trainer.plan.auto import _set_layout
    from sdnet_trainer.plan.estimate import estimate
    from sdnet_trainer.plan.hardware import hardware
    from sdnet_trainer.plan.layouts import layout_of
    from sdnet_trainer.plan.model_stats import model_stats

    out = {}
    for name, keys in LAYOUTS.items():
        cfg = compose(
            [*WORKLOAD, *keys, f"parallel.auto.calibration={calibration}"]
            + [f"parallel.auto.ranks_per_node={NPROC}"]
        )
        layout = layout_of(cfg, NPROC)
        _set_layout(cfg, layout)
        hw = hardware(cfg, torch.device("cpu"))
        e = estimate(cfg, model_stats(cfg), layout, hw)
        out[name] = {"step_s": e.step_seconds, **e.seconds}
    return out


def measured_step(run_dir: Path, batch: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["perf/samples_per_s"] for r in rows if "perf/samples_per_s" in r][1:]
    if not rates:
        raise LaunchError(f"no perf/samples_per_s after the first log point in {run_dir}")
    return statistics.median(batch / r for r in rates)


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def main() -> int:
    args = parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_plan_"))
    out.mkdir(parents=True, exist_ok=True)
    calibration = calibrate(out)
    print("calibration:", calibration.read_text().strip())
    estimates = estimated(calibration)
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    busy: dict[str, list[float]] = {name: [] for name in LAYOUTS}  # other processes' cores
    names = list(LAYOUTS)
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            run_dir = out / f"{name.replace(' ', '_').replace(',', '')}_{round_}"
            keys = [*WORKLOAD, *LAYOUTS[name], f"loop.max_steps={args.steps}"]
            cmd = torchrun(NPROC, "-m", "sdnet_trainer", *keys, f"hydra.run.dir={run_dir}")
            try:
                _, others = timed_launch(cmd, run_dir.with_suffix(".log"), timeout=600)
            except LaunchError as err:
                print(f"{name}: {err}", file=sys.stderr)
                return 1
            times[name].append(measured_step(run_dir, 32))
            busy[name].append(others if others is not None else float("nan"))
    measured = {name: statistics.median(v) for name, v in times.items()}
    corr = spearman([estimates[n]["step_s"] for n in names], [measured[n] for n in names])
    print(f"\n{'layout':<18} {'estimated s':>12} {'measured s':>11} {'est/meas':>9}  other cores")
    for name in names:
        est, meas = estimates[name]["step_s"], measured[name]
        print(
            f"{name:<18} {est:>12.4f} {meas:>11.4f} {est / meas:>9.2f}  "
            f"{statistics.median(busy[name]):.2f}"
        )
    print(f"\nSpearman rank correlation (estimated vs measured): {corr:.2f}")
    record = {
        "estimated": estimates,
        "measured_s": measured,
        "rounds_s": times,
        "spearman": corr,
        "calibration": json.loads(calibration.read_text()),
    }
    (out / "bench.json").write_text(json.dumps(record, indent=1))
    print(f"(runs and bench.json in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
