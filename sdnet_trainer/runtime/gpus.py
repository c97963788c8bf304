"""The GPUs this project knows: each one's dense peak TFLOPs by precision, memory and links.

One table for its two readers: a run's MFU (``observability/flops.py``: the peak of the math a run
does on the GPU torch names) and the planner of ``parallel=auto`` (``plan/hardware.py``: what a
rank of the GPU ``parallel.auto.gpu`` names has, planned from a machine without it). It lives in
``runtime/``, the layer both build on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    # Dense (no 2:4 sparsity) peak tensor-core TFLOPs by the precision of the matmul inputs
    # ("tf32": fp32 matmuls and convolutions on tensor cores, precision.tf32; "fp32": the plain FP32
    # pipeline). Spec sheets print the sparse figure for tensor cores: halved here. A precision
    # without a figure gets no peak (no MFU rather than one against the wrong peak).
    peaks: Mapping[str, float]
    # Memory of one GPU, GiB: the datasheet's GB (HBM and GDDR sizes are binary); the driver's few
    # hundred MiB come out of parallel.auto.memory_fraction's slack. The larger where a part comes
    # in two sizes (A100 40/80 GB, V100 16/32 GB: set parallel.memory_per_rank_gib for the other).
    memory_gib: float
    # GB/s per GPU in each direction within a node: NVLink (or AMD's Infinity Fabric) on the SXM
    # and OAM boards, the PCIe slot on cards (a bridge joining pairs of cards is not a node's ring).
    intra_node_gbps: float
    # GB/s per GPU in each direction between nodes, where the part's servers have a usual network
    # (NVIDIA's DGX/HGX and the clouds' 8-GPU nodes: one NIC per GPU); None where they do not.
    inter_node_gbps: float | None = None
    # TF32 tensor cores (Ampere and later, CDNA3): fp32 matmuls run on them when precision.tf32.
    # Before Ampere, and on CDNA2, fp32 runs on the FP32 pipeline whatever the TF32 flags say.
    tf32: bool = True


# Datasheet figures; a link's is its total over both directions, halved.
GPUS: dict[str, Gpu] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 and PCIe, 40 and 80 GB alike): BF16/FP16 312,
    # TF32 156, FP32 19.5; NVLink 3 600 GB/s (SXM4); DGX A100: a 200 Gb/s HDR NIC per GPU.
    "A100": Gpu({"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 80, 300, 25),
    # NVIDIA H100 datasheet: H100 SXM BF16/FP16 1,979*, TF32 989*, FP32 67; H100 NVL 1,671*,
    # 835*, 60; H100 PCIe (earlier datasheet) 1,513*, 756*, 51 (* with sparsity). SXM: 80 GB,
    # NVLink 4 900 GB/s, DGX H100 a 400 Gb/s NIC per GPU; NVL 94 GB, PCIe Gen5 x16 (128 GB/s).
    "H100 SXM": Gpu({"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}, 80, 450, 50),
    "H100 NVL": Gpu({"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}, 94, 64),
    "H100 PCIe": Gpu({"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}, 80, 64),
    # NVIDIA H800 datasheet (the H100 with FP64 and NVLink cut for export; its tensor and FP32
    # figures are the H100's): H800 SXM BF16/FP16 1,979*, TF32 989*, FP32 67, NVLink 400 GB/s;
    # H800 PCIe 1,513*, 756*, 51.
    "H800 SXM": Gpu({"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}, 80, 200, 50),
    "H800 PCIe": Gpu({"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}, 80, 64),
    # NVIDIA H200 datasheet: H200 SXM as H100 SXM (1,979* / 989* / 67), 141 GB, NVLink 900 GB/s;
    # H200 NVL as H100 NVL, 141 GB, PCIe Gen5 x16.
    "H200": Gpu({"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}, 141, 450, 50),
    "H200 NVL": Gpu({"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}, 141, 64),
    # NVIDIA HGX B200 datasheet: FP16/BF16 36 PFLOPS* and TF32 18 PFLOPS* for 8 GPUs, 1,440 GB,
    # NVLink 5 1.8 TB/s per GPU; DGX B200: a 400 Gb/s NIC per GPU.
    "B200": Gpu({"bf16": 2250.0, "fp16": 2250.0, "tf32": 1125.0}, 180, 900, 50),
    # NVIDIA L4 datasheet: BF16/FP16 242*, TF32 120*, FP32 30.3; 24 GB, PCIe Gen4 x16.
    "L4": Gpu({"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}, 24, 32),
    # NVIDIA L40S datasheet: BF16/FP16 362.05 | 733*, TF32 183 | 366*, FP32 91.6; 48 GB, Gen4.
    "L40S": Gpu({"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}, 48, 32),
    # NVIDIA L40 datasheet: BF16/FP16 181.05 | 362.1*, TF32 90.5 | 181*, FP32 90.5; 48 GB, Gen4.
    "L40": Gpu({"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5}, 48, 32),
    # NVIDIA A10 datasheet: BF16/FP16 125 | 250*, TF32 62.5 | 125*, FP32 31.2; 24 GB, Gen4.
    "A10": Gpu({"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}, 24, 32),
    # A10G (AWS G5): NVIDIA publishes no datasheet; 70 dense BF16/FP16 and 31.52 FP32 are the
    # figures AWS partners quote (fewer tensor TFLOPs than the A10); 24 GB. Override when known
    # better.
    "A10G": Gpu({"bf16": 70.0, "fp16": 70.0, "fp32": 31.52}, 24, 32),
    # NVIDIA V100 datasheet: tensor 125 (SXM2) / 112 (PCIe) / 130 (V100S), FP32 15.7 / 14 / 16.4;
    # 32 GB (or 16); NVLink 2 300 GB/s (SXM2), PCIe Gen3 x16. Volta's tensor cores have no bf16
    # (torch emulates it): no bf16 peak.
    "V100 SXM2": Gpu({"fp16": 125.0, "fp32": 15.7}, 32, 150, tf32=False),
    "V100 PCIe": Gpu({"fp16": 112.0, "fp32": 14.0}, 32, 16, tf32=False),
    "V100S PCIe": Gpu({"fp16": 130.0, "fp32": 16.4}, 32, 16, tf32=False),
    # NVIDIA T4 datasheet: mixed precision (FP16/FP32) 65, FP32 8.1; no bf16; 16 GB, PCIe Gen3.
    "T4": Gpu({"fp16": 65.0, "fp32": 8.1}, 16, 16, tf32=False),
    # NVIDIA Ada GPU architecture whitepaper, RTX 4090: FP16/BF16 tensor with FP32 accumulate
    # 165.2 | 330.4*, TF32 82.6 | 165.2*, FP32 82.6; 24 GB, PCIe Gen4.
    "RTX 4090": Gpu({"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}, 24, 32),
    # NVIDIA Ampere GA102 whitepaper, RTX 3090: FP16/BF16 tensor with FP32 accumulate 71 | 142*,
    # TF32 35.6 | 71*, FP32 35.6; 24 GB, PCIe Gen4.
    "RTX 3090": Gpu({"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}, 24, 32),
    # AMD Instinct MI300X / MI325X datasheets: FP16/BF16 1307.4 (2614.9 with sparsity), TF32
    # 653.7, FP32 163.4; 192 / 256 GB; Infinity Fabric 896 GB/s per GPU on the 8-GPU platform.
    "MI300X": Gpu({"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}, 192, 448, 50),
    "MI325X": Gpu({"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}, 256, 448, 50),
    # AMD Instinct MI250X datasheet: FP16/BF16 383, FP32 matrix 95.7; 128 GB; no TF32; Infinity
    # Fabric 800 GB/s per OAM.
    "MI250X": Gpu({"bf16": 383.0, "fp16": 383.0, "fp32": 95.7}, 128, 400, tf32=False),
}

# torch.cuda.get_device_name() -> GPUS key; first match wins, so variants come before the plain
# name ("NVIDIA H100 PCIe" before "NVIDIA H100 80GB HBM3", the SXM part).
_DEVICE_PATTERNS: list[tuple[str, str]] = [
    (r"H100.*PCIe", "H100 PCIe"),
    (r"H100.*NVL", "H100 NVL"),
    (r"H100|GH200", "H100 SXM"),
    (r"H800.*PCIe", "H800 PCIe"),
    (r"H800(?!.*NVL)", "H800 SXM"),  # "NVIDIA H800" is the SXM part; an NVL variant is unknown
    (r"H200.*NVL", "H200 NVL"),
    (r"H200", "H200"),
    (r"B200", "B200"),
    (r"A100|A800", "A100"),  # the A800 is the A100 with NVLink cut for export
    (r"A10G", "A10G"),
    (r"\bA10\b", "A10"),
    (r"L40S", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"V100S", "V100S PCIe"),
    (r"V100.*PCIE", "V100 PCIe"),
    (r"V100", "V100 SXM2"),
    (r"\bT4\b", "T4"),
    (r"RTX 4090", "RTX 4090"),
    (r"RTX 3090(?! Ti)", "RTX 3090"),
    (r"MI300X", "MI300X"),
    (r"MI325X", "MI325X"),
    (r"MI250X", "MI250X"),
]

# parallel.auto.gpu's names: each row's in lower case with "_" for spaces (h100_sxm, rtx_4090),
# and the plain name of a part for its SXM board, the one multi-node training runs on.
GPU_NAMES: dict[str, str] = {
    **{key.lower().replace(" ", "_"): key for key in GPUS},
    "h100": "H100 SXM",
    "h800": "H800 SXM",
    "v100": "V100 SXM2",
}


def device_model(name: str) -> str | None:
    """The GPUS key for a device name as torch reports it, or None if unknown."""
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return key
    return None


def peak_of(model: str, precision: str, *, tf32: bool) -> float | None:
    """Dense peak TFLOPs of GPU ``model`` (a GPUS key) for matmuls in ``precision`` (bf16, fp16,
    fp32): fp32 on TF32 tensor cores where ``tf32`` and the GPU has them. None where the
    datasheet gives no figure."""
    gpu = GPUS[model]
    key = "tf32" if precision == "fp32" and tf32 and gpu.tf32 else precision
    return gpu.peaks.get(key)


__all__ = ["GPUS", "GPU_NAMES", "Gpu", "device_model", "peak_of"]
