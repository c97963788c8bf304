"""parallel=auto on a GPU: the planner reads the device's total memory and its spec-sheet peak
(plan/hardware.py), and the calibration measures the GPU's own figures (plan/calibrate.py)."""

from __future__ import annotations

import json

import pytest
import torch

from sdnet_trainer.config import compose
from sdnet_trainer.plan import calibrate
from sdnet_trainer.plan.hardware import hardware, read_calibration
from tests.cuda.launches import LAUNCHES
from tests.support import assert_on_cuda

pytestmark = pytest.mark.cuda


def test_the_planner_reads_the_gpu(tmp_path, monkeypatch):
    device = torch.device("cuda", 0)
    assert_on_cuda(device)
    cfg = compose(LAUNCHES["plan_auto"].keys)
    hw = hardware(cfg, device)
    total = torch.cuda.get_device_properties(device).total_memory
    assert hw.memory == int(0.85 * total) and "cuda:0's memory" in hw.memory_source
    # A known GPU (A100, H100, H200...) plans with its bf16 peak; another with the CPU default.
    assert hw.flops > 0 and hw.ranks_per_node >= 1
    # The calibration, small: a decoder's forward and backward at two batch sizes on the GPU.
    monkeypatch.setitem(calibrate._SHAPES, "cuda", (512, 2, 256))
    out = tmp_path / "calibration.json"
    assert calibrate.main([f"out={out}"]) == 0
    record = json.loads(out.read_text())
    assert record["device"] == torch.cuda.get_device_name(device)
    measured = read_calibration(str(out))
    assert measured["flops"] > 1e12  # any GPU of this decade, in bf16
    assert measured["block_overhead_us"] > 0
