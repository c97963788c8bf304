"""``parallel.auto.*``: what the planner of ``parallel=auto`` assumes (sdnet_trainer/plan/).

Kept beside schema.py, which holds every other group; ``ParallelConfig`` includes it from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class AutoLayoutConfig:
    """parallel=auto: what the planner (sdnet_trainer/plan/auto.py) assumes of the machines. The
    defaults describe nodes of 8 H100/H200 SXM GPUs on 400 Gb/s InfiniBand; on other machines
    measure them (python -m sdnet_trainer.plan.calibrate) and pass the file as calibration."""

    # What the planned ranks run on: auto (the launch's device; --plan: this machine's), cpu, or
    # cuda (GPUs planned from a machine without them: name them with parallel.auto.gpu, or set
    # parallel.memory_per_rank_gib and parallel.auto.peak_tflops).
    device: str = "auto"
    # The GPU the ranks run on, by name: h100, h200, a100, b200, mi300x, ... (runtime/gpus.py's
    # table; h100_pcie, h100_nvl for the other boards). It implies device=cuda, and its memory,
    # dense peak for the run's dtype and links stand where the keys below, a calibration and
    # parallel.memory_per_rank_gib say nothing. null: the device's own figures.
    gpu: Optional[str] = None
    # Ranks that share a node's fast links (NVLink); null: the launch's LOCAL_WORLD_SIZE (--plan and
    # --dry-run, which plan a launch elsewhere: 8).
    ranks_per_node: Optional[int] = None
    # CPU ranks that outnumber the node's cores take turns on them (no pipeline bubble is idle
    # time, no communication hides behind compute); null: whether they outnumber this machine's.
    shared_cores: Optional[bool] = None
    # The share of each rank's memory (parallel.memory_per_rank_gib, else the device's total) a
    # layout may fill with its counted bytes; the rest is the allocator's slack, communication
    # buffers and workspaces the count does not see.
    memory_fraction: float = 0.85
    # Dense peak TFLOPs of one device for the run's dtype; null: the calibration's measurement,
    # else the spec sheet's figure (runtime/gpus.py) for parallel.auto.gpu or the device.
    peak_tflops: Optional[float] = None
    # The share of the peak the model's matmuls reach (MFU before bubbles and communication).
    efficiency: float = 0.4
    # Bandwidth per rank, GB/s, in each direction: within a node and between nodes; null: the
    # calibration's, else parallel.auto.gpu's, else NVLink 4's 450 and one 400 Gb/s NIC per
    # GPU's 50.
    intra_node_gbps: Optional[float] = None
    inter_node_gbps: Optional[float] = None
    # Latency of one hop of a collective, microseconds (a ring of n ranks pays n - 1 of them);
    # null: the calibration's, else 10.
    latency_us: Optional[float] = None
    # Time one block's forward and backward cost beyond its FLOPs, microseconds per micro-step
    # (kernel launches, the framework's own work): what makes many small micro-batches slower
    # than a few large ones. null: 100 on GPUs, 1000 on the CPU.
    block_overhead_us: Optional[float] = None
    # A JSON file of measured constants (python -m sdnet_trainer.plan.calibrate): its figures
    # stand where the keys above are null.
    calibration: Optional[str] = None
    # Bounds on the degrees the planner tries (null: whatever the world and the model allow):
    # max_pp=1 keeps a model off pipeline stages, max_tp=8 tensor parallelism within a node.
    max_tp: Optional[int] = None
    max_pp: Optional[int] = None
    # Candidates shown in the plan's table.
    show: int = 5
