"""Per-step throughput of the Trainer beside a hand-written loop, PyTorch Lightning and Accelerate.

What it measures
    Training throughput (images/s, or tokens/s for the language model) of four ways to run the
    same data-parallel training, side by side:

    hand        a hand-written loop: DDP (or FSDP2 ``fully_shard``) + DistributedSampler +
                DataLoader; forward, cross-entropy, backward, clip_grad_norm_, step, zero_grad
    trainer     sdnet_trainer as a user launches it, ``torchrun -m sdnet_trainer key=value ...``,
                with a Trainer subclass (``trainer._target_=_peer_worker.PeerTrainer``) whose
                ``build_datasets`` returns the in-memory data and whose ``build_hooks`` appends one
                timing hook after the Trainer's own
    lightning   ``lightning.pytorch.Trainer(accelerator="cpu", strategy="ddp", precision=
                "32-true", gradient_clip_val=1.0, ...)`` under torchrun (it takes torchrun's
                processes; the worker checks that it starts none of its own)
    accelerate  ``Accelerator(cpu=True)`` under torchrun: ``prepare(model, optimizer, loader)``,
                ``accelerator.backward``, ``accelerator.clip_grad_norm_``

    The point is what each framework itself adds per step, so the data cost next to nothing:
    every side reads the same tensors, generated once in memory from a fixed seed (float32
    images already normalised, int64 labels or tokens) in a TensorDataset, num_workers=0.

Workloads (--workload; all three by default, in this order)
    resnet  torchvision's ResNet-18 (model=resnet18, ImageNet stem) on 32x32 images, 32 per rank,
            SGD lr 0.05 momentum 0.9 weight decay 5e-4, constant lr, clip grad norm 1.0, fp32,
            DDP over gloo
    gpt     the project's gpt_tiny (model=gpt_tiny: 2 layers, dim 64, 32-token context, 64-token
            vocabulary), 32 random token sequences per rank, AdamW lr 1e-3 betas (0.9, 0.999)
            weight decay 0.05, clip 1.0, fp32 (bf16 on these CPUs is emulated, not measured)
    fsdp    the resnet workload under FSDP2, each residual block one unit, then the root: the
            Trainer's parallel=fsdp, ``fully_shard`` by hand, Lightning's ModelParallelStrategy
            with ``fully_shard`` in ``configure_model`` (its FSDPStrategy is FSDP1 and cannot clip
            by norm through gradient_clip_val). Accelerate turns an FSDP plugin into FSDP only on
            GPU-type devices; on the CPU that cell says so instead of timing plain DDP.

    Every side: same model and initial weights (``torch.manual_seed(0)`` before building it; the
    table warns if the weights' checksums differ), same optimizer, clipping, precision and per-rank
    batch, 2 processes (--nproc), no evaluation, no checkpoints, no progress bars. The Trainer
    runs from the root config with every workload key pinned on its command line and checked in
    its resolved config (.hydra/config.yaml) afterwards; it keeps its logging defaults (a log
    point every 10 steps, TensorBoard and metrics.jsonl, the heartbeat line): that is part of what
    a user pays. Only its checkpoints and evaluation are switched off, as on the other sides.
    Each framework keeps its own defaults otherwise: the settings it actually ran with (DDP bucket
    size and flags, strategy, threads, the optimizer's implementation) are printed under each
    table. The optimizer is one of them: every side constructs torch's class with the same
    arguments, and the Trainer's optim.implementation=auto picks its fused kernel (on the CPU
    too), where a plain ``torch.optim.SGD(...)`` runs torch's per-parameter loop there; add
    ``--trainer-override optim.implementation=for_loop`` to compare like for like.

How
    Each rank records ``time.perf_counter()`` at the end of step ``--warmup`` and at the end of
    step ``--warmup + --steps``; the end of a step is after the framework's own per-step work:
    after zero_grad (hand, accelerate), after the Trainer's hooks (the timing hook is the last
    one), in ``on_train_batch_end`` of a Callback (Lightning). Throughput of a launch = steps x
    global batch / the slowest rank's elapsed time (one small all-gather after the window). Every
    side runs one more step after the window, so that end-of-run work (the Trainer logs at its
    last step) stays outside it; with --steps a multiple of 10 the window holds exactly the
    Trainer's periodic log points.

    Rounds alternate the sides: in each round every side runs once, in an order rotated by one
    from round to round, each run a fresh ``torchrun --standalone`` launch with
    OMP_NUM_THREADS=1, so slow drift of the machine hits all sides alike. The table shows each
    side's median over rounds with its min-max, and its ratio to the hand-written loop as the
    median of the per-round ratios (side / hand in the same round) with their min-max. Each
    launch also reports how many cores other processes used meanwhile; on a shared machine that
    contention, not the frameworks, dominates the spread, and the script warns when it was
    significant.

Run (from the repository root; Lightning and Accelerate: pip install -e '.[bench]')
    python scripts/bench/bench_peers.py
    python scripts/bench/bench_peers.py --workload resnet --rounds 3 --out /tmp/peers
    python scripts/bench/bench_peers.py --workload gpt --sides hand,trainer
    python scripts/bench/bench_peers.py --workload resnet --data synthetic  # every side
    python scripts/bench/bench_peers.py --trainer-override parallel.ddp.bucket_cap_mb=25
    python scripts/bench/bench_peers.py --workload resnet --rounds 1 --warmup 2 --steps 4  # smoke

    A ResNet-18 step takes about 0.7 s on 2 idle cores, so a resnet or fsdp launch (5 + 40
    steps, one more after the window, start-up) takes about 45 s, a gpt launch (10 + 300 steps)
    about 25 s. The defaults (7 resnet rounds, 3 gpt and 3 fsdp rounds) take about 35 minutes on
    2 otherwise idle cores; --rounds, --rounds-other and --steps trade time for spread.

Exit status: 0 after a complete measurement; 1 if a launch failed or timed out (the other sides
still run; the failed side's cell says so). Every launch's log and JSON result (and the Trainer's
run directory) are kept under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _launch import REPO, LaunchError, timed_launch, torchrun  # scripts/ is on sys.path
from _peer_worker import (
    CHANNELS,
    DATA_MODES,
    IMAGE_SIZE,
    NUM_CLASSES,
    SEED,
    SIDES,
    SPEC_ENV,
    SYNTHETIC_NOISE,
    SYNTHETIC_SEED,
    SYNTHETIC_SIGNAL,
    WORKLOADS,
    TrainerSpec,
    Workload,
    model_config,
)

WORKER = REPO / "scripts" / "bench" / "_peer_worker.py"
TRAINER_CLASS = "_peer_worker.PeerTrainer"  # importable with scripts/ on PYTHONPATH
# Sides that need a package beyond the project's own dependencies.
PACKAGES = {"lightning": "lightning", "accelerate": "accelerate"}
INSTALL_HINT = "pip install -e '.[bench]'"
# Other processes using more than this many cores on average during a launch make its timing
# unreliable (2 training processes on 2 cores leave nothing spare): warn about it.
BUSY_WARN_CORES = 0.2
LOG_EVERY = 10  # the Trainer's default logging.log_every_n_steps, pinned
# Initial weights agree to float64 rounding of the sum when the models are the same.
CHECKSUM_RTOL = 1e-9


def parse_list(value: str, choices: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in choices]
    if unknown or not items:
        raise argparse.ArgumentTypeError(
            f"{what} {value!r}: choose from {', '.join(choices)} (comma-separated)"
        )
    return list(dict.fromkeys(items))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--workload",
        type=lambda v: parse_list(v, tuple(WORKLOADS), "--workload"),
        default=list(WORKLOADS),
        help=f"comma-separated, in the order given (default {','.join(WORKLOADS)})",
    )
    p.add_argument(
        "--sides",
        type=lambda v: parse_list(v, SIDES, "--sides"),
        default=list(SIDES),
        help=f"comma-separated (default {','.join(SIDES)})",
    )
    p.add_argument("--rounds", type=int, default=7, help="rounds of the resnet workload (7)")
    p.add_argument(
        "--rounds-other", type=int, default=3, help="rounds of the gpt and fsdp workloads (3)"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps before the timed window (default per workload: "
        + ", ".join(f"{w.name} {w.warmup}" for w in WORKLOADS.values())
        + ")",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps (default per workload: "
        + ", ".join(f"{w.name} {w.steps}" for w in WORKLOADS.values())
        + ")",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes per launch (default 2)")
    p.add_argument(
        "--data",
        choices=DATA_MODES,
        default="memory",
        help="memory: in-memory tensors (default); synthetic: the project's SyntheticImages on "
        "every side (image workloads; gpt keeps its in-memory tokens)",
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
        "e.g. parallel.ddp.bucket_cap_mb=25",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per launch before it is killed (600)"
    )
    args = p.parse_args()
    if args.warmup is not None and args.warmup < 1:
        p.error("--warmup must be >= 1 (the window starts at the end of step --warmup)")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    if min(args.rounds, args.rounds_other, args.nproc) < 1:
        p.error("--rounds, --rounds-other and --nproc must be >= 1")
    for override in args.trainer_override:
        key = override.split("=", 1)[0].lstrip("+~")
        if "=" not in override:
            p.error(f"--trainer-override {override}: expected KEY=VALUE")
        for name in args.workload:
            plan = plan_for(args, WORKLOADS[name])
            if key in trainer_keys(plan) or key in trainer_groups(plan):
                p.error(
                    f"--trainer-override {override}: that key is pinned to match the other sides"
                )
    return args


@dataclass(frozen=True)
class Plan:
    """One workload as this invocation runs it."""

    workload: Workload
    data: str  # memory | synthetic (image workloads only)
    warmup: int
    steps: int
    nproc: int
    rounds: int


def plan_for(args: argparse.Namespace, workload: Workload) -> Plan:
    return Plan(
        workload=workload,
        data=args.data if workload.kind == "images" else "memory",
        warmup=args.warmup if args.warmup is not None else workload.warmup,
        steps=args.steps if args.steps is not None else workload.steps,
        nproc=args.nproc,
        rounds=args.rounds if workload.name == "resnet" else args.rounds_other,
    )


# ---------------------------------------------------------------------------- the Trainer's keys


def trainer_groups(plan: Plan) -> dict[str, str]:
    """Config groups first (each replaces a whole section), then the keys below pin every value."""
    w = plan.workload
    return {
        "model": w.model,
        "data": "synthetic" if w.kind == "images" else "tokens",
        "optim": w.optimizer.lower(),
        "sched": "constant",
        "precision": "fp32",
        "parallel": "fsdp" if w.sharded else "ddp",
    }


def trainer_keys(plan: Plan) -> dict[str, object]:
    """Every key of the workload, as the other sides run it (checked in the resolved config)."""
    w = plan.workload
    model = model_config(w)  # configs/model/<name>.yaml on the schema: what the others build
    keys: dict[str, object] = {
        "trainer._target_": TRAINER_CLASS,
        "model.name": model.name,
        "model.weights": None,
        "parallel.activation_checkpointing": "none",
        "model.channels_last": False,
        "compile.enabled": False,
        "loop.seed": SEED,
    }
    if w.kind == "images":
        keys |= {
            "model.num_classes": model.num_classes,
            "model.cifar_stem": model.cifar_stem,
            # data=synthetic as SyntheticImages is built for --data synthetic; with in-memory data
            # PeerTrainer ignores these (the shapes are the same).
            "data.name": "synthetic",
            "data.train_size": w.train_size,
            "data.image_size": IMAGE_SIZE,
            "data.channels": CHANNELS,
            "data.num_classes": NUM_CLASSES,
            "data.synthetic_seed": SYNTHETIC_SEED,
            "data.signal": SYNTHETIC_SIGNAL,
            "data.noise": SYNTHETIC_NOISE,
        }
    else:
        gpt = model.gpt
        keys |= {f"model.gpt.{f.name}": getattr(gpt, f.name) for f in dataclasses.fields(gpt)}
        keys |= {
            # The LM data keys make the Trainer count tokens (perf/tokens_per_s) as the others do.
            "data.name": "tokens",
            "data.train_size": w.train_size,
            "data.seq_len": gpt.seq_len,
            "data.vocab_size": gpt.vocab_size,
        }
    keys |= {
        "data.shuffle": True,
        "data.drop_last": True,
        "data.num_workers": 0,
        "optim.name": w.optimizer,
        "optim.lr": w.lr,
        "optim.weight_decay": w.weight_decay,
        "optim.momentum": w.momentum,
        "optim.betas": list(w.betas) if w.betas is not None else None,
        "optim.nesterov": None,
        "optim.eps": None,
        "optim.implementation": "auto",  # torch's default on the CPU, as the others get
        "optim.no_decay_norm_and_bias": False,
        "optim.clip_grad_norm": w.clip_grad_norm,
        "optim.clip_grad_value": None,
        "sched.name": "constant",
        "sched.warmup_steps": 0,
        "precision.dtype": "fp32",
        "loss.label_smoothing": 0.0,
        "parallel.strategy": "fsdp" if w.sharded else "ddp",
        "parallel.tp": 1,
        "parallel.pp": 1,
        "parallel.sync_batchnorm": False,
        "loop.max_steps": plan.warmup + plan.steps + 1,  # one step after the window (worker)
        "loop.max_epochs": None,
        "loop.grad_accum_steps": 1,
        "loop.global_batch_size": w.per_rank_batch * plan.nproc,
        "loop.micro_batch_size": None,
        "loop.deterministic": False,
        # No evaluation anywhere in (or after) the timed steps.
        "loop.eval_at_end": False,
        "loop.eval_at_epoch_end": False,
        "loop.eval_every_n_steps": None,
        # Logging as by default (pinned so that a changed default shows up here): a log point
        # every 10 steps, metrics.jsonl and TensorBoard on.
        "logging.log_every_n_steps": LOG_EVERY,
        "logging.trackers": ["tensorboard", "jsonl"],
        # No checkpoint: none during the steps, none resumed from an earlier run in the same
        # --out, none at exit (disk and minutes after the last step, no step time).
        "checkpoint.every_n_steps": None,
        "checkpoint.every_n_minutes": None,
        "checkpoint.resume": "none",
        "checkpoint.save_on_exit": False,
    }
    if w.sharded:
        keys |= {
            "parallel.dp_replicate": 1,
            "parallel.dp_shard": -1,
            "parallel.fsdp.reshard_after_forward": True,
            "parallel.fsdp.param_dtype": "fp32",
            "parallel.fsdp.reduce_dtype": "fp32",
        }
    else:
        keys |= {"parallel.dp_replicate": -1, "parallel.dp_shard": 1}
    return keys


def _override_value(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    return str(value)


def trainer_command(plan: Plan, run_dir: Path, overrides: list[str]) -> list[str]:
    groups = [f"{k}={v}" for k, v in trainer_groups(plan).items()]
    keys = [f"{k}={_override_value(v)}" for k, v in trainer_keys(plan).items()]
    return torchrun(
        plan.nproc,
        "-m",
        "sdnet_trainer",
        *groups,
        *keys,
        *overrides,
        f"hydra.run.dir={run_dir}",
    )


def check_trainer_config(plan: Plan, run_dir: Path) -> None:
    """The resolved config the Trainer ran with must hold every pinned key (others edit the
    configs; a changed default must not silently change the workload)."""
    from omegaconf import OmegaConf  # the Trainer's own dependency

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    wrong = {}
    for key, expected in trainer_keys(plan).items():
        value = OmegaConf.select(cfg, key)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        if value != expected:
            wrong[key] = value
    if wrong:
        raise LaunchError(f"the Trainer ran with a different workload than pinned: {wrong}")


# ---------------------------------------------------------------------------- launches


def worker_command(side: str, plan: Plan, out_json: Path) -> list[str]:
    return torchrun(
        plan.nproc,
        str(WORKER),
        f"--side={side}",
        f"--workload={plan.workload.name}",
        f"--data={plan.data}",
        f"--warmup={plan.warmup}",
        f"--steps={plan.steps}",
        f"--out={out_json}",
    )


def run_once(
    side: str, rnd: int, plan: Plan, out: Path, args: argparse.Namespace
) -> tuple[dict[str, Any], float, float | None]:
    """One launch of ``side``: (its JSON result, launch seconds, cores used by others)."""
    stem = out / plan.workload.name / f"r{rnd + 1}_{side}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    out_json, log = stem.with_suffix(".json"), stem.with_suffix(".log")
    out_json.unlink(missing_ok=True)
    if side == "trainer":
        run_dir = stem  # the Trainer's run directory: metrics.jsonl, TensorBoard, .hydra/
        shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl is opened for append
        spec = TrainerSpec(
            workload=plan.workload.name,
            data=plan.data,
            warmup=plan.warmup,
            steps=plan.steps,
            out=str(out_json),
        )
        os.environ[SPEC_ENV] = spec.to_env()
        try:
            cmd = trainer_command(plan, run_dir, args.trainer_override)
            seconds, other = timed_launch(cmd, log, args.timeout)
        finally:
            del os.environ[SPEC_ENV]
        check_trainer_config(plan, run_dir)
    else:
        seconds, other = timed_launch(worker_command(side, plan, out_json), log, args.timeout)
    if not out_json.exists():
        raise LaunchError(f"{side} wrote no result ({out_json}); see {log}")
    result = json.loads(out_json.read_text())
    if result.get("not_runnable") is None and (
        result["steps"] != plan.steps or result["world_size"] != plan.nproc
    ):
        raise LaunchError(f"{side}: result for another run shape in {out_json}")
    return result, seconds, other


# ---------------------------------------------------------------------------- results


@dataclass
class SideResults:
    """One side's launches of one workload."""

    throughput: dict[int, float] = field(default_factory=dict)  # round -> items/s
    other_cores: list[float] = field(default_factory=list)
    settings: dict[str, Any] | None = None
    checksum: float | None = None
    cell: str | None = None  # why there is no number: not installed, not runnable, failed


