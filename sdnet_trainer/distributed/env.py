"""Where this process runs: rank, world size, device and backend, and the process group's lifetime.

A launch under torchrun (RANK/WORLD_SIZE/LOCAL_RANK in the environment) gets a process group;
``python -m sdnet_trainer`` runs as a single process without one. The device check for CUDA lives
here alone: every other module asks ``DistEnv.device``.

The group starts with ``dist.timeout_s`` (set-up and the first step may compile and read a large
checkpoint); ``shorten_timeout`` then drops it to ``dist.step_timeout_s`` so a hung collective
fails in minutes. An NCCL group also keeps NCCL's flight recorder (a ring buffer of each rank's
last collectives), dumped into the run directory when a collective times out.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import Config, DistConfig
from sdnet_trainer.distributed.malloc import pin_malloc_thresholds
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.runtime.signals import die_with_launcher

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cpu", "cuda")

# A CUDA group that must also run collectives on CPU tensors (FSDP's CPU-offloaded gradients, whose
# norm is an all-reduce of CPU DTensors): NCCL for CUDA tensors, gloo for CPU ones.
CUDA_WITH_CPU_BACKEND = "cuda:nccl,cpu:gloo"

# NCCL's flight recorder: how many collectives each rank remembers (about 1 KB each), and the
# folder of the run directory that receives one dump per rank when a collective times out.
FLIGHT_RECORDER_ENTRIES = 2000
FLIGHT_RECORDER_DIR = "nccl_flight_recorder"


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
    return torch.device("cuda", cuda_index(local_rank)) if use_cuda else torch.device("cpu")


def local_world_size_from_env() -> int:
    """torchrun's LOCAL_WORLD_SIZE, the ranks on this node (1 where no launcher says)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"LOCAL_WORLD_SIZE={value!r} is not an integer") from None


def one_gpu_per_task(local_rank: int) -> bool:
    """Whether this rank's node binds one GPU to each task: several ranks on the node, and this
    one (not the first) sees exactly one CUDA device. SLURM's ``--gpus-per-task=1`` /
    ``--gpu-bind`` and container runtimes do this by setting ``CUDA_VISIBLE_DEVICES`` per task,
    so the device is index 0 in every rank, whatever its LOCAL_RANK."""
    return local_rank > 0 and local_world_size_from_env() > 1 and torch.cuda.device_count() == 1


def cuda_index(local_rank: int) -> int:
    """The CUDA device index of this local rank: LOCAL_RANK, or 0 where each task is bound to
    one GPU of its own (see :func:`one_gpu_per_task`). Checked by :func:`check_local_rank`."""
    return 0 if one_gpu_per_task(local_rank) else local_rank


