"""Loader throughput and resume latency of the three ways to read a folder of JPEG images:
the ImageFolder itself, its tar shards on local disk, and the same shards over HTTP.

What it measures
    The product's own path: ``build_imagefolder`` / ``build_shards`` (training transforms: the
    data.augment preset for --crop, JPEG decode included) and the training loader
    (``sdnet_trainer.data.loader.train_loader``: the global-index sampler, per-sample seeding,
    DataLoader workers), one rank, batches of --batch-size, on the CPU.

    samples/s: one pass over the epoch with --workers loader workers, counted from the first
    batch to the last (worker start-up and the first batch apart), wall clock; per worker: that
    divided by the workers; per CPU s: samples per second of the workers' CPU time (their
    rusage, read when they exit), which holds on a machine shared with other work.

    first batch s: from creating the loader's iterator to holding its first batch, at the
    start of the epoch and after ``set_start_sample`` at --resume-at of it (as a run resumed
    there does), with one worker. A resume jumps: the two are equal; replaying would add about
    --resume-at x the epoch's time (printed beside them as "epoch s", a whole pass with the
    first --workers count, its start-up included).

    The images are generated: --images JPEGs of --width x --height (smooth colour fields plus
    noise, quality 90) in 4 class folders; shards of --shard-size images by the converter. The
    HTTP server is aiohttp's static file handler (range requests) in a process of its own on
    127.0.0.1, so it does not share this process's interpreter lock with the loader.

    Each round measures every source, each in a fresh process of its own (no source inherits
    another's open files or HTTP sessions into its workers), in alternating order (forward, then
    backward, ...; the two first-batch positions too), so a drift in the machine's load hits
    them alike; the figures are medians over --rounds. The machine's load average before and
    after is printed: on a shared machine figures move with it.

Run (from the repository root)
    OMP_NUM_THREADS=1 python scripts/bench/bench_data.py                         # about a minute
    OMP_NUM_THREADS=1 python scripts/bench/bench_data.py --images 1024 --workers 1 2 4 --rounds 5

Exit status 0 with the table printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _launch import load_line  # scripts/ is on sys.path when run as a script
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.folders import build_imagefolder
from sdnet_trainer.data.loader import shutdown_loader, train_loader
from sdnet_trainer.data.shards import build_shards, convert

SOURCES = ("imagefolder", "shards", "http")
CLASSES = 4


def write_images(root: Path, count: int, *, width: int, height: int, seed: int = 0) -> None:
    """``count`` training JPEGs over CLASSES class folders, and one validation image per class
    (the converter wants both splits)."""
    rng = np.random.default_rng(seed)

    def image(path: Path) -> None:
        coarse = rng.uniform(0, 255, size=(6, 8, 3)).astype(np.uint8)
        field = np.asarray(
            Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.float32
        )
        pixels = np.clip(field + rng.normal(0, 12, field.shape), 0, 255).astype(np.uint8)
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(path, quality=90)

    for i in range(count):
        image(root / "train" / f"c{i % CLASSES}" / f"{i:05d}.jpg")
    for c in range(CLASSES):
        image(root / "val" / f"c{c}" / "0.jpg")


# --------------------------------------------------------------------------------------------
# The HTTP server, in its own process
# --------------------------------------------------------------------------------------------


def _serve(directory: str, ports: multiprocessing.Queue) -> None:
    from aiohttp import web

    async def run() -> None:
        app = web.Application()
        app.router.add_static("/", directory, show_index=True)  # listings for fsspec's glob
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        ports.put(sock.getsockname()[1])
        await asyncio.Event().wait()  # until terminated

    asyncio.run(run())


def start_server(directory: Path) -> tuple[str, multiprocessing.process.BaseProcess]:
    context = multiprocessing.get_context("spawn")
    ports: multiprocessing.Queue = context.Queue()
    server = context.Process(target=_serve, args=(str(directory), ports), daemon=True)
    server.start()
    return f"http://127.0.0.1:{ports.get(timeout=60)}", server


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def make_loader(
    dataset: Dataset, *, workers: int, batch_size: int
) -> tuple[Callable[[int], Iterator[Any]], DataLoader]:
    """(a function that starts an iterator at an epoch position, the loader)."""
    cfg = DataConfig(num_workers=workers, persistent_workers=False, pin_memory=False)
    loader, sampler = train_loader(
        dataset,
        cfg=cfg,
        device_type="cpu",
        micro_batch_size=batch_size,
        grad_accum_steps=1,
        dp_size=1,
        dp_rank=0,
        seed=0,
    )

    def start(position: int) -> Iterator[Any]:
        sampler.set_epoch(0)
        sampler.set_start_sample(position)
        return iter(loader)

    return start, loader


def epoch_pass(dataset: Dataset, *, workers: int, batch_size: int) -> tuple[float, float, float]:
    """(samples/s after the first batch, samples per worker CPU second, epoch seconds)."""
    start, loader = make_loader(dataset, workers=workers, batch_size=batch_size)
    cpu_before = _children_cpu_s()
    began = time.perf_counter()
    batches = start(0)
    first = next(batches)
    after_first = time.perf_counter()
    samples = 0
    for inputs, _ in batches:
        samples += len(inputs)
    ended = time.perf_counter()
    del first
    shutdown_loader(loader)  # the workers exit and are reaped: their rusage is counted now
    worker_cpu = _children_cpu_s() - cpu_before
    total = samples + batch_size
    return samples / (ended - after_first), total / worker_cpu, ended - began


def first_batch_s(dataset: Dataset, *, position: int, batch_size: int) -> float:
    start, loader = make_loader(dataset, workers=1, batch_size=batch_size)
    began = time.perf_counter()
    batches = start(position)
    next(batches)
    elapsed = time.perf_counter() - began
    del batches  # stops its worker: after the clock, not inside it
    shutdown_loader(loader)
    return elapsed


def measure(source: str, root: str, args: argparse.Namespace, *, deep: int) -> dict[str, Any]:
    """Every figure of one source, in this process: the epoch pass per worker count, then the
    first batch at the start and deep in the epoch (in the order --deep-first says)."""
    name = "imagefolder" if source == "imagefolder" else "shards"
    build = build_imagefolder if name == "imagefolder" else build_shards
    dataset, _ = build(DataConfig(name=name, root=root, image_size=args.crop))
    rates = {
        workers: epoch_pass(dataset, workers=workers, batch_size=args.batch_size)
        for workers in args.workers
    }
    positions = [("start", 0), ("deep", deep)]
    firsts = {
        label: first_batch_s(dataset, position=position, batch_size=args.batch_size)
        for label, position in (positions[::-1] if args.deep_first else positions)
    }
    return {"rates": rates, "firsts": firsts}


def run_source(source: str, root: str, args: argparse.Namespace, *, deep_first: bool) -> dict:
    """``measure`` in a fresh process: no source inherits another's state (open files, HTTP
    sessions, warmed caches) into its loader workers."""
    command = [sys.executable, __file__, "--measure", source, "--root", root, "--deep-first"]
    command = command if deep_first else command[:-1]
    options = ["--images", "--crop", "--batch-size", "--resume-at"]
    for option in options:
        command += [option, str(getattr(args, option[2:].replace("-", "_")))]
    command += ["--workers", *map(str, args.workers)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"measuring {source} failed:\n{done.stdout}{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--width", type=int, default=224)
    parser.add_argument("--height", type=int, default=168)
    parser.add_argument("--crop", type=int, default=128, help="data.image_size")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--shard-size", type=int, default=128)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--resume-at", type=float, default=0.9, help="fraction of the epoch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the temporary data goes")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per measurement")
    # Internal: one source's measurement, in the process the driver starts for it.
    parser.add_argument("--measure", choices=SOURCES, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--deep-first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.images < 2 * args.batch_size:
        parser.error("--images must hold at least two batches")
    if not 0 <= args.resume_at < 1:
        parser.error("--resume-at must be in [0, 1)")
    return args


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    steps = args.images // args.batch_size
    deep = int(steps * args.resume_at) * args.batch_size
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.root, args, deep=deep)))
        return 0
    load_before = os.getloadavg()
    print(
        f"bench_data: {args.images} JPEGs of {args.width}x{args.height}, crop {args.crop}, "
        f"batch {args.batch_size}, shards of {args.shard_size}, workers {args.workers}, "
        f"{args.rounds} round(s); torch {torch.__version__}, {os.cpu_count()} CPUs",
        flush=True,
    )
    results: dict[str, list[dict]] = {source: [] for source in SOURCES}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_data_") as tmp:
        folder, shards = Path(tmp) / "folder", Path(tmp) / "shards"
        write_images(folder, args.images, width=args.width, height=args.height)
        convert(folder, shards, shard_size=args.shard_size)
        url, server = start_server(shards)
        try:
            roots = {"imagefolder": str(folder), "shards": str(shards), "http": url}
            for round_ in range(args.rounds):
                forward = round_ % 2 == 0
                for source in SOURCES if forward else SOURCES[::-1]:
                    measured = run_source(source, roots[source], args, deep_first=not forward)
                    results[source].append(measured)
                print(f"round {round_ + 1} done", flush=True)
        finally:
            server.terminate()
            server.join(timeout=10)
    load_after = os.getloadavg()

    median = statistics.median
    print()
    header = f"{'source':<12} {'workers':>7} {'samples/s':>10} {'per worker':>10} {'per CPU s':>10}"
    print(header)
    print("-" * len(header))
    for source in SOURCES:
        for workers in args.workers:
            runs = [r["rates"][str(workers)] for r in results[source]]  # JSON keys are strings
            wall = median(r[0] for r in runs)
            print(
                f"{source:<12} {workers:>7} {wall:>10.0f} {wall / workers:>10.0f} "
                f"{median(r[1] for r in runs):>10.0f}"
            )
    print()
    header = (
        f"{'source':<12} {'first batch s (start)':>21} {'first batch s (deep)':>20} "
        f"{f'epoch s ({args.workers[0]} worker)':>18}"
    )
    print(header)
    print("-" * len(header))
    for source in SOURCES:
        runs = results[source]
        epoch_s = median(r["rates"][str(args.workers[0])][2] for r in runs)
        print(
            f"{source:<12} {median(r['firsts']['start'] for r in runs):>21.3f} "
            f"{median(r['firsts']['deep'] for r in runs):>20.3f} {epoch_s:>18.2f}"
        )
    epoch = steps * args.batch_size
    print(
        f"deep: sample {deep} of the {epoch} of the epoch ({deep / epoch:.0%}); medians of "
        f"{args.rounds} round(s), each source measured in a fresh process"
    )
    print(load_line(load_before, load_after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
