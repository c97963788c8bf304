"""What an async save copies to host memory before its background write: only this rank's share
of the state, into host buffers that one stager keeps from save to save."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from sdnet_trainer.checkpoint import disk
from sdnet_trainer.checkpoint.group import CheckpointGroup
from sdnet_trainer.compat import reusable_stager


def written_here(
    state_dict: dict[str, Any], *, ranks: CheckpointGroup, rank: int, world_size: int
) -> dict[str, Any]:
    """The part of ``state_dict`` that this rank writes, flattened as DCP flattens it (same
    keys in the checkpoint). DCP writes a tensor that several ranks hold (replicated, as DDP's
    model and optimizer state are on every rank) once, from the rank its dedup picks; so every
    rank plans its save as DCP does, the plans are gathered, and DCP's own dedup rule
    (``dedup_save_plans``, deterministic given the plans) says which rank writes what. The
    entries another rank writes are dropped here, before they are staged: under DDP each rank
    stages about 1/world_size of the state instead of all of it. DCP's save of the rest then
    has nothing left to dedup and writes exactly this split. Collective."""
    if ranks.no_dist or world_size == 1:
        return state_dict
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=rank == 0)
    local = planner.create_local_plan()
    plans = ranks.all_gather(dataclasses.replace(local, planner_data=None))
    kept = {item.index.fqn for item in dedup_save_plans(plans)[rank].items}
    elsewhere = {item.index.fqn for item in local.items} - kept
    return {fqn: value for fqn, value in planner.state_dict.items() if fqn not in elsewhere}


def stager_for(current: DefaultStager | None, state_dict: dict[str, Any]) -> DefaultStager:
    """The run's stager (``current``, or a new one at the first async save). Its host buffers are
    cached per source storage and reused by every later save (a tensor whose storage is new, e.g.
    a state built afresh for each save, gets a new buffer; the old one is dropped with its
    source). Staging is synchronous: save() returns with the copy complete, so the loop may change
    its tensors at once. On CUDA the buffers are pinned and the device-to-host copies are issued
    without blocking, then waited for together.

    Where torch's stager cannot be reused (``compat.reusable_stager``: torch < 2.13), each save
    gets a new one: the same copy, into host buffers allocated (and pinned) afresh. The caller has
    waited for the previous save, so closing its stager here loses nothing."""
    if current is not None and not reusable_stager():
        current.close()
        current = None
    if current is not None:
        return current
    cuda = any(t.is_cuda for t in disk.local_tensors(state_dict))
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,  # the writer is a thread of this process
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
    )
