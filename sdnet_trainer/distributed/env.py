"""Where this process runs: rank, world size, device and backend, and the process group's lifetime.

A launch under torchrun (RANK/WORLD_SIZE/LOCAL_RANK in the environment) gets a process group;
``python -m sdnet_trainer`` runs as a single process without one. The device check for CUDA lives
here alone: every other module asks ``DistEnv.device``.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import Config, DistConfig
from sdnet_trainer.distributed.malloc import pin_malloc_thresholds
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.signals import die_with_launcher

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: no process group (a single plain process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def launched_world_size() -> int:
    """The world size torchrun announced, known before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_device(cfg: DistConfig, local_rank: int) -> torch.device:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")


def resolve_backend(cfg: DistConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if device.type == "cuda" else "gloo"


def local_rank_from_env() -> int:
    """torchrun's LOCAL_RANK (0 without torchrun)."""
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"LOCAL_RANK={value!r} is not an integer") from None


def validate_dist(cfg: Config) -> None:
    """``dist.*`` and the options that need a particular device, checked before launch on the
    machine that will run the ranks: the backend must suit the device ``dist.device`` resolves to
    here, and a CUDA rank needs a GPU of its own."""
    dist_cfg = cfg.dist
    check_choice("dist.backend", dist_cfg.backend, BACKENDS)
    check_choice("dist.device", dist_cfg.device, DEVICES)
    check_positive("dist.timeout_s", dist_cfg.timeout_s)
    if dist_cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "dist.device=cuda but this machine has no usable CUDA device "
            "(torch.cuda.is_available() is False); use dist.device=cpu or auto"
        )
    local_rank = local_rank_from_env()
    device = resolve_device(dist_cfg, local_rank)
    if dist_cfg.backend == "nccl" and device.type != "cuda":
        found = (
            "dist.device=cpu"
            if dist_cfg.device == "cpu"
            else f"dist.device={dist_cfg.device} resolved to {device.type}: "
            "torch.cuda.is_available() is False on this machine"
        )
        raise ConfigError(
            f"dist.backend=nccl needs CUDA devices, but {found}; use dist.backend=gloo "
            "(or auto) for CPU training"
        )
    backend = resolve_backend(dist_cfg, device)
    if "RANK" in os.environ and not _backend_available(backend):  # a group will start
        raise ConfigError(
            f"dist.backend={dist_cfg.backend} means {backend} on {device.type}, but this torch "
            f"build has no {backend} (torch.distributed.is_{backend}_available() is False)"
        )
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if local_rank >= count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            shown = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
            raise ConfigError(
                f"LOCAL_RANK={local_rank} needs GPU {local_rank}, but this machine shows "
                f"{count} CUDA device(s){shown}: start at most {count} process(es) per node "
                "(torchrun --nproc_per_node) or use dist.device=cpu"
            )
    if cfg.parallel.sync_batchnorm and device.type != "cuda":
        raise ConfigError(
            "parallel.sync_batchnorm=true needs CUDA devices (torch's SyncBatchNorm runs "
            "only on GPUs); on the CPU keep it false"
        )


def _backend_available(backend: str) -> bool:
    if not dist.is_available():
        return False
    return dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()


@contextmanager
def distributed_session(cfg: DistConfig) -> Iterator[DistEnv]:
    """Start the process group (when launched by torchrun) and always destroy it on the way out.
    Under torchrun the worker first binds its life to the agent's (``die_with_launcher``)."""
    die_with_launcher()
    local_rank = local_rank_from_env()
    device = resolve_device(cfg, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif cfg.pin_cpu_malloc:
        pin_malloc_thresholds()
    if "RANK" not in os.environ:
        yield DistEnv(device=device)
        return

    backend = resolve_backend(cfg, device)
    timeout = timedelta(seconds=cfg.timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun's agent keeps one store across worker restarts; without a per-attempt prefix a
    # restarted rank can read a dead rank's address left by the previous attempt and fail to
    # connect.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"sdnet/attempt_{attempt}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    env = DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=backend,
    )
    logger.debug(
        "process group up: rank %d/%d on %s (%s)", env.rank, env.world_size, device, backend
    )
    try:
        yield env
    finally:
        # A DistributedDataParallel still alive when its group is destroyed can abort the process
        # at exit ("terminate called without an active exception"); collect dropped wrappers first.
        gc.collect()
        dist.destroy_process_group()
