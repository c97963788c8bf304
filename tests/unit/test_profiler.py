"""StepProfiler on the CPU: traces and the operator table for a few steps of a tiny model."""

from __future__ import annotations

import gzip
import json
import logging

import torch
from torch import nn

from sdnet_trainer.config.schema import ProfileConfig
from sdnet_trainer.observability.profiler import StepProfiler, untraced_steps

CPU = torch.device("cpu")


def _train(profiler: StepProfiler, steps: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with profiler:
        for _ in range(steps):
            nn.functional.cross_entropy(
                model(torch.randn(4, 8)), torch.zeros(4, dtype=torch.long)
            ).backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.step()


def _traces(directory):
    return sorted(directory.glob("*.pt.trace.json")) + sorted(directory.glob("*.pt.trace.json.gz"))


def _events(path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_a_window_of_steps_gives_a_trace_per_rank_and_a_table_of_aten_ops(tmp_path, caplog):
    cfg = ProfileConfig(enabled=True, wait=1, warmup=1, active=2, repeat=1, top_k=5)
    profiler = StepProfiler(cfg, output_dir=tmp_path, rank=0, device=CPU)
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.observability.profiler"):
        _train(profiler, steps=6)
    traces = _traces(tmp_path / "profile")
    assert len(traces) == 1 and traces[0].name.startswith("rank0."), traces
    names = {event.get("name") for event in _events(traces[0])}
    assert "aten::addmm" in names  # the Linear layers' forward
    # Only the active steps, 2 and 3 (0-based): step 0 waited, step 1 warmed up, 4 and 5 came after.
    assert {n for n in names if n and n.startswith("ProfilerStep#")} == {
        "ProfilerStep#2",
        "ProfilerStep#3",
    }
    table = profiler.summary_table()
    assert table is not None and "aten::" in table and "Self CPU" in table
    assert (
        len([line for line in table.splitlines() if line.strip().startswith("aten::")]) <= cfg.top_k
    )
    assert "top 5 operators by self CPU time" in caplog.text
    assert "memory" not in caplog.text  # memory_snapshot is off


def test_other_ranks_write_their_own_traces_but_log_no_table(tmp_path, caplog):
    cfg = ProfileConfig(enabled=True, wait=0, warmup=1, active=1, memory_snapshot=True)
    profiler = StepProfiler(cfg, output_dir=tmp_path, rank=3, device=CPU)
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.observability.profiler"):
        _train(profiler, steps=3)
    assert [t.name.split(".")[0] for t in _traces(tmp_path / "profile")] == ["rank3"]
    assert profiler.summary_table() is None  # the table is built on rank 0 only
    assert "operators" not in caplog.text
    # The allocator history exists only on CUDA: skipped, and said so.
    assert "memory_snapshot skipped" in caplog.text
    assert not list((tmp_path / "profile").glob("memory_rank*.pickle"))


def test_a_run_that_ends_inside_the_active_window_still_writes_it(tmp_path):
    cfg = ProfileConfig(enabled=True, wait=1, warmup=1, active=10)
    profiler = StepProfiler(cfg, output_dir=tmp_path, rank=0, device=CPU)
    _train(profiler, steps=4)
    assert len(_traces(tmp_path / "profile")) == 1
    assert profiler.summary_table() is not None


def test_disabled_is_a_no_op(tmp_path):
    profiler = StepProfiler(ProfileConfig(enabled=False), output_dir=tmp_path, rank=0, device=CPU)
    _train(profiler, steps=4)
    assert not (tmp_path / "profile").exists()
    assert profiler.summary_table() is None


def test_on_cuda_the_first_steps_are_never_traced():
    # cuDNN autotuning and start-up happen in step 1: at least 2 steps precede the first active one.
    assert untraced_steps(ProfileConfig(wait=0, warmup=0), "cuda") == 2
    assert untraced_steps(ProfileConfig(wait=0, warmup=1), "cuda") == 1
    assert untraced_steps(ProfileConfig(wait=1, warmup=1), "cuda") == 0
    assert untraced_steps(ProfileConfig(wait=3, warmup=1), "cuda") == 0
    assert untraced_steps(ProfileConfig(wait=0, warmup=0), "cpu") == 0


def test_the_schedule_skips_the_untraced_steps(tmp_path, monkeypatch):
    # The CPU run with the CUDA rule forced on: step 0 skipped, step 1 warm-up, 2 and 3 recorded.
    monkeypatch.setattr(
        "sdnet_trainer.observability.profiler.untraced_steps", lambda cfg, device_type: 1
    )
    cfg = ProfileConfig(enabled=True, wait=0, warmup=1, active=2)
    profiler = StepProfiler(cfg, output_dir=tmp_path, rank=0, device=CPU)
    _train(profiler, steps=6)
    (trace,) = _traces(tmp_path / "profile")
    names = {event.get("name") for event in _events(trace)}
    assert {n for n in names if n and n.startswith("ProfilerStep#")} == {
        "ProfilerStep#2",
        "ProfilerStep#3",
    }