def fmt(value: float) -> str:
    return f"{value:.4g}" if value < 1000 else f"{value:,.0f}"


def print_table(plan: Plan, sides: list[str], results: dict[str, SideResults]) -> None:
    unit = "tokens/s" if plan.workload.kind == "tokens" else "images/s"
    print()
    print(
        f"{plan.workload.name}: {unit}, {plan.nproc} processes, {plan.warmup} + {plan.steps} "
        f"steps per launch, {plan.data} data"
    )
    header = (
        f"{'side':<12}{unit + ' median':>17}{'min-max':>21}{'vs hand':>10}{'min-max':>15}"
        f"{'other cores mean/max':>23}"
    )
    print(header)
    print("-" * len(header))
    hand = results.get("hand")
    for side in sides:
        res = results[side]
        if not res.throughput:
            print(f"{side:<12}{res.cell or 'no result'}")
            continue
        values = list(res.throughput.values())
        spread = f"{fmt(min(values))}-{fmt(max(values))}"
        ratio, ratio_spread = "n/a", ""
        if hand is not None and hand.throughput:
            paired = [
                v / hand.throughput[r] for r, v in res.throughput.items() if r in hand.throughput
            ]
            if paired:
                ratio = f"{statistics.median(paired):.3f}"
                ratio_spread = f"{min(paired):.3f}-{max(paired):.3f}"
        load = ""
        if res.other_cores:
            load = f"{statistics.mean(res.other_cores):.2f}/{max(res.other_cores):.2f}"
        print(
            f"{side:<12}{fmt(statistics.median(values)):>17}{spread:>21}{ratio:>10}"
            f"{ratio_spread:>15}{load:>23}"
        )
        if res.cell:  # e.g. a later round that failed
            print(f"{'':<12}({res.cell})")
    print(
        "vs hand: median over rounds of side / hand in the same round (min-max of those ratios); "
        "other cores: CPU used by other processes during the side's launches"
    )
    print("ran with:")
    for side in sides:
        settings = results[side].settings
        if settings:
            shown = ", ".join(f"{k} {v}" for k, v in settings.items())
            print(f"  {side:<11} {shown}")
    buckets = {}
    for side in sides:
        settings = results[side].settings or {}
        if "bucket_cap_mb" in settings:
            buckets[side] = settings["bucket_cap_mb"]
    if len(set(buckets.values())) > 1:
        shown = ", ".join(f"{side} {mb:g} MB" for side, mb in buckets.items())
        print(f"  note: DDP bucket sizes differ ({shown}): each side's own default")
    checksums = {side: r.checksum for side, r in results.items() if r.checksum is not None}
    if checksums:
        first = next(iter(checksums.values()))
        if any(abs(c - first) > CHECKSUM_RTOL * max(abs(first), 1.0) for c in checksums.values()):
            print(f"  warning: the sides started from different weights (checksums {checksums})")
    loads = [c for r in results.values() for c in r.other_cores]
    if loads and max(loads) > BUSY_WARN_CORES:
        print(
            f"warning: other processes used up to {max(loads):.2f} cores during the launches; "
            f"throughput then includes their contention and the ratios are noisy. Rerun on an "
            f"otherwise idle machine, or with more rounds."
        )


