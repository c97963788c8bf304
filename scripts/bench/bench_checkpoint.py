"""How long a checkpoint save blocks the training loop, async against sync, and how fast
checkpoints are written and read back, on the local disk and in object storage (S3).

What it measures
    One process, no process group (DCP's single-process path), the product's own
    ``sdnet_trainer.checkpoint.CheckpointManager``: a model of about --params parameters (a stack
    of square linear layers, fp32; on the CPU, or --device cuda) with AdamW, its optimizer state
    materialised, saved as the Checkpointer saves it (model + optimizer state dicts through
    torch's state-dict helpers). The loop trains for --gap seconds (forward, backward, AdamW
    step on a small batch, which changes every tensor in place) between saves, as a run with
    timed checkpoints does, then saves.

    blocked: the wall time of ``CheckpointManager.save`` (what the loop waits for). Sync: the
    whole write, checksums and commit. Async: copying the state into the host staging memory.
    The first save of a manager is reported apart: async allocates its staging memory there
    (later saves reuse it; a later round's first save may get memory the process freed before,
    so round 1's first save is the cold figure); the median, min and max are over the other
    saves.
    waited: an async save first waits for the previous one to be committed (one save in flight);
    that wait, timed apart here (``wait()`` called just before ``save``), is the median over the
    saves after the first. It is zero when the write fits in the gap between saves; when it does
    not, the loop is blocked for blocked + waited.
    write MB/s: checkpoint bytes over the time from the start of ``save`` to the commit (the
    manager's "saved" log line), whether the loop waited for it (sync) or not (async).
    read MB/s: ``CheckpointManager.load`` of the newest checkpoint into the live state (resharding
    planner, restricted unpickling), after the round; from the page cache, as the checkpoint was
    just written.

    Stores (--stores): disk, a temporary folder; s3, a prefix in an S3 bucket (--s3-url), by
    default on a local S3 server this script starts in a process of its own (moto's
    ``moto_server``, a test dependency) on 127.0.0.1: the protocol's cost (HTTP, one object per
    shard, the manifest's PUT as the commit) without a network's. --endpoint points --s3-url at
    another S3 API (MinIO, R2); credentials come from the environment.

    Each round runs every store and mode, each with a fresh manager and folder, in an order
    rotated from round to round, so a drift in the machine's load hits all of them. The
    machine's load average before and after is printed: on a shared machine figures move with it.

Run (from the repository root)
    python scripts/bench/bench_checkpoint.py                      # small smoke size, about a minute
    python scripts/bench/bench_checkpoint.py --params 100e6 --gap 10 --saves 4 --rounds 2
    python scripts/bench/bench_checkpoint.py --params 100e6 --gap 10 --saves 3 --rounds 2 \
        --stores disk,s3                           # the disk against a local S3 server
    python scripts/bench/bench_checkpoint.py --params 1e9 --gap 30 --device cuda   # on a GPU

Exit status 0 with the table printed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from _launch import load_line  # scripts/ is on sys.path when run as a script
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import sdnet_trainer.checkpoint as checkpoint_module
from sdnet_trainer.checkpoint import CheckpointManager
from sdnet_trainer.checkpoint.files import Folder, folder_of
from sdnet_trainer.checkpoint.objects import ObjectFolder

MB = 1e6


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--params",
        type=float,
        default=10e6,
        help="model parameters (default 10e6; the figure in the issue is 100e6)",
    )
    p.add_argument("--width", type=int, default=1024, help="width of the linear layers")
    p.add_argument(
        "--gap", type=float, default=2.0, help="seconds of training between saves (default 2)"
    )
    p.add_argument("--saves", type=int, default=3, help="saves per mode and round (default 3)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of both modes (default 1)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per training step")
    p.add_argument(
        "--device",
        default="cpu",
        help="where the model trains (default cpu; cuda: async saves stage into pinned memory)",
    )
    p.add_argument(
        "--dir", type=Path, default=None, help="where checkpoints go (default: a new temp dir)"
    )
    p.add_argument("--stores", default="disk", help="comma-separated: disk, s3 (default disk)")
    p.add_argument(
        "--s3-url",
        default=None,
        help="s3://bucket/prefix for the s3 store (default: a bucket on a local S3 server)",
    )
    p.add_argument("--endpoint", default=None, help="the S3 API of --s3-url (MinIO, R2, ...)")
    args = p.parse_args()
    args.stores = args.stores.split(",")
    if not args.stores or not set(args.stores) <= {"disk", "s3"}:
        p.error("--stores takes disk and s3")
    if args.params < args.width:
        p.error("--params must be at least --width")
    if args.saves < 2:
        p.error("--saves must be at least 2: the first save is reported apart")
    if args.rounds < 1 or args.gap < 0 or args.batch_size < 1 or args.width < 1:
        p.error("--rounds, --batch-size and --width must be >= 1 and --gap >= 0")
    return args


class Model(nn.Module):
    def __init__(self, params: int, width: int) -> None:
        super().__init__()
        self.width = width
        layers = max(1, round(params / (width * width + width)))
        self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@dataclass
class Run:
    """One mode of one round: what each save blocked and took until committed, one load."""

    blocked: list[float] = field(default_factory=list)
    waited: list[float] = field(default_factory=list)  # for the previous save, before each save
    committed: list[float] = field(default_factory=list)  # save start to commit, seconds
    nbytes: int = 0
    load_s: float = math.nan


class _Commits(logging.Handler):
    """Collects (MB, seconds) from the manager's "checkpoint step N saved to ... (MB, s)" line."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[tuple[int, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if str(record.msg).startswith("checkpoint step %d saved to") and isinstance(args, tuple):
            step, seconds = cast(int, args[0]), cast(float, args[3])
            self.seen.append((step, seconds))


