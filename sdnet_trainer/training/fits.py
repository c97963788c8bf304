"""Before a rank allocates its part of the model: does its training state fit?

A layout that cannot fit would otherwise be found out by the allocator, minutes in, or by the
kernel's OOM killer on every rank of the node at once. The Trainer builds the model on the meta
device and shards it, so the bytes of this rank's shards are known before anything exists:
:func:`check_fits` counts them as the dry run does (``observability.memory``: parameters,
gradients, and the optimizer's state, found by one step of the configured optimizer on a meta
tensor) and compares them with the memory the rank has (:func:`available_bytes`). The count is
a floor, not a forecast: activations, communication buffers and the allocator's slack come on
top, so a refused layout cannot run, and an accepted one may still need more.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sdnet_trainer.config.schema import Config
from sdnet_trainer.distributed.env import local_world_size_from_env
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.observability.memory import local_bytes, step_on_meta, training_state_bytes
from sdnet_trainer.training.optim import build_optimizer

logger = logging.getLogger(__name__)

GIB = 2**30
_PROBE = 256  # elements of the meta parameter the optimizer steps on
_CGROUP = Path("/sys/fs/cgroup")


def optimizer_bytes_per_element(cfg: Config) -> float:
    """Bytes of optimizer state per parameter element (AdamW: two fp32 moments, 8): one step of
    ``optim.*`` on a meta parameter. An optimizer that cannot step on meta tensors counts 0."""
    probe = nn.Linear(_PROBE, 1, bias=False, device="meta")
    try:
        optimizer = build_optimizer(probe, cfg.optim)
        step_on_meta(probe, optimizer)
    except Exception as err:  # a custom optimizer; the check then counts weights and gradients
        logger.debug("optimizer state not counted before allocating: %s", err)
        return 0.0
    return training_state_bytes(probe, optimizer)["optim"] / _PROBE


def required_bytes(parts: list[nn.Module], cfg: Config, *, dp: int) -> dict[str, int]:
    """This rank's training state from its parts on the meta device (their local shards):
    parameters, gradients, optimizer state (ZeRO-1 keeps 1/dp of it)."""
    params = list({id(p): p for part in parts for p in part.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    elements = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainable)
    optim = elements * optimizer_bytes_per_element(cfg)
    if cfg.parallel.strategy == "zero1":
        optim /= max(dp, 1)
    return {"params": local_bytes(params), "grads": local_bytes(trainable), "optim": int(optim)}


def available_bytes(cfg: Config, device: torch.device) -> tuple[int, str] | None:
    """The memory this rank may fill, and where it was read; None where it cannot be read.

    ``parallel.memory_per_rank_gib`` when set; else a GPU's free memory, or, on the CPU and for
    FSDP's CPU offload (parameters, gradients and optimizer state live on the host), the host's
    available memory (``MemAvailable``, and the cgroup's limit where lower) divided by the
    node's ranks (torchrun's ``LOCAL_WORLD_SIZE``)."""
    given = cfg.parallel.memory_per_rank_gib
    if given is not None:
        return int(given * GIB), f"parallel.memory_per_rank_gib={given}"
    on_host = device.type != "cuda" or cfg.parallel.fsdp.cpu_offload
    if not on_host:
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    host = _host_available()
    if host is None:
        return None
    ranks = max(local_world_size_from_env(), 1)
    share = "" if ranks == 1 else f", shared by the node's {ranks} ranks"
    return host // ranks, f"the host's available memory{share}"


def _host_available() -> int | None:
    """MemAvailable, or what the cgroup (v2) still allows where that is less."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    available = None
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit != "max" and available is not None:
            used = int((_CGROUP / "memory.current").read_text())
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available


def check_fits(parts: list[nn.Module], cfg: Config, device: torch.device, *, dp: int) -> None:
    """Refuse, before allocating, a layout whose training state on this rank exceeds its memory,
    with the figure and the keys that would change it."""
    room = available_bytes(cfg, device)
    if room is None:
        return
    limit, where = room
    need = required_bytes(parts, cfg, dp=dp)
    total = sum(need.values())
    logger.debug("training state %s of %s (%s)", in_units(total), in_units(limit), where)
    if total <= limit:
        return
    parts_text = ", ".join(f"{name} {in_units(value)}" for name, value in need.items())
    raise ConfigError(
        f"this rank's training state needs {in_units(total)} ({parts_text}) before any "
        f"activation, more than its {in_units(limit)} ({where}): spread the model over more "
        f"ranks (more processes, parallel=fsdp, parallel.tp, parallel.pp), keep the state on the "
        f"host (parallel.fsdp.cpu_offload=true), shard the optimizer (parallel=zero1), or use a "
        f"smaller model"
    )


def in_units(size: float) -> str:
    """Bytes as GiB from 1 GiB up, else MiB, to two decimals."""
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / 2**20:.2f} MiB"


__all__ = [
    "available_bytes",
    "check_fits",
    "in_units",
    "optimizer_bytes_per_element",
    "required_bytes",
]
