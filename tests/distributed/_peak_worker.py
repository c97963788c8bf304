"""Measures each rank's peak CPU memory through the real Trainer, one case per config.

    torchrun --standalone --nproc_per_node=N tests/distributed/_peak_worker.py OUT CASES_JSON
    python tests/distributed/_peak_worker.py OUT CASES_JSON    (one process)

CASES_JSON maps a case name to its config overrides. Every case is built and trained inside
``torch.profiler.profile(profile_memory=True)``, from before the Trainer exists (data, model,
gradients, optimizer state, activations, logits, FSDP's gather and reduce-scatter buffers) to the
end of ``fit``; the peak is the highest running total of the profile's CPU allocations and frees
(``memory_peak``). Rank 0 writes ``OUT/<name>.json``: a list of per-rank records (``measure``'s
keys), in rank order.

The profile is torch's own accounting of its CPU allocator: c10's allocator reports every
allocation and free (``ProfiledCPUMemoryReporter``) made on a thread that carries the profiler's
state, the training thread and gloo's threads while they run a work. What it cannot see:
memory outside torch's allocator (gloo's transport buffers, oneDNN's scratchpads, Python
objects), tensors made on a Python thread of our own (none while training), and frees by gloo's
threads after a work (``memory_peak`` puts those back). The profiler keeps its events in buffers
of its own, not through that allocator: an empty profile counts 0 bytes, and 2 or 3 steps of the
same case peak within a few bytes of each other.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from sdnet_trainer import Trainer
from sdnet_trainer.config.schema import Config, DistConfig
from sdnet_trainer.distributed import DistEnv, distributed_session
from sdnet_trainer.distributed.ops import all_gather_objects
from sdnet_trainer.lazy import freeze_imports
from sdnet_trainer.models import init_values
from sdnet_trainer.observability.memory import training_state_bytes
from sdnet_trainer.preflight import validate
from tests.distributed._layout_worker import composed_on_main

# The devices whose memory torch's own profiler counts as CPU memory (cpu_memory_usage in
# torch/autograd/profiler.py): oneDNN's tensors come from the same allocator.
CPU_DEVICES = ("cpu", "mkldnn", "ideep")
# record_function ranges around set-up, each step and the teardown: where in the run the peak
# fell, and what was left when everything of the case had been let go.
MARK = "peak:"
TEARDOWN = f"{MARK}teardown"
# The collective calls: process groups' ops, and the functional collectives DTensor and the
# expert all-to-all use (they call the process group directly, no c10d:: op inside).
CALLS = ("c10d::", "_c10d_functional::", "c10d_functional::")
# The operators that only allocate for the one that called them.
ALLOCATING = ("aten::empty", "aten::resize_", "aten::new_empty", "aten::zeros", "aten::ones")


class PeakRecorder(Trainer):
    def setup(self) -> None:
        with record_function(f"{MARK}setup"):
            super().setup()

    def train_step(self):
        with record_function(f"{MARK}step{self.state.step + 1}"):
            return super().train_step()


def _clear_caches() -> None:
    """The initializer's caches (index ranges, quantile tables: up to a few MB, kept for the
    process's life) emptied: each case makes them again, as in a fresh process, and frees them
    again inside its own profile (nothing of the case is left live at its end)."""
    for cached in vars(init_values).values():
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def _nodes(roots: list[Any]) -> list[Any]:
    out, stack = [], list(roots)
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children)
    return out


def _start(node: Any) -> int:
    return node.start_time_ns


class _Collectives:
    """The collectives in the profile: the ``c10d::*`` calls on each thread, and the works gloo
    ran for them (``gloo:*`` ranges on its own threads, in the order they started)."""

    def __init__(self, ops: list[Any]) -> None:
        self.calls: dict[int, list[Any]] = {}
        for op in sorted((o for o in ops if o.name.startswith(CALLS)), key=_start):
            self.calls.setdefault(op.start_tid, []).append(op)
        self.works = sorted((o for o in ops if o.name.startswith("gloo:")), key=_start)

    def freed_at(self, block: Any, allocations: dict[int, list[int]]) -> int | None:
        """When gloo's thread let go of ``block`` (an allocation whose free the profile lacks):
        the end of the work it was allocated in, or of the work of the collective it was handed
        to, the call around it or the next call on its thread before that thread's next
        allocation (a buffer made for the collective: a flattened bucket, a clone). None for any
        other block: it stays counted."""
        t, thread = block.start_time_ns, block.start_tid
        for work in self.works:
            if work.start_tid == thread and work.start_time_ns <= t <= work.end_time_ns:
                return work.end_time_ns
        call = next((c for c in self.calls.get(thread, []) if c.end_time_ns >= t), None)
        if call is None:
            return None
        later = [a for a in allocations.get(thread, []) if t < a < call.start_time_ns]
        if call.start_time_ns > t and later:
            return None  # the thread went on allocating before it called: not this call's buffer
        work = next((w for w in self.works if w.start_time_ns >= call.start_time_ns), None)
        return work.end_time_ns if work is not None else None


def memory_peak(roots: list[Any]) -> dict[str, Any]:
    """The peak of the running total of the profile's CPU allocations and frees, in time order,
    and where it fell: the set-up or step range around it, and the operator that allocated it.

    Read from the profiler's raw results, ``prof.profiler.kineto_results.experimental_event_tree()``
    (what torch's own memory timeline, ``export_memory_timeline``, reads through
    torch/profiler/_memory_profiler.py, since torch 2.0; checked on 2.14):
    its allocation events carry the block's address as well as its signed size, which the flat
    ``events()`` (``nbytes()``) lack. The addresses find the frees the profile misses: c10's CPU
    allocator reports only on threads that carry the profiler's state, and gloo's worker threads
    carry it while they run a work, not when they drop the work (and the buffers it holds) after
    it. When that drop is the last reference (the caller has let go first: a race, decided by the
    scheduler, lost a few times a case with 4 processes on 2 cores), a flattened DDP bucket or a
    reduce-scatter's input clone would stay counted to the end, 10-20% of the peak. Such a block
    (still live when the case has let go of everything, or whose address is given out again) is
    freed at the end of its collective's work (``_Collectives.freed_at``).
    ``key_averages()`` keeps only per-operator sums; ``export_memory_timeline`` needs
    ``record_shapes``, whose weak references to tensors break FSDP's ``to_empty`` (swap_tensors)."""
    nodes = _nodes(roots)
    ops = [n for n in nodes if n.tag == _EventType.TorchOp]
    blocks = sorted(
        (
            n
            for n in nodes
            if n.tag == _EventType.Allocation and n.extra_fields.device.type in CPU_DEVICES
        ),
        key=_start,
    )
    collectives = _Collectives(ops)
    allocations: dict[int, list[int]] = {}
    for block in blocks:
        if block.extra_fields.alloc_size > 0:
            allocations.setdefault(block.start_tid, []).append(block.start_time_ns)
    changes: list[tuple[int, int, Any]] = []  # (time, bytes, the allocation)
    live: dict[int, Any] = {}
    unseen: list[tuple[Any, int | None]] = []  # (block, when its address was given out again)
    for block in blocks:
        fields = block.extra_fields
        if fields.alloc_size > 0:
            if fields.ptr in live:  # freed where the profile did not see it, and reused
                unseen.append((live.pop(fields.ptr), block.start_time_ns))
            live[fields.ptr] = block
            changes.append((block.start_time_ns, fields.alloc_size, block))
        elif (allocated := live.pop(fields.ptr, None)) is not None:
            changes.append((block.start_time_ns, fields.alloc_size, allocated))
        # else: a block from before this profile (an earlier case's): not counted either way
    unseen.extend((block, None) for block in live.values())
    missed = unfreed = 0
    for block, reused in unseen:
        size = block.extra_fields.alloc_size
        freed = collectives.freed_at(block, allocations)
        if freed is not None:
            missed += size
        elif reused is None:
            unfreed += size
        if freed is not None or reused is not None:
            when = min(t for t in (freed, reused) if t is not None)
            changes.append((when, -size, block))
    changes.sort(key=lambda c: c[0])
    total = peak = 0
    at = None
    for _, size, block in changes:
        total += size
        if total > peak:
            peak, at = total, block
    # Uncorrected, for comparison: the running total of the profile's own events alone.
    raw = raw_peak = 0
    for block in blocks:
        raw += block.extra_fields.alloc_size
        raw_peak = max(raw_peak, raw)
    return {
        "peak_bytes": peak,
        "raw_peak_bytes": raw_peak,
        "missed_free_bytes": missed,  # freed by gloo's threads, placed by freed_at
        "unfreed_bytes": unfreed,  # never seen freed: counted to the end
        **_where(at, ops),
        "memory_events": len(blocks),
    }