def train_for(seconds: float, model: Model, optimizer: torch.optim.Optimizer, batch: int) -> None:
    """Training steps until ``seconds`` have passed (at least one)."""
    end = time.monotonic() + seconds
    device = next(model.parameters()).device
    while True:
        x = torch.randn(batch, model.width, device=device)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if time.monotonic() >= end:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # queued steps are training time, not the save's


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }


def run_mode(
    async_save: bool,
    folder: Folder,
    model: Model,
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
    commits: _Commits,
) -> Run:
    run = Run()
    manager = CheckpointManager(
        folder, keep_last=1, async_save=async_save, rank=0, world_size=1, run_id="bench"
    )
    commits.seen.clear()
    step = 0
    try:
        for _ in range(args.saves):
            train_for(args.gap, model, optimizer, args.batch_size)
            step += 1
            sd = state(model, optimizer)
            started = time.perf_counter()
            manager.wait()
            staged = time.perf_counter()
            manager.save(step, sd)
            run.waited.append(staged - started)
            run.blocked.append(time.perf_counter() - staged)
            del sd
        manager.wait()
        run.committed = [seconds for _, seconds in sorted(commits.seen)]
        latest = manager.latest()
        assert latest is not None and latest.step == step, "the last save was not committed"
        if isinstance(latest.path, ObjectFolder):
            run.nbytes = sum(latest.path.listing()[0].values())
        else:
            run.nbytes = sum(p.stat().st_size for p in latest.path.iterdir())
        target = state(model, optimizer)
        started = time.perf_counter()
        manager.load(latest, target)
        run.load_s = time.perf_counter() - started
    finally:
        manager.close()
    return run


def fmt_s(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f}" if values else "    n/a"


