"""Worker for tests/cuda/test_gpu_correctness_cuda.py: one rank under torchrun on one GPU (NCCL).

    python -m torch.distributed.run --standalone --nproc_per_node=1 _gpu_correctness_worker.py \
        OUT KEY=V...

The session is the one of the config the overrides compose (the test passes
``tests/cuda/launches.py``'s ``nccl_group``: dist.device=cuda, dist.timeout_s=300), opened with
``cpu_collectives`` (NCCL + gloo).

Saves what the test checks to OUT/results.pt:

1. ``cpu_offload``: the group started with ``cpu_collectives`` (NCCL + gloo); FSDP2 with
   CPUOffloadPolicy computes on the GPU and leaves CPU DTensor gradients, whose global norm (an
   all-reduce of CPU tensors) matches a plain model's.
2. ``flight_recorder``: the NCCL variables the session set, pointing into OUT.
3. ``shorten_timeout``: the NCCL default group and the mesh's groups take the step timeout (read
   back from each group's NCCL backend) and still run collectives.
4. ``release``: ``GradientComm.release`` lets a CUDA DDP model go.
5. ``recorded``: what NCCL's flight recorder holds after all of the above (its JSON dump): the
   collectives this rank issued, which a timeout would dump into OUT.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import CommConfig
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.distributed.comm import GradientComm
from sdnet_trainer.distributed.env import shorten_timeout
from sdnet_trainer.distributed.grad_norm import global_grad_norm
from sdnet_trainer.lazy import freeze_imports

FLIGHT_RECORDER_KEYS = (
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_FR_DUMP_TEMP_FILE",
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _cpu_offload(device: torch.device) -> dict[str, Any]:
    reference = _model().to(device)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cuda", (1,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    x, y = torch.randn(16, 8, device=device), torch.randint(0, 4, (16,), device=device)
    out = model(x)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(reference(x), y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = global_grad_norm(grads, device=device)
    want = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    return {
        # Where the offloaded model computed: its inputs and outputs (its parameters rest on the
        # CPU between uses, by design).
        "compute_devices": sorted({str(x.device), str(out.device)}),
        "grad_devices": sorted({g.device.type for g in grads}),
        "norm": float(norm),
        "reference": float(want),
        "backend": str(dist.get_backend()),
    }


def _timeout_s(group: dist.ProcessGroup) -> float:
    """The timeout a group's NCCL backend applies to its collectives now."""
    return group._get_backend(torch.device("cuda")).options._timeout.total_seconds()


def _shorten(device: torch.device) -> dict[str, Any]:
    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("a", "b"))
    groups = {"world": dist.group.WORLD, "a": mesh.get_group("a"), "b": mesh.get_group("b")}
    before = {name: _timeout_s(group) for name, group in groups.items()}
    shorten_timeout(30.0, mesh=mesh)
    after = {name: _timeout_s(group) for name, group in groups.items()}
    value = torch.ones(1, device=device)
    dist.all_reduce(value)
    dist.all_reduce(value, group=mesh.get_group("b"))
    torch.cuda.synchronize()
    return {"value": float(value), "device": str(value.device), "before": before, "after": after}


def _release(device: torch.device) -> dict[str, Any]:
    ddp = DistributedDataParallel(_model().to(device))
    model_device = str(next(ddp.parameters()).device)
    comm = GradientComm(ddp, CommConfig(hook="fp16"))
    alive = weakref.ref(ddp)
    del ddp
    gc.collect()
    before = alive() is not None
    comm.release()
    gc.collect()
    return {
        "kept_before_release": before,
        "kept_after_release": alive() is not None,
        "model_device": model_device,
    }


def _recorded() -> dict[str, Any]:
    """The flight recorder's entries so far (its JSON dump, without stack traces)."""
    dump = torch._C._distributed_c10d._dump_nccl_trace_json(
        includeCollectives=True, onlyActive=False
    )
    entries = json.loads(dump).get("entries", [])
    return {
        "entries": len(entries),
        "names": sorted({str(entry.get("profiling_name")) for entry in entries}),
    }


def main(out_dir: Path, overrides: list[str]) -> None:
    cfg = compose(overrides).dist
    with distributed_session(cfg, output_dir=out_dir, cpu_collectives=True) as env:
        results = {
            "flight_recorder": {k: os.environ.get(k) for k in FLIGHT_RECORDER_KEYS},
            "cpu_offload": _cpu_offload(env.device),
            "shorten_timeout": _shorten(env.device),
            "release": _release(env.device),
        }
        results["recorded"] = _recorded()
        torch.save(results, out_dir / "results.pt")


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main(Path(sys.argv[1]), sys.argv[2:])
