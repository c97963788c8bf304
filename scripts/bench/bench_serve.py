"""Serving throughput and latency, with dynamic batching on and off, on loopback.

What it measures
    Two models, each trained for a few steps first (the figures do not depend on how well they
    predict): the quickstart recipe's CNN (32x32 images, 10 classes) and ``model=gpt_tiny`` on
    ``data=tokens`` (context 32, vocabulary 64). Each is served by ``python -m
    sdnet_trainer.serve`` twice, one process at a time on the CPU: batching off
    (``max_batch_size=1``) and on (``max_batch_size=32 max_wait_ms=5``). Against each server,
    a fixed number of requests (--requests) is sent at each concurrency (1, 8, 32 clients, each
    a thread with its own keep-alive connection, taking the next request when its last one is
    answered), after a few warm-up requests. The CNN gets a 32x32 PNG upload (multipart), the
    GPT a prompt of 8 token ids to continue by --new-tokens tokens (greedy).

    req/s: requests over the wall time of the whole level; p50 / p99: per-request latency (the
    client's time from sending to the full response). on/off: batching on over off, for req/s.

    The server and the clients share the machine's cores (both run one torch thread,
    OMP_NUM_THREADS=1); on a shared machine the figures move with its load, printed at the end.

Run (from the repository root)
    python scripts/bench/bench_serve.py                       # about two minutes on 2 CPU cores
    python scripts/bench/bench_serve.py --requests 256 --concurrency 1,8,32,64

Exit status 0 with the table printed.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _launch import REPO, run_launch  # scripts/ is on sys.path when run as a script
from PIL import Image

from sdnet_trainer.serve.client import Client, Reply, ServerProcess

TRAIN = {
    "quickstart": ["+recipe=quickstart", "loop.max_steps=10", "loop.eval_every_n_steps=10"],
    "gpt_tiny": ["model=gpt_tiny", "data=tokens", "optim=adamw", "loop.max_steps=10"],
}
COMMON = ["dist.device=cpu", "checkpoint.every_n_steps=10", "loop.eval_at_epoch_end=false"]
MODES = {"off": ["max_batch_size=1"], "on": ["max_batch_size=32", "max_wait_ms=5"]}
WARMUP = 4


@dataclass(frozen=True)
class Level:
    rate: float  # requests per second
    p50_ms: float
    p99_ms: float


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=96, help="requests per level (default 96)")
    p.add_argument(
        "--concurrency", default="1,8,32", help="clients at once, comma-separated (default 1,8,32)"
    )
    p.add_argument(
        "--new-tokens", type=int, default=16, help="tokens the GPT generates per request"
    )
    p.add_argument("--models", default="quickstart,gpt_tiny", help="which of the two to run")
    p.add_argument("--workdir", default=None, help="where the runs go (default: a temp folder)")
    return p.parse_args()


def train(name: str, workdir: Path) -> Path:
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "sdnet_trainer", *TRAIN[name], *COMMON]
    run_launch([*cmd, f"hydra.run.dir={run_dir}"], workdir / f"{name}.log", timeout=300)
    return run_dir / "checkpoints"


def request_factory(name: str, new_tokens: int) -> Callable[[Client, int], Reply]:
    if name == "quickstart":
        pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        png = buffer.getvalue()
        return lambda client, i: client.post_file("/v1/predict", png)
    return lambda client, i: client.post_json(
        "/v1/predict",
        {"prompt": [(i + k) % 64 for k in range(8)], "max_new_tokens": new_tokens},
    )


def run_level(url: str, send: Callable[[Client, int], Reply], requests: int, clients: int) -> Level:
    """``requests`` requests from ``clients`` threads, each taking the next one when free."""
    latencies: list[float] = []
    failures: list[str] = []
    counter = iter(range(requests))
    lock = threading.Lock()

    def worker() -> None:
        client = Client(url)
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                break
            started = time.perf_counter()
            reply = send(client, i)
            elapsed = time.perf_counter() - started
            with lock:
                latencies.append(elapsed)
                if reply.status != 200:
                    failures.append(f"{reply.status} {reply.detail}")
        client.close()

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    wall = time.perf_counter() - started
    if failures or len(latencies) != requests:
        raise RuntimeError(f"{len(failures)} failed requests, e.g. {failures[:1]}")
    ms = sorted(x * 1000 for x in latencies)
    return Level(requests / wall, statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))])


def bench_model(
    name: str, checkpoint: Path, args: argparse.Namespace, levels: list[int]
) -> dict[str, dict[int, Level]]:
    send = request_factory(name, args.new_tokens)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    results: dict[str, dict[int, Level]] = {}
    for mode, options in MODES.items():
        server = ServerProcess(
            [f"checkpoint={checkpoint}", "device=cpu", *options], env=env, cwd=REPO
        )
        with server:
            warm = Client(server.url)
            for i in range(WARMUP):
                send(warm, i)
            warm.close()
            results[mode] = {c: run_level(server.url, send, args.requests, c) for c in levels}
        print(f"  {name}: batching {mode} done", flush=True)
    return results


def table(all_results: dict[str, dict[str, dict[int, Level]]], levels: list[int]) -> str:
    head = (
        "| model | clients | off req/s | off p50 ms | off p99 ms | on req/s | on p50 ms | "
        "on p99 ms | on/off req/s |"
    )
    rows = [head, "|" + "---|" * 9]
    for name, results in all_results.items():
        for c in levels:
            off, on = results["off"][c], results["on"][c]
            rows.append(
                f"| {name} | {c} | {off.rate:.1f} | {off.p50_ms:.1f} | {off.p99_ms:.1f} | "
                f"{on.rate:.1f} | {on.p50_ms:.1f} | {on.p99_ms:.1f} | {on.rate / off.rate:.2f} |"
            )
    return "\n".join(rows)


def main() -> int:
    args = parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(TRAIN))
    if unknown:
        print(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(TRAIN)}")
        return 2
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_serve_", dir=args.workdir) as tmp:
        results: dict[str, Any] = {}
        for name in models:
            print(f"training {name} for a few steps ...", flush=True)
            checkpoint = train(name, Path(tmp))
            results[name] = bench_model(name, checkpoint, args, levels)
    print(
        f"\n{args.requests} requests per level; GPT: 8-token prompts, {args.new_tokens} new "
        f"tokens; batching on: max_batch_size=32 max_wait_ms=5; off: max_batch_size=1\n"
    )
    print(table(results, levels))
    print(f"\nload average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
