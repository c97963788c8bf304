"""Per-rank training-state memory of DDP, ZeRO-1, FSDP ZeRO-2 and FSDP ZeRO-3, side by side, and
of FSDP's two gradient reductions under accumulation.

What it measures
    For each layout, the bytes one rank holds for parameters, gradients and optimizer state
    (``sdnet_trainer.observability.memory.training_state_bytes``, counted from local shards), the
    max over ranks, and the ratio of the total to DDP's, with the ideal of full sharding (DDP's
    bytes / N) as a last line. Expected with N ranks and Adam(W) (optimizer state = 2 x params):
    DDP holds everything (4 units of the parameter size); ZeRO-1 shards the optimizer state
    (2 + 2/N); FSDP shards all three (4/N) with both reshard_after_forward settings.

    ZeRO-2 and ZeRO-3 differ during the step, not at rest: from the end of forward until
    backward has used them, ZeRO-2 keeps every block's parameters gathered while ZeRO-3 frees
    them and gathers each block again in backward. The "params in bwd" column shows that: the
    parameter bytes a rank holds as backward starts (its shards plus whatever FSDP keeps
    gathered; all parameters under DDP and ZeRO-1). Activations, temporaries and communication
    buffers are in no column.

    Gradient accumulation under FSDP (the two "accum" rows, ``loop.grad_accum_steps=4``, the same
    micro-batch): ``parallel.fsdp.grad_sync=every_microstep`` (the default) reduce-scatters after
    every micro-step, so a rank holds only gradient shards; ``last_microstep`` accumulates an
    unsharded fp32 gradient of every parameter until the last micro-step. At rest both hold the
    same shards, so the difference shows in the peak RSS column and in "grads held": the
    gradient bytes a rank holds after the first micro-step's backward (the shards' gradients,
    plus the unsharded ones FSDP keeps while the reduction waits).

    Second, coarser figure: each rank's peak resident set size (``peak_memory_mb``), max over
    ranks. On the CPU it includes the Python runtime, torch's libraries, the data set,
    activations and what the allocator keeps cached; those are the same for every layout and
    hundreds of MB, so sharding shows much more clearly in the state bytes. (On a GPU the
    allocator's peak is the figure to watch.)

How
    The real Trainer (a subclass that records the figures: ``scripts/bench/_memory_worker.py``), one
    ``python -m torch.distributed.run --standalone`` launch per layout (gloo, CPU,
    ``OMP_NUM_THREADS=1``): peak RSS is a high-water mark of the whole process, so layouts that
    shared a process would show the largest of them. Each trains --steps steps, so the optimizer
    state exists, with no evaluation, checkpoint or TensorBoard; the figures are taken after
    the last step.

    Default workload: ``model=gpt_small data=tokens optim=adamw`` (3.3M parameters), 2 sequences
    per rank. Config overrides after ``--`` replace it or add to it, e.g.
    ``-- model=resnet18 data=synthetic optim=sgd`` (SGD with momentum: optimizer state = 1 x
    params). The layouts' own keys (``parallel=...``) are set here.

Run (from the repository root; about 2 minutes on 2 CPU cores with the defaults)
    python scripts/bench/bench_memory.py
    python scripts/bench/bench_memory.py --nproc 2 --steps 2 -- model=gpt_tiny
    python scripts/bench/bench_memory.py --nproc 2 --layouts "FSDP accum every" "FSDP accum last" \
        -- model.gpt.dim=768     # FSDP's two reductions under accumulation, larger gradients
    python scripts/bench/bench_memory.py --nproc 2 --layouts "FSDP ZeRO-3" "FSDP LoRA" \
        -- model=llama3_debug model.llama.dim=512 model.llama.hidden_dim=1376 \
        model.llama.n_layers=4 data.vocab_size=256 data.seq_len=64    # LoRA vs full

Exit status 0 with the table printed; 1 if a launch fails or times out.
"""

from __future__ import annotations