def run_workload(plan: Plan, sides: list[str], out: Path, args: argparse.Namespace) -> bool:
    """All rounds of one workload; prints its table. False if a launch failed."""
    results = {side: SideResults() for side in sides}
    active = []
    for side in sides:
        package = PACKAGES.get(side)
        if package is not None and importlib.util.find_spec(package) is None:
            results[side].cell = f"{package} not installed: {INSTALL_HINT}"
        else:
            active.append(side)
    print(
        f"\n== {plan.workload.name}: {plan.rounds} round(s) of {', '.join(active) or 'nothing'}",
        flush=True,
    )
    if "trainer" in active and plan.steps % LOG_EVERY:
        points = (plan.warmup + plan.steps) // LOG_EVERY - plan.warmup // LOG_EVERY
        print(
            f"  note: {plan.steps} timed steps are not a multiple of the Trainer's log period "
            f"({LOG_EVERY}): its window holds {points} log point(s), not "
            f"{plan.steps / LOG_EVERY:g}",
            flush=True,
        )
    ok = True
    for rnd in range(plan.rounds):
        # Rotate the order every round, so no side always runs first (or right after another).
        shift = rnd % len(sides)
        for side in sides[shift:] + sides[:shift]:
            if side not in active:
                continue
            res = results[side]
            try:
                result, seconds, other = run_once(side, rnd, plan, out, args)
            except LaunchError as err:
                print(f"  round {rnd + 1}/{plan.rounds} {side:<11} FAILED: {err}", file=sys.stderr)
                res.cell = f"FAILED in round {rnd + 1}: see {out / plan.workload.name}"
                active.remove(side)  # its later rounds would fail the same way
                ok = False
                continue
            if result.get("not_runnable"):
                res.cell = f"not runnable on CPU: {result['not_runnable']}"
                active.remove(side)
                print(f"  round {rnd + 1}/{plan.rounds} {side:<11} {res.cell}", flush=True)
                continue
            res.throughput[rnd] = result["throughput"]
            res.settings = result["settings"]
            res.checksum = result["init_checksum"]
            load = ""
            if other is not None:
                res.other_cores.append(other)
                load = f"  (other processes: {other:.2f} cores)"
            print(
                f"  round {rnd + 1}/{plan.rounds} {side:<11} {seconds:6.1f} s launch  "
                f"{result['step_s']:.4f} s/step  {fmt(result['throughput'])} {result['unit']}"
                f"{load}",
                flush=True,
            )
    print_table(plan, sides, results)
    return ok


def main() -> int:
    args = parse_args()
    out = (args.out or Path(tempfile.mkdtemp(prefix="bench_peers_"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # The Trainer imports its subclass (trainer._target_) from scripts/, as a user's module.
    scripts = str(REPO / "scripts" / "bench")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (scripts, os.environ.get("PYTHONPATH", "")) if p
    )
    print(
        f"bench_peers: sides {', '.join(args.sides)}; workloads {', '.join(args.workload)}; "
        f"{args.nproc} processes per launch; output in {out}",
        flush=True,
    )
    if args.trainer_override:
        print(f"trainer overrides: {' '.join(args.trainer_override)}", flush=True)
    if args.data == "synthetic" and "gpt" in args.workload:
        print("note: --data synthetic applies to the image workloads; gpt keeps in-memory tokens")
    started = time.perf_counter()
    ok = True
    for name in args.workload:
        ok &= run_workload(plan_for(args, WORKLOADS[name]), args.sides, out, args)
    print(f"\n({time.perf_counter() - started:.0f} s in all; logs and results in {out})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
