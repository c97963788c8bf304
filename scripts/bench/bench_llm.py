"""Training throughput (tokens/s) and MFU of the Llama family: the Trainer under DDP and FSDP2
beside a hand-written FSDP2 loop on the same model and data, and beside ``transformers``'
``LlamaForCausalLM`` of the same shape in that hand-written loop (so the model code is compared
too).

Sides (--sides; all four by default)
    ddp     the Trainer, parallel=ddp (``+recipe=llama3_debug`` with the keys below pinned)
    fsdp    the Trainer, parallel=fsdp (FSDP2: each block one unit, then the root)
    hand    a hand-written loop: the project's Llama, ``fully_shard`` per block then the root,
            DistributedSampler + DataLoader, forward, cross-entropy, backward, clip_grad_norm_,
            step, zero_grad
    hf      the same loop on ``transformers.LlamaForCausalLM`` built from the Llama's own config
            (``models/llama/hf.py``'s ``hf_config_of``) and given its initial weights, each decoder
            layer one unit

    Every side: model=llama3_debug (or --model), initial weights from ``torch.manual_seed(0)``
    (the table warns if their checksums differ), the data=tokens language (the Trainer's data set,
    built with the same keys by the hand loops), --batch sequences per rank, AdamW lr 3e-3 betas
    (0.9, 0.95) weight decay 0.1 with torch's foreach implementation, a constant learning rate,
    clip 1.0, fp32, gloo. The Trainer runs with no evaluation, checkpoints or trackers.

How
    Each rank records the time at the end of step --warmup and at the end of step --warmup +
    --steps (one more step runs after the window); tokens/s of a launch = steps x global batch x
    seq_len / the slowest rank's time. Rounds alternate the sides (each round in an order rotated
    by one, each launch a fresh ``torchrun --standalone`` with OMP_NUM_THREADS=1); the table shows
    each side's median tokens/s over rounds with its min-max, its ratio to ``hand`` (median of the
    per-round ratios) and its MFU. MFU = model FLOPs per token (forward + backward, counted by
    torch's FlopCounterMode on the model, the same for every side) x tokens/s over the peak of
    all processes: --peak-gflops per process, or, on the CPU by default, the fp32 matmul rate one
    thread of this machine reaches (measured here first), since CPUs publish no peak.

Run (from the repository root)
    python scripts/bench/bench_llm.py                                   # 3 rounds, 2 processes
    python scripts/bench/bench_llm.py --rounds 1 --warmup 2 --steps 4   # smoke test
    python scripts/bench/bench_llm.py --sides fsdp,hand --out /tmp/llm

Exit status 0 after a complete measurement, 1 if a launch failed (its cell says so). Each
launch's log and JSON result are kept under --out.
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
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _launch import LaunchError, load_line, timed_launch, torchrun  # scripts/ is on sys.path
from torch import nn

SIDES = ("ddp", "fsdp", "hand", "hf")
SEED = 0
OPTIM = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
CLIP = 1.0


def config(args: argparse.Namespace, side: str) -> Any:
    """The run's config, as the Trainer sides take it and the hand loops read it."""
    from sdnet_trainer import compose

    parallel = "ddp" if side == "ddp" else "fsdp"
    return compose(
        [
            "+recipe=llama3_debug",
            f"model={args.model}",
            f"parallel={parallel}",
            "precision=fp32",
            "sched=constant",
            # The recipe's warmup would stay under sched=constant: the hand loops have none.
            "sched.warmup_steps=0",
            f"optim.lr={OPTIM['lr']}",
            "optim.betas=[0.9,0.95]",
            f"optim.weight_decay={OPTIM['weight_decay']}",
            "optim.no_decay_norm_and_bias=false",
            "optim.implementation=foreach",
            f"optim.clip_grad_norm={CLIP}",
            f"loop.seed={SEED}",
            f"data.seq_len={args.seq_len}",
            f"loop.max_steps={args.warmup + args.steps + 1}",
            f"loop.global_batch_size={args.batch * args.nproc}",
            "loop.eval_every_n_steps=null",
            "loop.eval_at_end=false",
            "loop.eval_at_epoch_end=false",
            "checkpoint.save_on_exit=false",
            "logging.trackers=[]",
            "dist.device=cpu",
        ]
    )


# ------------------------------------------------------------------------------ the worker


