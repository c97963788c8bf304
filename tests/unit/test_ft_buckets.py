"""The replica groups' gradient reduction in buckets (sdnet_trainer/ft/room.py,
``reduce_in_buckets``), in this process: the extra memory it allocates is one bucket, where the
flat reduction's is every gradient; it gives bitwise what the flat one gives; and the keys that
choose the bucket and the process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sdnet_trainer.config import compose
from sdnet_trainer.config.fault_tolerance import FaultToleranceConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.ft import validate_ft
from sdnet_trainer.ft.room import reduce_in_buckets, replica_backend
from tests.support import TINY

ALL_AT_ONCE = 2**62  # a bucket larger than every gradient: the flat reduction
KIB = 1024


class NewStorages(TorchDispatchMode):
    """The bytes of every storage an operation creates inside the block (the gradients' own
    storages, known beforehand, excluded): what a reduction allocates, whatever it frees."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                self.known.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


def _gradients() -> list[torch.Tensor]:
    """Small ones (packed into buckets) around large ones (reduced in place): 1.7 MB."""
    torch.manual_seed(0)
    sizes = [3000] * 40 + [100_000] * 3 + [700] * 20
    return [torch.randn(n) for n in sizes]


def _allocated(grads: list[torch.Tensor], bucket_bytes: int) -> int:
    """Bytes a reduction over a one-rank gloo group allocates (the collective itself included)."""
    counter = NewStorages(grads)
    with counter:
        reduce_in_buckets(
            grads, lambda t: dist.all_reduce(t, async_op=True), bucket_bytes=bucket_bytes
        )
    return counter.bytes


def test_the_extra_memory_is_one_bucket_not_every_gradient(one_rank):
    grads = _gradients()
    total = sum(g.numel() * g.element_size() for g in grads)
    bucket = 64 * KIB
    assert total > 20 * bucket
    assert _allocated(grads, bucket) == bucket  # one bucket, packed again and again
    assert _allocated(_gradients(), ALL_AT_ONCE) == total  # the flat copy of every gradient


class Done:
    """A finished collective's work."""

    def wait(self) -> bool:
        return True


@pytest.mark.parametrize("bucket_bytes", [1, 512, 4 * KIB, 64 * KIB, 1 << 20, ALL_AT_ONCE])
def test_every_bucket_size_gives_bitwise_the_flat_result(bucket_bytes):
    """Mixed dtypes, a transposed (non-contiguous) gradient smaller and one larger than a bucket:
    every element reduced once, in place, whatever the bucket."""

    def layout() -> list[torch.Tensor]:
        torch.manual_seed(1)
        return [
            torch.randn(300),
            torch.randn(40, 30).t(),
            torch.randn(50).to(torch.bfloat16),
            torch.randn(5000),
            torch.randn(7, 3).t(),
            torch.randn(64).to(torch.bfloat16),
            torch.randn(17),
        ]

    seen: list[int] = []

    def allreduce(t: torch.Tensor) -> Done:
        seen.append(t.numel())
        t.mul_(0.5).add_(1.0)
        return Done()

    flat, grads = layout(), layout()
    reduce_in_buckets(flat, allreduce, bucket_bytes=ALL_AT_ONCE)
    seen.clear()
    reduce_in_buckets(grads, allreduce, bucket_bytes=bucket_bytes)
    for got, want in zip(grads, flat, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert sum(seen) == sum(g.numel() for g in grads)  # each element crossed once


def test_replica_backend_auto_is_nccl_on_cuda_and_gloo_on_the_cpu():
    auto = FaultToleranceConfig()
    assert replica_backend(auto, torch.device("cuda", 0)) == "nccl"
    assert replica_backend(auto, torch.device("cpu")) == "gloo"
    gloo = FaultToleranceConfig(replica_backend="gloo")
    assert replica_backend(gloo, torch.device("cuda", 0)) == "gloo"


FT = [
    *TINY,
    "loop.global_batch_size=12",
    "fault_tolerance.enabled=true",
    "fault_tolerance.groups=2",
    "fault_tolerance.lighthouse=http://localhost:1",
]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (["fault_tolerance.bucket_mb=0"], "fault_tolerance.bucket_mb=0.0 must be > 0"),
        (["fault_tolerance.replica_backend=ncl"], "did you mean 'nccl'"),
        (["fault_tolerance.replica_backend=nccl"], "replica_backend=nccl needs CUDA tensors"),
    ],
)
def test_the_bucket_and_backend_keys_are_checked_before_launch(keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_ft(compose([*FT, *keys]), 1)