import argparse
import json
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

WORKER = REPO / "scripts" / "bench" / "_memory_worker.py"
MB = 2**20  # as peak_memory_mb counts

LAYOUTS = {
    "DDP": ["parallel=ddp"],
    "ZeRO-1": ["parallel=zero1"],
    "FSDP ZeRO-2": ["parallel=fsdp", "parallel.fsdp.reshard_after_forward=false"],
    "FSDP ZeRO-3": ["parallel=fsdp"],
    "FSDP accum every": ["parallel=fsdp", "parallel.fsdp.grad_sync=every_microstep"],
    "FSDP accum last": ["parallel=fsdp", "parallel.fsdp.grad_sync=last_microstep"],
    # model.lora (a Llama or MoE: -- model=llama3_debug ...): only the adapters have gradients
    # and optimizer state; the frozen base is sharded as under ZeRO-3.
    "FSDP LoRA": ["parallel=fsdp", "model.lora.enabled=true", "model.ema.enabled=false"],
}
# Micro-steps per optimizer step of the layouts that accumulate (the others: 1).
ACCUM_STEPS = {"FSDP accum every": 4, "FSDP accum last": 4}
WORKLOAD = ["model=gpt_small", "data=tokens", "optim=adamw"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--nproc", type=int, default=4, help="processes, the N of the sharding (default 4)"
    )
    p.add_argument("--steps", type=int, default=3, help="training steps per layout (default 3)")
    p.add_argument(
        "--batch-size", type=int, default=2, help="samples per rank and step (default 2)"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="output directory (default: a new temp dir)"
    )
    p.add_argument(
        "--layouts",
        nargs="+",
        choices=list(LAYOUTS),
        default=[name for name in LAYOUTS if name != "FSDP LoRA"],  # the GPT has no adapters
        metavar="NAME",
        help="the layouts to launch, by their names in the table (default: all but FSDP LoRA); "
        "DDP, the reference of the ratios, always runs",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per launch before it is killed"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, after --; they replace the default workload's keys",
    )
    args = p.parse_args()
    args.layouts = ["DDP", *(name for name in args.layouts if name != "DDP")]
    if args.nproc < 2:
        p.error("--nproc must be at least 2: one process shards nothing")
    if args.steps < 1 or args.batch_size < 1:
        p.error("--steps and --batch-size must be >= 1")
    for override in args.overrides:
        if _key(override) in ("parallel", "parallel.strategy"):
            p.error(f"{override}: the layouts set parallel themselves")
    return args


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def overrides(args: argparse.Namespace, name: str | None = None) -> list[str]:
    """The workload, the user's overrides in place of keys they name, then the layout's keys
    (``name`` None: the workload alone)."""
    accum = ACCUM_STEPS.get(name or "", 1)
    run = [
        f"loop.max_steps={args.steps}",
        f"loop.global_batch_size={args.batch_size * args.nproc * accum}",
        f"loop.grad_accum_steps={accum}",
        "data.train_size=256",
        "data.val_size=64",
        # Nothing but training: an evaluation forward would leave FSDP's root gathered, and the
        # rest costs time without touching the training state.
        "loop.eval_at_end=false",
        "loop.eval_at_epoch_end=false",
        "loop.eval_every_n_steps=null",
        "logging.trackers=[jsonl]",
        "checkpoint.every_n_steps=null",
        "checkpoint.every_n_minutes=null",
        "checkpoint.resume=none",
        "checkpoint.save_on_exit=false",
        # glibc returns freed blocks: the peak RSS follows what is live at once rather than the
        # heap's high-water mark (pinned thresholds keep every freed buffer; FSDP's per-micro-step
        # reductions free and re-allocate them, which showed as more, not less, memory).
        "dist.pin_cpu_malloc=false",
    ]
    merged = {_key(o): o for o in WORKLOAD + run}
    merged.update(
        {_key(o): o for o in args.overrides}
    )  # later overrides of a key would be ambiguous
    return list(merged.values()) + (LAYOUTS[name] if name is not None else [])