class Window:
    """This rank's time from the end of step ``warmup`` to the end of step ``warmup + steps``."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.last = warmup, warmup + steps
        self.started = 0.0
        self.elapsed: float | None = None

    def step_done(self, step: int) -> bool:
        if step == self.warmup:
            self.started = time.perf_counter()
        elif step == self.last:
            self.elapsed = time.perf_counter() - self.started
            return True
        return False


def checksum(model: nn.Module) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def report(args: argparse.Namespace, window: Window, side: str, loss: float, sum_: float) -> None:
    """Every rank's time gathered; rank 0 writes the result."""
    assert window.elapsed is not None
    mine = torch.tensor([window.elapsed], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if dist.get_rank() == 0:
        elapsed = max(float(t) for t in every)
        tokens = args.steps * args.batch * dist.get_world_size() * args.seq_len
        result = {"side": side, "tokens_per_s": tokens / elapsed, "elapsed_s": elapsed}
        result |= {"final_loss": loss, "init_checksum": sum_}
        Path(args.result).write_text(json.dumps(result))


def run_trainer(args: argparse.Namespace) -> None:
    from sdnet_trainer import Trainer
    from sdnet_trainer.distributed import distributed_session
    from sdnet_trainer.training.hooks import HookBase

    window = Window(args.warmup, args.steps)

    class Timed(Trainer):
        init_sum: float | None = None

        def build_model(self) -> nn.Module:
            model = super().build_model()
            if self.init_sum is None:  # the training model (later builds count FLOPs on meta)
                self.init_sum = checksum(model)
            return model

        def build_hooks(self) -> list[HookBase]:
            trainer = self

            class Hook(HookBase):  # last: the step ends after the Trainer's own hooks
                def after_step(self, state: Any, result: Any) -> None:
                    if window.step_done(state.step):
                        loss, init = float(result.loss.item()), trainer.init_sum or 0.0
                        report(args, window, args.side, loss, init)

            return [*super().build_hooks(), Hook()]

    cfg = config(args, args.side)
    output_dir = Path(args.result).with_suffix("")
    # As the command line runs it (sdnet_trainer.cli.run): the process group, then the Trainer.
    with distributed_session(cfg.dist, output_dir=output_dir) as env:
        trainer = Timed(cfg, output_dir=output_dir, env=env)
        try:
            trainer.fit()
        finally:
            trainer.close()


def hand_model(args: argparse.Namespace, cfg: Any, side: str) -> tuple[nn.Module, list[nn.Module]]:
    """The bare model of a hand-written side and its FSDP units (before the root)."""
    from sdnet_trainer.models import build_model

    torch.manual_seed(SEED)
    llama: Any = build_model(cfg.model)
    if side == "hand":
        return llama, list(llama.blocks)
    import transformers

    from sdnet_trainer.models.llama.hf import hf_config_of, to_hf_name

    hf_config = transformers.LlamaConfig.from_dict(hf_config_of(llama, dtype=torch.float32))
    lm: Any = transformers.LlamaForCausalLM(hf_config)
    lm.load_state_dict({to_hf_name(k): v for k, v in llama.state_dict().items()})
    return lm, list(lm.model.layers)


def run_hand(args: argparse.Namespace) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler

    from sdnet_trainer.data import build_datasets

    dist.init_process_group("gloo")
    cfg = config(args, args.side)
    model, units = hand_model(args, cfg, args.side)
    init = checksum(model)
    for unit in units:
        fully_shard(unit)
    fully_shard(model, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True, **OPTIM)  # type: ignore[arg-type]
    train, _ = build_datasets(cfg.data)
    sampler: DistributedSampler = DistributedSampler(train, shuffle=True, seed=SEED, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch, sampler=sampler, drop_last=True)
    window, step, epoch, loss = Window(args.warmup, args.steps), 0, 0, torch.zeros(())
    model.train()
    while step <= window.last:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            out = model(inputs)
            logits = out.logits if args.side == "hf" else out
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if window.step_done(step):
                report(args, window, args.side, float(loss.item()), init)
            if step > window.last:
                break
        epoch += 1
    del model, optimizer, loader
    gc.collect()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ the driver


def flops_per_token(args: argparse.Namespace) -> float:
    from sdnet_trainer.models import build_model
    from sdnet_trainer.observability.flops import train_flops_per_sample

    cfg = config(args, "fsdp")
    tokens = torch.zeros((2, args.seq_len), dtype=torch.int64)

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())

    per_sample = train_flops_per_sample(lambda: build_model(cfg.model), (tokens, tokens), loss)
    return per_sample / args.seq_len


