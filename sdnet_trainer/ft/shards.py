"""FSDP2's sharded state across torchft's checkpoint transport (what a joining group receives).

Under FSDP2 the model's and the optimizer's state dicts hold DTensors: this rank's shard, with the
device mesh and placements that place it in the whole tensor. torchft's checkpoint transport (HTTP,
the Manager's default) pickles what it is given, and a DTensor pickles with its device mesh, whose
process groups are named after the sender's: on the receiving process the mesh cannot resolve them
(or resolves an unrelated group). So a DTensor travels as its local shard, a plain tensor
(:func:`local_shards`), and the receiver rebuilds it from its own live state's DTensor at the same
place, with that DTensor's mesh, placements, global shape and stride (:func:`rebuild_shards`).
This holds because rank r of every group holds the same shard: every group must run the same
number of ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from sdnet_trainer.errors import ConfigError


def local_shards(tree: Any) -> Any:
    """``tree`` (nested dicts, lists, tuples) with every DTensor replaced by its local shard: the
    same storage, nothing copied."""
    if isinstance(tree, DTensor):
        return tree.to_local().detach()
    if isinstance(tree, Mapping):
        return {key: local_shards(value) for key, value in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(local_shards(value) for value in tree)
    return tree


def rebuild_shards(received: Any, like: Any, *, where: str) -> Any:
    """``received`` with a DTensor wherever ``like`` (this rank's live state, of the same form)
    holds one at the same place: the received local shard placed as the live one. Entries the
    live state lacks pass as they are; ``where`` names the entry in errors."""
    if isinstance(like, DTensor):
        live = like.to_local()
        if not isinstance(received, torch.Tensor) or received.shape != live.shape:
            got = tuple(received.shape) if isinstance(received, torch.Tensor) else type(received)
            raise ConfigError(
                f"fault tolerance: the state received from a peer does not fit this rank's shard "
                f"of {where}: got {got}, this rank holds {tuple(live.shape)} of "
                f"{tuple(like.shape)}; every replica group must run the same config and the same "
                f"number of ranks"
            )
        return DTensor.from_local(
            received.to(device=live.device),
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )
    if isinstance(received, Mapping) and isinstance(like, Mapping):
        return {
            key: rebuild_shards(value, like[key], where=f"{where}.{key}") if key in like else value
            for key, value in received.items()
        }
    sequences = type(received) in (list, tuple) and type(like) in (list, tuple)
    if sequences and len(received) == len(like):
        pairs = enumerate(zip(received, like, strict=True))
        return type(received)(rebuild_shards(r, o, where=f"{where}[{i}]") for i, (r, o) in pairs)
    return received


__all__ = ["local_shards", "rebuild_shards"]