def launch(name: str, args: argparse.Namespace, out: Path) -> dict:
    """One torchrun of the worker for one layout; its figures, every rank's."""
    stem = name.lower().replace(" ", "_").replace("-", "")
    out_json, spec, log_path = (
        out / f"{stem}.json",
        out / f"{stem}_overrides.json",
        out / f"{stem}.log",
    )
    spec.write_text(json.dumps(overrides(args, name)))
    run_launch(torchrun(args.nproc, str(WORKER), str(out_json), str(spec)), log_path, args.timeout)
    return json.loads(out_json.read_text())


def row(result: dict) -> dict[str, float]:
    """The layout's figures in MB, each the max over ranks (the rank that needs the most memory
    sets the device size; ZeRO-1's partitions are uneven)."""
    ranks = result["ranks"]

    def most(per_rank) -> float:
        return max(per_rank(r) for r in ranks) / MB

    return {
        "params": most(lambda r: r["params"]),
        "grads": most(lambda r: r["grads"]),
        "optim": most(lambda r: r["optim"]),
        "total": most(lambda r: r["params"] + r["grads"] + r["optim"]),
        "params_bwd": most(lambda r: r["params"] + r["unsharded_in_backward"]),
        "grads_held": most(lambda r: r["grads_after_first_microstep"]),
        "rss": max(r["peak_rss_mb"] for r in ranks),
    }


def print_table(rows: dict[str, dict[str, float]], nproc: int) -> None:
    ddp = rows["DDP"]["total"]
    print(
        f"{'layout':<20}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}{'total MB':>10}"
        f"{'vs DDP':>8}{'params in bwd MB':>18}{'grads held MB':>15}{'peak RSS MB':>13}"
    )
    for name, r in rows.items():
        held = f"{r['grads_held']:.2f}" if name in ACCUM_STEPS else "-"
        print(
            f"{name:<20}{r['params']:>11.2f}{r['grads']:>10.2f}{r['optim']:>10.2f}{r['total']:>10.2f}"
            f"{r['total'] / ddp:>8.3f}{r['params_bwd']:>18.2f}{held:>15}{r['rss']:>13.0f}"
        )
    base = rows["DDP"]
    print(
        f"{f'ideal (DDP / {nproc})':<20}{base['params'] / nproc:>11.2f}"
        f"{base['grads'] / nproc:>10.2f}{base['optim'] / nproc:>10.2f}"
        f"{ddp / nproc:>10.2f}{1 / nproc:>8.3f}"
    )


def main() -> int:
    args = parse_args()
    out = (args.out or Path(tempfile.mkdtemp(prefix="bench_memory_"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    workload = overrides(args)
    print(
        f"bench_memory: {', '.join(args.layouts)} on {args.nproc} processes, {args.steps} "
        f"steps each; output in {out}",
        flush=True,
    )
    print(f"workload: {' '.join(workload)}", flush=True)
    started = time.perf_counter()
    rows = {}
    try:
        for name in args.layouts:
            launch_started = time.perf_counter()
            rows[name] = row(launch(name, args, out))
            print(f"  {name}: {time.perf_counter() - launch_started:.0f} s", flush=True)
    except LaunchError as err:
        print(f"bench_memory: launch failed: {err}", file=sys.stderr)
        return 1
    print()
    print(
        "Training state per rank: parameters, gradients, optimizer state from local shards "
        f"(MB = 2^20 bytes), each column the max over the {args.nproc} ranks."
    )
    print(
        "params in bwd: parameter bytes held as backward starts. grads held (accum rows, "
        f"{max(ACCUM_STEPS.values())} micro-steps): gradient bytes held after the first "
        "micro-step. peak RSS: the whole process (Python runtime, data, activations and "
        "allocator cache included)."
    )
    print_table(rows, args.nproc)
    print(f"({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