def matmul_gflops(seconds: float = 1.0, n: int = 512) -> float:
    """The fp32 matmul rate one thread reaches here: the best of a few timed bursts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        best = 0.0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            for _ in range(4):
                a @ b
            best = max(best, 4 * 2 * n**3 / (time.perf_counter() - start))
        return best / 1e9
    finally:
        torch.set_num_threads(threads)


def launch(args: argparse.Namespace, side: str, out: Path, round_: int) -> dict[str, Any]:
    result = out / f"r{round_}_{side}.json"
    cmd = torchrun(
        args.nproc,
        str(Path(__file__).resolve()),
        "--worker",
        f"--side={side}",
        f"--result={result}",
        f"--model={args.model}",
        f"--batch={args.batch}",
        f"--warmup={args.warmup}",
        f"--steps={args.steps}",
        f"--seq-len={args.seq_len}",
    )
    try:
        _, other = timed_launch(cmd, out / f"r{round_}_{side}.log", args.timeout)
    except LaunchError as err:
        return {"side": side, "error": str(err).splitlines()[0]}
    return {**json.loads(result.read_text()), "other_cores": other}


def table(
    args: argparse.Namespace, rounds: list[dict[str, dict[str, Any]]], flops: float, peak: float
) -> str:
    rows = [
        f"llama ({args.model}, seq_len {args.seq_len}, {args.batch} sequences per rank, "
        f"{args.nproc} processes): tokens/s, median of {len(rounds)} round(s) [min-max]",
        f"{'side':<6} {'tokens/s':>10} {'[min-max]':>20} {'x hand':>8} {'MFU':>7}  final loss",
    ]
    for side in args.sides:
        runs = [r[side] for r in rounds if "tokens_per_s" in r[side]]
        if not runs:
            errors = [r[side].get("error", "?") for r in rounds]
            rows.append(f"{side:<6} failed: {errors[0]}")
            continue
        rates = [r["tokens_per_s"] for r in runs]
        ratios = [
            r[side]["tokens_per_s"] / r["hand"]["tokens_per_s"]
            for r in rounds
            if "tokens_per_s" in r[side] and "tokens_per_s" in r.get("hand", {})
        ]
        ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
        median = statistics.median(rates)
        mfu = median * flops / (peak * 1e9 * args.nproc)
        span = f"[{min(rates):.0f}-{max(rates):.0f}]"
        rows.append(
            f"{side:<6} {median:>10.0f} {span:>20} {ratio:>8} {mfu:>6.1%}  "
            f"{runs[-1]['final_loss']:.3f}"
        )
    sums = {round(r[s]["init_checksum"], 3) for r in rounds for s in r if "init_checksum" in r[s]}
    if len(sums) > 1:
        rows.append(f"warning: the sides' initial weights differ (checksums {sorted(sums)})")
    other = [r[s].get("other_cores") for r in rounds for s in r]
    busy = max((o for o in other if o is not None), default=None)
    if busy is not None:
        rows.append(
            f"other processes used up to {busy:.2f} cores during a launch"
            + (": the figures reflect that contention" if busy > 0.25 else "")
        )
    rows.append(
        f"MFU: {flops:.3g} FLOPs per token (forward + backward) over {peak:.1f} GFLOP/s per "
        f"process ({'--peak-gflops' if args.peak_gflops else 'measured 1-thread fp32 matmul'})"
    )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--model", default="llama3_debug")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=64, help="the model config's seq_len")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--peak-gflops", type=float, default=None, help="per process")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # torchrun would take a --nproc after the script for its own
        args.nproc = int(os.environ.get("WORLD_SIZE", args.nproc))
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = set(args.sides) - set(SIDES)
    if unknown or not args.sides:
        parser.error(f"--sides: {sorted(unknown) or 'none'}; choose from {list(SIDES)}")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        (run_trainer if args.side in ("ddp", "fsdp") else run_hand)(args)
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_llm_"))
    out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p
    )
    flops = flops_per_token(args)
    peak = args.peak_gflops or matmul_gflops()
    before = os.getloadavg()
    rounds: list[dict[str, dict[str, Any]]] = []
    for round_ in range(1, args.rounds + 1):
        shift = (round_ - 1) % len(args.sides)
        order = args.sides[shift:] + args.sides[:shift]
        results = {side: launch(args, side, out, round_) for side in order}
        rounds.append(results)
        print(
            f"round {round_}: "
            + ", ".join(
                f"{s} {r['tokens_per_s']:.0f}" if "tokens_per_s" in r else f"{s} failed"
                for s, r in results.items()
            ),
            flush=True,
        )
    print(table(args, rounds, flops, peak))
    print(load_line(before, os.getloadavg()))
    print(f"logs and results: {out}")
    failed = any("error" in r for results in rounds for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
