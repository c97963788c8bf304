"""What the machine under one rank is doing: process CPU and memory, host memory, and on CUDA the
rank's GPU (utilization, memory, power, temperature).

Read at log points only (``HardwareSampler.sample``), never per step or per scrape. The process
and host figures come from psutil; the GPU figures from NVIDIA's management library (NVML,
the ``nvidia-ml-py`` package), which is absent on most CPU machines: a missing library, a
machine without a driver, a GPU that does not report one figure (power on some boards,
utilization on a MIG slice) are all normal, and each leaves out only what it cannot read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reading:
    """One figure: the Prometheus metric it becomes, its labels beyond the run's identity, and
    its value in the metric's base unit (bytes, seconds, watts, a 0-1 ratio)."""

    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


# name: help. The names follow Prometheus' conventions: base units, a unit suffix, no _total
# (these are readings of the moment, not counters).
HARDWARE_METRICS = {
    "sdnet_process_cpu_usage_ratio": (
        "CPU time of this rank's process per wall-clock second since the previous log point "
        "(1 = one core busy)."
    ),
    "sdnet_process_resident_memory_bytes": "Resident set size of this rank's process.",
    "sdnet_host_memory_total_bytes": "Physical memory of the host.",
    "sdnet_host_memory_available_bytes": "Memory of the host available to new processes.",
}
GPU_METRICS = {
    "sdnet_gpu_utilization_ratio": (
        "Fraction of the last sample period in which a kernel ran on this rank's GPU."
    ),
    "sdnet_gpu_memory_used_bytes": "Memory in use on this rank's GPU, all processes.",
    "sdnet_gpu_memory_total_bytes": "Memory of this rank's GPU.",
    "sdnet_gpu_power_watts": "Power draw of this rank's GPU.",
    "sdnet_gpu_temperature_celsius": "Core temperature of this rank's GPU.",
}


class HardwareSampler:
    """Readings for the rank on ``device``; :meth:`close` releases NVML."""

    def __init__(self, device: torch.device) -> None:
        self._process = psutil.Process()
        # cpu_percent measures from the previous call: this first one starts the first window.
        self._process.cpu_percent(interval=None)
        self._gpu = _NvmlDevice.open(device) if device.type == "cuda" else None

    def sample(self) -> list[Reading]:
        host = psutil.virtual_memory()
        readings = [
            Reading(
                "sdnet_process_cpu_usage_ratio", self._process.cpu_percent(interval=None) / 100
            ),
            Reading("sdnet_process_resident_memory_bytes", float(self._process.memory_info().rss)),
            Reading("sdnet_host_memory_total_bytes", float(host.total)),
            Reading("sdnet_host_memory_available_bytes", float(host.available)),
        ]
        if self._gpu is not None:
            readings += self._gpu.sample()
        return readings

    def close(self) -> None:
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None


class _NvmlDevice:
    """The NVML handle of one CUDA device, found by its UUID: NVML numbers the GPUs physically,
    torch after ``CUDA_VISIBLE_DEVICES``, so the index alone would name the wrong GPU."""

    def __init__(self, nvml: Any, handle: Any, index: str) -> None:
        self._nvml = nvml
        self._handle = handle
        self._labels = {"gpu": index}
        self._unreadable: set[str] = set()

    @classmethod
    def open(cls, device: torch.device) -> _NvmlDevice | None:
        try:
            import pynvml as nvml
        except ImportError:
            logger.warning(
                "no GPU figures for Prometheus: nvidia-ml-py is not installed "
                "(pip install 'sdnet_trainer[monitor]')"
            )
            return None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as error:
            logger.warning("no GPU figures for Prometheus: NVML did not start (%s)", error)
            return None
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            if not uuid.startswith(("GPU-", "MIG-")):
                uuid = f"GPU-{uuid}"  # torch prints the bare UUID, NVML names it GPU-<uuid>
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            index = str(nvml.nvmlDeviceGetIndex(handle))
        except (nvml.NVMLError, RuntimeError, AttributeError) as error:
            logger.warning(
                "no GPU figures for Prometheus: NVML has no handle for %s (%s)", device, error
            )
            _shutdown(nvml)
            return None
        return cls(nvml, handle, index)

    def sample(self) -> list[Reading]:
        nvml = self._nvml
        readers = {
            "sdnet_gpu_utilization_ratio": lambda h: (
                nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100
            ),
            "sdnet_gpu_memory_used_bytes": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used,
            "sdnet_gpu_memory_total_bytes": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).total,
            "sdnet_gpu_power_watts": lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000,  # mW
            "sdnet_gpu_temperature_celsius": lambda h: nvml.nvmlDeviceGetTemperature(
                h, nvml.NVML_TEMPERATURE_GPU
            ),
        }
        readings = []
        for name, read in readers.items():
            if name in self._unreadable:
                continue
            try:
                readings.append(Reading(name, float(read(self._handle)), self._labels))
            except nvml.NVMLError as error:
                # Not supported on this board (or the GPU is gone): stop asking, say it once.
                self._unreadable.add(name)
                logger.info("GPU figure %s unavailable: %s", name, error)
        return readings

    def close(self) -> None:
        _shutdown(self._nvml)


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        pass