def table(runs: dict[tuple[str, str], list[Run]], args: argparse.Namespace) -> str:
    header = (
        f"{'store':<5} {'mode':<6} {'saves':>5} {'first s':>8} {'median s':>9} {'min s':>7} "
        f"{'max s':>7} {'waited s':>8} {'write MB/s':>10} {'read MB/s':>9} {'MB':>7}"
    )
    lines = [header, "-" * len(header)]
    for (store, mode), rs in runs.items():
        first = [r.blocked[0] for r in rs]
        rest = [b for r in rs for b in r.blocked[1:]]
        waited = [w for r in rs for w in r.waited[1:]]
        nbytes = statistics.median(r.nbytes for r in rs)
        write = [nbytes / MB / s for r in rs for s in r.committed if s > 0]
        read = [r.nbytes / MB / r.load_s for r in rs if r.load_s > 0]
        lines.append(
            f"{store:<5} {mode:<6} {len(rs) * args.saves:>5} {statistics.median(first):8.3f} "
            f"{statistics.median(rest):9.3f} {min(rest):7.3f} {max(rest):7.3f} "
            f"{statistics.median(waited):8.3f} "
            f"{statistics.median(write) if write else math.nan:10.1f} "
            f"{statistics.median(read) if read else math.nan:9.1f} {nbytes / MB:7.1f}"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def s3_prefix(args: argparse.Namespace) -> Iterator[str]:
    """Where the s3 store's checkpoints go: --s3-url, or a new bucket on a local S3 server started
    here (``moto_server``, in its own process: the server's work does not share this process's
    interpreter), stopped at the end; --endpoint is set to it."""
    if args.s3_url:
        yield args.s3_url.rstrip("/")
        return
    beside = Path(sys.executable).parent / "moto_server"  # this environment's, first
    server = str(beside) if beside.exists() else shutil.which("moto_server")
    if server is None:
        sys.exit("bench_checkpoint: --stores s3 without --s3-url needs moto[server] installed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [server, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        args.endpoint = f"http://127.0.0.1:{port}"
        # The local server takes any credentials; the SDK needs some.
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"bench_checkpoint: the local S3 server did not start ({server})")
            time.sleep(0.1)
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        ObjectFolder.of(f"s3://{bucket}", {"endpoint_url": args.endpoint}).fs.mkdir(bucket)
        print(f"s3 store: a local S3 server (moto_server) at {args.endpoint}, bucket {bucket}")
        yield f"s3://{bucket}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    args = parse_args()
    # DCP says on every save and load that it assumes one process: this is one, on purpose.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.manual_seed(0)
    model = Model(int(args.params), args.width).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_for(0, model, optimizer, args.batch_size)  # one step: AdamW's state exists
    n_params = sum(p.numel() for p in model.parameters())
    commits = _Commits()
    logging.getLogger(checkpoint_module.__name__).addHandler(commits)
    logging.getLogger(checkpoint_module.__name__).setLevel(logging.INFO)

    load_before = os.getloadavg()
    print(
        f"bench_checkpoint: {n_params / 1e6:.1f}M parameters + AdamW (fp32), {args.saves} saves "
        f"per mode and round, {args.gap:g} s of training between saves, {args.rounds} round(s); "
        f"on {args.device}; torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}; {checkpoint_module.__file__}",
        flush=True,
    )
    combos = [(store, mode) for store in args.stores for mode in ("sync", "async")]
    runs: dict[tuple[str, str], list[Run]] = {combo: [] for combo in combos}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(
            tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_checkpoint_")
        )
        s3 = stack.enter_context(s3_prefix(args)) if "s3" in args.stores else None
        for round_ in range(args.rounds):
            # A rotated order each round: sync/async and the stores each go first in turn.
            shift = round_ % len(combos)
            for store, mode in combos[shift:] + combos[:shift]:
                where = f"r{round_}_{mode}"
                folder = Path(tmp) / where if store == "disk" else f"{s3}/{where}"
                run = run_mode(
                    mode == "async",
                    folder_of(folder, {"endpoint_url": args.endpoint} if args.endpoint else {}),
                    model,
                    optimizer,
                    args,
                    commits,
                )
                runs[store, mode].append(run)
                print(
                    f"round {round_ + 1} {store:>4} {mode:>5}: blocked "
                    + " ".join(f"{b:.3f}" for b in run.blocked)
                    + " s; waited "
                    + " ".join(f"{w:.3f}" for w in run.waited)
                    + " s; committed after "
                    + " ".join(f"{c:.2f}" for c in run.committed)
                    + f" s; load {run.load_s:.3f} s",
                    flush=True,
                )
    load_after = os.getloadavg()
    print()
    print(table(runs, args))
    print(
        "blocked: seconds save() held the loop (first save of a manager apart; median, min, max "
        "of the rest); waited: median seconds the loop waited for the previous save to commit "
        "before the next one could start"
    )
    print(load_line(load_before, load_after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
