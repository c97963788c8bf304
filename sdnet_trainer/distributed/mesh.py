"""The parallel layout: degrees from ``parallel.*`` and the one DeviceMesh every component slices.

The world is a 5-D grid ``pp x dp_replicate x dp_shard x cp x tp`` (outermost to innermost, as
torchtitan orders it: tensor parallel peers are neighbouring ranks, on the same node, context
parallel peers next, pipeline stages furthest apart). Every dimension exists even at size 1, so
code asks for ``mesh["tp"]`` without special cases.

Data parallelism spans ``dp_replicate x dp_shard``: ranks with the same coordinates there see the
same samples, whatever their context, tensor or pipeline coordinates. Context-parallel peers hold
different parts of the same sequences, so their gradients are partial sums like those of
data-parallel ranks: gradients are reduced over ``dp_replicate x dp_shard x cp``, and FSDP shards
over ``dp_shard x cp`` (one flattened dimension, ``dp_shard_cp``; torchtitan's ``dp_shard_cp``).

Expert parallel (``parallel.ep``) is not a dimension of its own: it takes its ranks from
``dp_shard``, which the mesh then lays out as ``dp_shard_mod_ep x ep`` (flattened back into
``dp_shard`` for everything else). A mixture-of-experts layer sends its tokens to the experts'
ranks over ``ep``, and FSDP shards each expert over the ``dp_shard_mod_ep`` ranks that hold the
same experts, as the rest of the model over ``dp_shard``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from sdnet_trainer.config.schema import ParallelConfig
from sdnet_trainer.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The dimensions whose ranks see different targets of a step: data-parallel replicas and shards
# load different samples, context-parallel ranks different positions of the same sequences. The
# others hold copies of the same targets. The step's reduction contract counts targets and divides
# gradients over these (distributed/reduction.py): a new dimension is named here, or not.
BATCH_DIMS = ("dp_replicate", "dp_shard", "cp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    # Expert parallel: a divisor of dp_shard, not a factor of the world size (module docstring).
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel width: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def batch_ranks(self) -> int:
        """The ranks that see different targets of a step (``BATCH_DIMS``), over which the
        gradients are reduced."""
        return math.prod(getattr(self, name) for name in BATCH_DIMS)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s position in the grid (row-major over MESH_DIMS, as init_device_mesh lays
        it)."""
        coords = {}
        for name, size in reversed(list(zip(MESH_DIMS, self.sizes))):
            rank, coords[name] = divmod(rank, size)
        return coords

    def dp_rank(self, rank: int) -> int:
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self) -> str:
        grid = " x ".join(f"{name} {size}" for name, size in zip(MESH_DIMS, self.sizes))
        return grid if self.ep == 1 else f"{grid}, experts over ep {self.ep}"


def parallel_dims(cfg: ParallelConfig, world_size: int) -> ParallelDims:
    """Resolve ``-1`` and check that the degrees multiply to the world size."""
    degrees = {name: getattr(cfg, name) for name in MESH_DIMS}
    for name, value in degrees.items():
        if value == 0 or value < -1:
            raise ConfigError(
                f"parallel.{name}={value} must be a positive degree or -1 (the rest of the world)"
            )
    free = [name for name, value in degrees.items() if value == -1]
    if len(free) > 1:
        raise ConfigError(
            f"parallel.{free[0]} and parallel.{free[1]} are both -1; at most one degree "
            f"may take the rest of the world"
        )
    known = math.prod(v for v in degrees.values() if v != -1)
    fixed = " x ".join(f"parallel.{n} ({v})" for n, v in degrees.items() if v != -1)
    if free:
        if world_size % known:
            raise ConfigError(
                f"world size {world_size} is not divisible by {fixed} = {known}, so "
                f"parallel.{free[0]}=-1 has no whole value"
            )
        degrees[free[0]] = world_size // known
    elif known != world_size:
        raise ConfigError(
            f"{fixed} = {known} ranks, but the world size is {world_size}; the degrees "
            f"must multiply to the world size (or set one of them to -1)"
        )
    ep = cfg.ep
    if ep < 1 or degrees["dp_shard"] % ep:
        raise ConfigError(
            f"parallel.ep={ep} takes its ranks from parallel.dp_shard={degrees['dp_shard']}, "
            f"which must be a multiple of it (parallel=fsdp with parallel.dp_shard = ep x the "
            f"ranks that shard each expert)"
        )
    return ParallelDims(**degrees, ep=ep)


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The named 5-D mesh over all ranks (call once, after the process group is up), with the
    flattened dimensions the gradient reduction uses under context parallel: ``dp_shard_cp``
    (FSDP's shards) and ``dp_cp`` (DDP's replicas). Under expert parallel ``dp_shard`` is itself
    the flattening of ``dp_shard_mod_ep x ep`` (module docstring)."""
    if dims.ep == 1:
        mesh = init_device_mesh(device_type, dims.sizes, mesh_dim_names=MESH_DIMS)
        shard: tuple[str, ...] = ("dp_shard",)
    else:
        sizes = (dims.pp, dims.dp_replicate, dims.dp_shard // dims.ep, dims.ep, dims.cp, dims.tp)
        names = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        shard = ("dp_shard_mod_ep", "ep")
        mesh[shard]._flatten("dp_shard")
    if dims.cp > 1:
        mesh[shard + ("cp",)]._flatten("dp_shard_cp")
        mesh["dp_replicate", "cp"]._flatten("dp_cp")
    return mesh


def dp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The sub-mesh FSDP shards over: 2-D (replicate, shard) for HSDP, else 1-D; the shard
    dimension takes the context-parallel peers in (``dp_shard_cp``)."""
    shard = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
    if dims.dp_replicate > 1 and dims.dp_shard * dims.cp > 1:
        return mesh["dp_replicate", shard]
    return mesh[shard] if dims.dp_shard * dims.cp > 1 else mesh["dp_replicate"]


def expert_dp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The sub-mesh FSDP shards the experts over under expert parallel: the ``dp_shard_mod_ep``
    ranks that hold the same experts (with the replicas, HSDP)."""
    if dims.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard_mod_ep"]
    return mesh["dp_shard_mod_ep"]


def replica_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The 1-D mesh DDP all-reduces gradients over: the replicas and their context-parallel
    peers (``dp_cp``)."""
    return mesh["dp_cp"] if dims.cp > 1 else mesh["dp_replicate"]


__all__ = [
    "BATCH_DIMS",
    "MESH_DIMS",
    "ParallelDims",
    "build_mesh",
    "dp_mesh",
    "expert_dp_mesh",
    "parallel_dims",
    "replica_mesh",
]