def _where(block: Any, ops: list[Any]) -> dict[str, str]:
    """The range (set-up, step N) and the operator around the allocation at the peak."""
    if block is None:
        return {"peak_in": "", "peak_op": ""}
    t = block.start_time_ns
    marks = [o for o in ops if o.name.startswith(MARK) and o.start_time_ns <= t <= o.end_time_ns]
    op = block.parent
    while op is not None and op.name.startswith(ALLOCATING):  # the operator that wanted it
        op = op.parent
    return {
        "peak_in": marks[-1].name.removeprefix(MARK) if marks else "between the steps",
        "peak_op": op.name if op is not None else "",
    }


def measure(cfg: Config, run_dir: Path, env: DistEnv) -> dict[str, Any]:
    """This rank's record of one case: the profiler's peak and the training state at the end."""
    _clear_caches()
    gc.collect()  # the last case's garbage, freed now rather than as frees in this profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = PeakRecorder(cfg, output_dir=run_dir, env=env)
        try:
            trainer.fit()
            state = training_state_bytes(trainer.model, trainer.optimizer)
            steps = trainer.state.step
        finally:
            with record_function(TEARDOWN):
                trainer.close()
                del trainer
                _clear_caches()
                gc.collect()
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    record = memory_peak(prof.profiler.kineto_results.experimental_event_tree())
    return {
        "rank": env.rank,
        **record,
        "state": state,
        "state_bytes": sum(state.values()),
        "steps": steps,
    }


def main(out: Path, cases: dict[str, list[str]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with distributed_session(DistConfig()) as env:
        for name, overrides in cases.items():
            cfg = composed_on_main(overrides, env)
            validate(cfg, world_size=env.world_size)
            records = all_gather_objects(measure(cfg, out / name, env))
            if env.is_main:
                (out / f"{name}.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