def resolve_backend(cfg: DistConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if device.type == "cuda" else "gloo"


def group_backend(backend: str, device: torch.device, *, cpu_collectives: bool) -> str:
    """The backend string the default group starts with: ``backend``, or NCCL for CUDA tensors
    plus gloo for CPU tensors when a CUDA run also reduces CPU tensors (``cpu_collectives``).
    On the CPU, or with gloo already, one backend serves both."""
    if cpu_collectives and device.type == "cuda" and backend == "nccl":
        return CUDA_WITH_CPU_BACKEND
    return backend


def check_local_rank(local_rank: int) -> None:
    """A CUDA rank needs a GPU of its own: one clear error instead of CUDA's "invalid device
    ordinal" at the first ``set_device``. A task bound to one GPU (exactly one visible, several
    ranks on the node) takes that one (see :func:`cuda_index`)."""
    count = torch.cuda.device_count()
    if cuda_index(local_rank) >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
        raise ConfigError(
            f"LOCAL_RANK={local_rank} needs GPU {local_rank}, but this machine shows "
            f"{count} CUDA device(s){shown}: start at most {count} process(es) per node "
            "(torchrun --nproc_per_node), bind one GPU to each task (CUDA_VISIBLE_DEVICES per "
            "rank, e.g. srun --gpus-per-task=1) or use dist.device=cpu"
        )


def enable_flight_recorder(
    output_dir: str | Path, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Turn on NCCL's flight recorder, dumping into ``output_dir/nccl_flight_recorder/rank_<R>``
    when a collective times out; returns the variables set. Must run before the NCCL group
    starts (torch reads them when it creates the group). Variables the user set are kept: a user
    who sized the buffer or chose the dump file keeps that choice."""
    env = os.environ if environ is None else environ
    dump_dir = Path(output_dir) / FLIGHT_RECORDER_DIR
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        # torch appends the rank to this prefix.
        "TORCH_FR_DUMP_TEMP_FILE": str(dump_dir / "rank_"),
    }
    # The dump file's older name, still read by torch: a user who set it has chosen the file.
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in env:
        del wanted["TORCH_FR_DUMP_TEMP_FILE"]
    chosen = {key: value for key, value in wanted.items() if key not in env}
    if "TORCH_FR_DUMP_TEMP_FILE" in chosen:
        dump_dir.mkdir(parents=True, exist_ok=True)
    env.update(chosen)
    return chosen


def shorten_timeout(
    seconds: float | None,
    *,
    mesh: DeviceMesh | None = None,
    groups: Iterable[dist.ProcessGroup] = (),
) -> None:
    """Set the timeout of the default group, of every group of ``mesh`` and of ``groups`` to
    ``seconds`` (``dist.step_timeout_s``; None keeps ``dist.timeout_s``). Call once after set-up
    and the first step, which may compile or read a checkpoint for longer; a collective that
    later waits this long fails (NCCL dumps its flight recorder) instead of waiting out the
    set-up timeout. No-op without a process group."""
    if seconds is None or not dist.is_initialized():
        return
    timeout = timedelta(seconds=seconds)
    targets = [dist.group.WORLD, *(mesh.get_all_groups() if mesh is not None else ()), *groups]
    seen: set[int] = set()
    for group in targets:
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        _set_timeout(group, timeout)
    logger.debug("process-group timeout now %g s", seconds)


def _set_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    # dist.set_timeout is the public name in recent torch; older releases have only the private
    # _set_pg_timeout.
    setter: Callable[[timedelta, dist.ProcessGroup], None] | None = getattr(
        dist, "set_timeout", None
    )
    if setter is None:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        setter = _set_pg_timeout
    setter(timeout, group)


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
    check_positive("dist.step_timeout_s", dist_cfg.step_timeout_s, allow_none=True)
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
        check_local_rank(local_rank)
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
def distributed_session(
    cfg: DistConfig, *, output_dir: str | Path | None = None, cpu_collectives: bool = False
) -> Iterator[DistEnv]:
    """Start the process group (when launched by torchrun) and always destroy it on the way out.
    Under torchrun the worker first binds its life to the agent's (``die_with_launcher``).

    ``output_dir``: the run directory, where an NCCL group's flight recorder dumps on a timeout
    (None: no flight recorder). ``cpu_collectives``: a CUDA run that also reduces CPU tensors
    (``parallel.fsdp.cpu_offload``) gets gloo beside NCCL. ``dist.device=cpu`` stays on the CPU
    whatever GPUs the machine has."""
    die_with_launcher()
    local_rank = local_rank_from_env()
    device = resolve_device(cfg, local_rank)
    if device.type == "cuda":
        check_local_rank(local_rank)  # validate_dist said so before launch; also for direct use
        if device.index != local_rank:
            logger.info(
                "LOCAL_RANK=%d sees one CUDA device (CUDA_VISIBLE_DEVICES=%r): one GPU per task, "
                "running on cuda:0",
                local_rank,
                os.environ.get("CUDA_VISIBLE_DEVICES"),
            )
        torch.cuda.set_device(device)
    elif cfg.pin_cpu_malloc:
        pin_malloc_thresholds()
    if "RANK" not in os.environ:
        yield DistEnv(device=device)
        return

    backend = group_backend(resolve_backend(cfg, device), device, cpu_collectives=cpu_collectives)
    if "nccl" in backend and output_dir is not None:
        enable_flight_recorder(output_dir)
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
