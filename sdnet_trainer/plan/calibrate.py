"""Measure the planner's constants on this machine: ``parallel.auto.calibration=FILE``.

    python -m sdnet_trainer.plan.calibrate out=calibration.json            # compute only
    torchrun --nproc_per_node=8 -m sdnet_trainer.plan.calibrate out=calibration.json
    ... device=cpu                                   # the CPU on a machine with GPUs (auto)

- ``flops``: FLOP/s one rank achieves in a decoder's forward and backward (the project's GPT, its
  FLOPs counted by ``FlopCounterMode``), with every rank of the launch computing at once, as in
  training (ranks that share cores or a GPU's power slow each other);
- ``block_overhead_us``: what one block's forward and backward cost beyond their FLOPs, from the
  same model at two batch sizes (a straight line through the times: its slope is the FLOPs'
  cost, its intercept the fixed cost);
- under torchrun on one node, ``intra_node_gbps`` and ``latency_us`` of its ranks: an
  all-reduce's bus bandwidth (``2 (n - 1) / n x bytes / seconds``), and a one-element
  all-reduce's time over its ``2 (n - 1)`` hops. Between nodes nothing is measured: set
  ``parallel.auto.inter_node_gbps``.

Each figure is the median of its rounds, agreed by the ranks (rank 0's file holds the slowest
rank's compute); the file also records the device and torch version it was measured with.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import DistConfig
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.distributed.env import local_world_size_from_env
from sdnet_trainer.distributed.ops import all_gather_objects
from sdnet_trainer.lazy import freeze_imports
from sdnet_trainer.models import build_model
from sdnet_trainer.observability.flops import count_flops

# The model measured: the GPT of configs/model/gpt_small.yaml's width, long enough sequences
# that its matmuls are the ones training runs; larger on a GPU.
_SHAPES = {"cpu": (256, 4, 128), "cuda": (2048, 8, 1024)}  # width, blocks, sequence
_HEAD_DIM = 128  # heads of a size the fused attention kernels take
_BATCHES = {"cpu": (2, 8), "cuda": (2, 8)}
_ROUNDS = 5


def main(argv: list[str] | None = None) -> int:
    args = dict(a.partition("=")[::2] for a in (sys.argv[1:] if argv is None else argv))
    out = Path(args.get("out", "calibration.json"))
    with distributed_session(DistConfig(device=args.get("device", "auto"))) as env:
        device = env.device
        record: dict[str, Any] = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "world_size": env.world_size,
        }
        record.update(_compute(device))
        if env.world_size > 1:
            if local_world_size_from_env() == env.world_size:  # one node: its own links
                record.update(_links(device, env.world_size))
            elif env.is_main:
                print("several nodes: links not measured (set parallel.auto.*_gbps)")
            record["flops"] = min(all_gather_objects(record["flops"]))  # a step waits for it
        if env.is_main:
            out.write_text(json.dumps(record, indent=1) + "\n")
            print(json.dumps(record, indent=1))
    return 0


def _median_seconds(fn: Callable[[], object], device: torch.device) -> float:
    fn()  # warm-up: allocations, kernels chosen
    times = []
    for _ in range(_ROUNDS):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compute(device: torch.device) -> dict[str, float]:
    width, blocks, seq = _SHAPES[device.type]
    cfg = compose(
        [
            "model=gpt_small",
            f"model.gpt.dim={width}",
            f"model.gpt.n_layers={blocks}",
            f"model.gpt.seq_len={seq}",
            f"model.gpt.n_heads={max(1, width // _HEAD_DIM)}",
        ]
    )
    model = build_model(cfg.model).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    points = []
    for batch in _BATCHES[device.type]:
        tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)

        def step(tokens: torch.Tensor = tokens) -> None:
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                model(tokens).float().sum().backward()

        flops = count_flops(step)
        points.append((flops, _median_seconds(step, device)))
    (f1, t1), (f2, t2) = points
    if t2 <= t1:  # timing noise larger than 4x the work: no slope to read, the plain rate
        return {"flops": f2 / t2, "block_overhead_us": 1.0}
    rate = (f2 - f1) / (t2 - t1)  # the slope: FLOPs' cost
    fixed = max(t1 - f1 / rate, 0.0)  # the intercept: what a micro-step costs beyond them
    return {"flops": rate, "block_overhead_us": max(fixed / blocks * 1e6, 1.0)}


def _links(device: torch.device, world_size: int) -> dict[str, float]:
    nbytes = 64 * 2**20 if device.type == "cuda" else 8 * 2**20
    big = torch.ones(nbytes // 4, device=device)
    one = torch.ones(1, device=device)
    seconds = _median_seconds(lambda: dist.all_reduce(big), device)
    tiny = _median_seconds(lambda: dist.all_reduce(one), device)
    hops = 2 * (world_size - 1)
    return {
        "intra_node_gbps": hops / world_size * nbytes / seconds / 1e9,
        "latency_us": tiny / hops * 1e6,
    }


if __name__ == "__main__":
    freeze_imports()  # a process of its own: see sdnet_trainer/lazy.py
    sys.exit(main())
