"""FSDP2's sharded state from one replica group to a joining one (sdnet_trainer/ft/shards.py and
the room's ``_state_dict`` / ``_load``): DTensors travel as plain local shards through torchft's
own serialization and are placed again as the receiver's live DTensors; a group of another rank
count, or a shard of another shape, is a clear error.

In this process: a fake process group of two ranks (this is rank 0, holding half of every
parameter), and a lighthouse of its own for the rooms' torchft Managers."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from sdnet_trainer.checkpoint.parts import ModelState, OptimizerState, Part
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.ft.shards import local_shards, rebuild_shards

pytestmark = pytest.mark.full

pytest.importorskip("torchft")


@pytest.fixture
def mesh() -> Iterator[object]:
    """A two-rank device mesh on a fake process group: collectives are no-ops, shards are real."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _sharded(mesh: object, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 over a small model (one uneven dimension: 3 rows on 2 ranks), with SGD momentum
    buffers from one step on made-up gradients."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    return model, optimizer


def _parts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Part]:
    return {"model": Part(ModelState(model)), "optim": Part(OptimizerState(model, optimizer))}


def _dtensors(tree: object) -> list[DTensor]:
    if isinstance(tree, DTensor):
        return [tree]
    if isinstance(tree, dict):
        return [d for value in tree.values() for d in _dtensors(value)]
    if isinstance(tree, (list, tuple)):
        return [d for value in tree for d in _dtensors(value)]
    return []


def _through_torchft(state: object) -> object:
    """What torchft's HTTP checkpoint transport does to a state dict on its way to a peer."""
    from torchft.checkpointing._serialization import _streaming_load, _streaming_save

    buffer = io.BytesIO()
    _streaming_save(state, buffer)
    buffer.seek(0)
    return _streaming_load(buffer, weights_only=False)


@contextmanager
def _rooms(parts: list[dict[str, Part]], *, group_sizes: list[int]) -> Iterator[list]:
    """One room per group (torchft Managers on an in-process lighthouse); nothing steps."""
    from torchft._torchft import LighthouseServer

    from sdnet_trainer.config.fault_tolerance import FaultToleranceConfig
    from sdnet_trainer.ft.room import FaultTolerance

    server = LighthouseServer(bind="[::]:0", min_replicas=1)
    rooms = []
    try:
        for group, (group_parts, size) in enumerate(zip(parts, group_sizes, strict=True)):
            cfg = FaultToleranceConfig(
                enabled=True, lighthouse=server.address(), groups=2, replica_group=group
            )
            room = FaultTolerance(
                cfg, group_rank=0, group_size=1, distributed=False, parts=group_parts,
                after_load=lambda: None, step=0,
            )  # fmt: skip
            room.group_size = size  # the rank count the room reports, as a group of that many
            rooms.append(room)
        yield rooms
    finally:
        for room in rooms:
            room.close()
        server.shutdown()


def test_a_joining_group_receives_the_shards_and_places_them_as_its_own(mesh):
    """Model A's sharded parameters and momentum buffers, through the room's ``_state_dict``,
    torchft's serialization and the room's ``_load``, into model B: bitwise A's local shards,
    as DTensors on B's own mesh and placements with the global shapes."""
    model_a, optim_a = _sharded(mesh, seed=0)
    model_b, optim_b = _sharded(mesh, seed=1)
    parts_a, parts_b = _parts(model_a, optim_a), _parts(model_b, optim_b)
    with _rooms([parts_a, parts_b], group_sizes=[2, 2]) as (room_a, room_b):
        sent = room_a._state_dict()
        assert not _dtensors(sent)  # plain tensors only on the wire
        room_b._load(_through_torchft(sent))
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert isinstance(b, DTensor) and b.device_mesh is mesh and b.placements == a.placements
        assert b.shape == a.shape and torch.equal(b.to_local(), a.to_local())
    assert [p.to_local().shape[0] for p in model_b.parameters()] == [3, 3, 2, 2]  # real halves
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        buf_a, buf_b = optim_a.state[a]["momentum_buffer"], optim_b.state[b]["momentum_buffer"]
        assert isinstance(buf_b, DTensor) and buf_b.device_mesh is mesh
        assert torch.equal(buf_b.to_local(), buf_a.to_local())


def test_the_walk_leaves_plain_values_and_round_trips_nested_containers(mesh):
    model, optimizer = _sharded(mesh, seed=0)
    live = {"model": ModelState(model).state_dict(), "step": 7, "ids": [1, (2, 3)]}
    assert len(_dtensors(live)) == 4
    sent = local_shards(live)
    assert not _dtensors(sent) and sent["step"] == 7 and sent["ids"] == [1, (2, 3)]
    back = rebuild_shards(_through_torchft(sent), live, where="state")
    for name, want in live["model"].items():
        got = back["model"][name]
        assert isinstance(got, DTensor) and got.placements == want.placements
        assert got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got.to_local(), want.to_local())
    assert back["step"] == 7 and back["ids"] == [1, (2, 3)]


def test_a_shard_of_another_shape_names_the_entry(mesh):
    model, _ = _sharded(mesh, seed=0)
    live = ModelState(model).state_dict()
    received = {name: torch.zeros(1, *value.shape[1:]) for name, value in live.items()}
    shard = r"shard of model\.0\.weight: got \(1, 4\), this rank holds \(3, 4\) of \(6, 4\)"
    with pytest.raises(ConfigError, match=shard + ".*same number of ranks"):
        rebuild_shards(received, live, where="model")


def test_a_peer_group_of_another_rank_count_is_refused(mesh):
    """The sender's group size travels with its state; the receiver's must be the same."""
    model_a, optim_a = _sharded(mesh, seed=0)
    model_b, optim_b = _sharded(mesh, seed=1)
    before = [p.to_local().clone() for p in model_b.parameters()]
    parts = [_parts(model_a, optim_a), _parts(model_b, optim_b)]
    with _rooms(parts, group_sizes=[2, 1]) as (room_a, room_b):
        sent = _through_torchft(room_a._state_dict())
        refused = r"replica group 1 runs 1 rank\(s\) and the peer it recovers from 2: every"
        with pytest.raises(ConfigError, match=refused + " replica group must run the same number"):
            room_b._load(sent)
    assert all(torch.equal(p.to_local(), b) for p, b in zip(model_b.parameters(), before))
