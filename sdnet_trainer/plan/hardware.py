"""The figures the planner assumes of a rank: memory, FLOP/s and links.

Each comes from, in order: ``parallel.auto.*`` where the key is set, a calibration file written
on the machine (``python -m sdnet_trainer.plan.calibrate``), the datasheet of the GPU
``parallel.auto.gpu`` names (``runtime/gpus.py``), the device, or the documented defaults (nodes
of 8 H100/H200 SXM GPUs). Every rank of a launch plans alone, before the process group exists,
so each figure is one all ranks read alike: a GPU's total memory rather than its free memory (the
Trainer's check before allocating reads that), the host's total memory shared by the node's
ranks.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from sdnet_trainer.config import Config
from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.distributed.env import local_world_size_from_env
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.observability.flops import peak_tflops
from sdnet_trainer.plan.estimate import Hardware
from sdnet_trainer.runtime.gpus import GPU_NAMES, GPUS, peak_of
from sdnet_trainer.runtime.precision import DTYPES
from sdnet_trainer.training.fits import GIB

# A CPU rank's FLOP/s where nothing measured it (no spec sheet to read): about what one core's
# fp32 matmuls reach; python -m sdnet_trainer.plan.calibrate measures the machine's own.
CPU_FLOPS = 5e10
# Seconds a block's forward and backward take beyond their FLOPs, per micro-step, where neither
# parallel.auto.block_overhead_us nor a calibration says.
BLOCK_OVERHEAD = {"cuda": 100e-6, "cpu": 1e-3}
# Links where neither a key nor a calibration says: NVLink 4 (900 GB/s both ways), one
# 400 Gb/s NIC per GPU, 10 us per hop of a ring.
LINK_DEFAULTS = {"intra_node_gbps": 450.0, "inter_node_gbps": 50.0, "latency_us": 10.0}
# --plan without a launch: a node of 8 GPUs.
DEFAULT_RANKS_PER_NODE = 8
# The fields a calibration file may hold, and the keys of parallel.auto they stand for.
CALIBRATION_FIELDS = {
    "flops": "peak_tflops x efficiency",
    "intra_node_gbps": "intra_node_gbps",
    "inter_node_gbps": "inter_node_gbps",
    "latency_us": "latency_us",
    "block_overhead_us": "block_overhead_us",
}


def hardware(cfg: Config, device: torch.device, *, ranks_per_node: int | None = None) -> Hardware:
    """The figures for ranks on ``device`` (a launch's), or on ``parallel.auto.device``. The ranks
    per node: ``parallel.auto.ranks_per_node``, else ``ranks_per_node`` (what a command planning
    a launch elsewhere assumes), else the launch's own."""
    auto = cfg.parallel.auto
    calibration = read_calibration(auto.calibration) if auto.calibration else {}
    gpu = named_gpu(cfg)
    target = "cuda" if gpu else device.type if auto.device == "auto" else auto.device
    node = auto.ranks_per_node or ranks_per_node or _launch_ranks_per_node()
    here = device if device.type == target else None  # the device itself, where it is read
    memory, memory_source = _memory(cfg, target, here, node, gpu)
    flops, flops_source = _flops(cfg, target, here, calibration, gpu)
    shared = auto.shared_cores
    if shared is None:
        shared = target == "cpu" and node > _cores()
    links = {
        key: _figure(cfg, key, calibration, gpu)
        for key in ("intra_node_gbps", "inter_node_gbps", "latency_us")
    }
    (intra, _), (inter, _), (latency, _) = links.values()
    return Hardware(
        memory=int(memory * auto.memory_fraction),
        memory_source=f"{auto.memory_fraction:g} x {memory / GIB:.3g} GiB ({memory_source})",
        flops=flops,
        flops_source=flops_source,
        intra=intra * 1e9,
        inter=inter * 1e9,
        latency=latency * 1e-6,
        block_overhead=_block_overhead(cfg, target, calibration),
        ranks_per_node=node,
        time_shared=shared,
        links_source=_sources({key: source for key, (_, source) in links.items()}),
    )


def _sources(sources: dict[str, str]) -> str:
    """Where the link figures came from: once where they share a source, else per key."""
    if len(set(sources.values())) == 1:
        return next(iter(sources.values()))
    return ", ".join(f"{key} from {source}" for key, source in sources.items())


def named_gpu(cfg: Config) -> tuple[str, str] | None:
    """(the name, its row's key in runtime/gpus.py's table) for ``parallel.auto.gpu``, None where
    it is null; a name the table lacks is a ConfigError listing those it has."""
    auto = cfg.parallel.auto
    if auto.gpu is None:
        return None
    name = str(auto.gpu).strip().lower()
    check_choice("parallel.auto.gpu", name, sorted(GPU_NAMES))
    if auto.device == "cpu":
        raise ConfigError(
            f"parallel.auto.gpu={auto.gpu} plans GPUs, parallel.auto.device=cpu CPU ranks: drop "
            f"one of them (parallel.auto.gpu implies parallel.auto.device=cuda)"
        )
    return name, GPU_NAMES[name]


def _cores() -> int:
    """The node's processors (not this rank's affinity: a launcher that pins each rank to a few
    cores gives them the node's cores between them)."""
    return os.cpu_count() or 1


def _figure(
    cfg: Config, key: str, calibration: dict[str, float], gpu: tuple[str, str] | None
) -> tuple[float, str]:
    """``parallel.auto.KEY`` where set, else the calibration's, else the named GPU's, else the
    default (nodes of 8 H100/H200 SXM GPUs); and where it came from."""
    given = getattr(cfg.parallel.auto, key)
    if given is not None:
        return float(given), f"parallel.auto.{key}"
    if key in calibration:
        return calibration[key], "parallel.auto.calibration"
    datasheet = getattr(GPUS[gpu[1]], key, None) if gpu else None  # links; no latency there
    if gpu is not None and datasheet is not None:
        return float(datasheet), f"{gpu[0]} (parallel.auto.gpu)"
    return LINK_DEFAULTS[key], "the defaults: nodes of 8 H100/H200 SXM"


def _block_overhead(cfg: Config, target: str, calibration: dict[str, float]) -> float:
    given = cfg.parallel.auto.block_overhead_us
    if given is not None:
        return given * 1e-6
    if "block_overhead_us" in calibration:
        return calibration["block_overhead_us"] * 1e-6
    return BLOCK_OVERHEAD[target]


def _launch_ranks_per_node() -> int:
    ranks = local_world_size_from_env()
    return ranks if ranks > 0 else DEFAULT_RANKS_PER_NODE


def _memory(
    cfg: Config,
    target: str,
    device: torch.device | None,
    ranks_per_node: int,
    gpu: tuple[str, str] | None,
) -> tuple[int, str]:
    given = cfg.parallel.memory_per_rank_gib
    if given is not None:
        return int(given * GIB), "parallel.memory_per_rank_gib"
    if gpu is not None:
        return int(GPUS[gpu[1]].memory_gib * GIB), f"{gpu[0]}, parallel.auto.gpu"
    if target == "cuda":
        if device is None or not torch.cuda.is_available():
            raise ConfigError(
                "parallel.auto.device=cuda plans GPUs this machine does not have: name them "
                "with parallel.auto.gpu (h100, a100, ...) or set parallel.memory_per_rank_gib "
                "(the GPUs' memory, e.g. 80)"
            )
        return torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"
    total = _host_total()
    if total is None:
        raise ConfigError(
            "parallel=auto cannot read this host's memory (/proc/meminfo): set "
            "parallel.memory_per_rank_gib"
        )
    return total // ranks_per_node, f"the host's memory over {ranks_per_node} ranks"


def _host_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _flops(
    cfg: Config,
    target: str,
    device: torch.device | None,
    calibration: dict[str, float],
    gpu: tuple[str, str] | None,
) -> tuple[float, str]:
    auto = cfg.parallel.auto
    if auto.peak_tflops is not None:
        return auto.peak_tflops * 1e12 * auto.efficiency, "parallel.auto.peak_tflops x efficiency"
    if "flops" in calibration:
        return calibration["flops"], f"measured ({auto.calibration})"
    if target == "cpu":
        return CPU_FLOPS, "the CPU default (no calibration)"
    # The GPUs' own precision: precision=auto is bf16 on any GPU the planner is asked about.
    precision = "bf16" if cfg.precision.dtype == "auto" else cfg.precision.dtype
    if gpu is not None:
        name, model = gpu
        peak = peak_of(model, precision, tf32=cfg.precision.tf32)
        if peak is None:
            raise ConfigError(
                f"parallel.auto.gpu={name} has no dense {precision} peak on its datasheet "
                f"(precision.dtype={cfg.precision.dtype}): set parallel.auto.peak_tflops"
            )
        source = f"{peak:g} TFLOP/s {precision} peak of {name} (parallel.auto.gpu)"
        return peak * 1e12 * auto.efficiency, f"{source} x {auto.efficiency:g}"
    dtype = DTYPES[precision]
    peak = peak_tflops(device, dtype) if device is not None and torch.cuda.is_available() else None
    if peak is None:
        raise ConfigError(
            "parallel=auto knows no peak for these GPUs (not on this machine, or not in "
            "runtime/gpus.py's table): name them with parallel.auto.gpu, or set "
            "parallel.auto.peak_tflops (an H100 SXM's bf16: 989) or a calibration"
        )
    return peak * 1e12 * auto.efficiency, f"{peak:g} TFLOP/s peak x {auto.efficiency:g}"


def read_calibration(path: str) -> dict[str, float]:
    """A calibration file, read as untrusted input: known fields, positive finite numbers."""
    try:
        data: Any = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise ConfigError(f"parallel.auto.calibration={path}: cannot read it ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"parallel.auto.calibration={path}: expected a JSON object")
    out: dict[str, float] = {}
    for name, value in data.items():
        if name not in CALIBRATION_FIELDS:
            continue  # what the calibration records besides (the device, its commands)
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer past any float
                number = None
        if number is None or not math.isfinite(number) or number <= 0:
            raise ConfigError(
                f"parallel.auto.calibration={path}: {name} must be a positive finite number, "
                f"not {str(value)[:40]!r}"
            )
        out[name] = number
    return out


__all__ = [
    "CALIBRATION_FIELDS",
    "CPU_FLOPS",
    "DEFAULT_RANKS_PER_NODE",
    "LINK_DEFAULTS",
    "hardware",
    "read_calibration",
]
