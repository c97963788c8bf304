"""A parameter's initial values as a function of (seed, parameter name, element index).

Each element's value comes from a counter-based generator: the 64-bit SplitMix mix of its
*counter* (the element's index in the flattened whole tensor) in a stream keyed by the seed and
the parameter's name, as JAX's threefry or torch's offset-based Philox on CUDA draw a number from
its position. A rank computes exactly the elements of its shard (its DTensor's block, cut by the
tensor's own placements), on the shard's device, with no full tensor anywhere and no
communication: one process, FSDP, tensor parallel, expert parallel and a pipeline split start from
bitwise equal weights, at a cost that grows with the shard.

Bitwise equal also means the arithmetic may not depend on where an element sits in a chunk, nor on
the CPU's vector width, the thread count or the device: torch's CPU kernels run a vectorised
transcendental (``log``, ``erfinv``) on the body of a chunk and the scalar libm one on its tail,
and the two differ in the last bit. So every step here is an integer operation, a table lookup or
one of IEEE's correctly rounded float32 operations (``+ - *``, conversions), each in its own
kernel (no fused multiply-add): a normal value is the standard normal's quantile function,
tabulated once and interpolated linearly between its 2^16 + 1 points, at a uniform number of 24
bits. The values are then the same on any CPU and on CUDA.

One 64-bit draw gives two values (its two 32-bit words): elements ``2p`` and ``2p + 1`` share
counter ``p``. A shard whose rows start at odd indices computes one value of a pair it does not
keep at each end of a row.
"""

from __future__ import annotations

import functools
import hashlib
import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sdnet_trainer.models.local_slices import local_runs

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _f32(value: float) -> float:
    """``value`` rounded to float32: a constant every device multiplies by alike."""
    return float(torch.tensor(value, dtype=torch.float32))


# SplitMix64 (Steele, Lea and Flood 2014): the Weyl increment and the finaliser's multipliers.
_GAMMA = 0x9E3779B97F4A7C15
_MIX = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None))
_TWO_M24 = 2.0**-24  # exact in float32
# The standard normal's quantile function tabulated at k / 2^16 (k = 0 .. 2^16; the ends at half a
# 24-bit step from 0 and 1, where it is infinite), between which a value is interpolated linearly:
# within 1e-8 of the exact quantile wherever |z| < 3.7 (the derivative's change across a cell is
# tiny there), within a few hundredths in the last cells of the tails (probability 3e-5).
_TABLE_BITS = 16
# Pairs per chunk: about 1.5 MiB of int64 counters and a few float32 temporaries, in cache.
_CHUNK_PAIRS = 1 << 16


@dataclass(frozen=True)
class Normal:
    """normal(mean, std)."""

    std: float = 1.0
    mean: float = 0.0


@dataclass(frozen=True)
class TruncatedNormal:
    """normal(mean, std) restricted to [mean + lower * std, mean + upper * std] (bounds in
    standard deviations, as JAX's ``truncated_normal``), drawn by the inverse distribution
    function as torch's ``trunc_normal_`` is."""

    std: float = 1.0
    mean: float = 0.0
    lower: float = -2.0
    upper: float = 2.0


@dataclass(frozen=True)
class Uniform:
    """uniform on [low, high)."""

    low: float
    high: float


@dataclass(frozen=True)
class Constant:
    """Every element ``value`` (zeros, ones)."""

    value: float


Distribution = Normal | TruncatedNormal | Uniform | Constant

# Called with the number of values each fill generates (the tests count them).
_observers: list[Callable[[int], None]] = []


def observe(callback: Callable[[int], None]) -> Callable[[], None]:
    """Report every count of generated values to ``callback``; returns its removal."""
    _observers.append(callback)
    return lambda: _observers.remove(callback)


def stream(seed: int, key: str) -> int:
    """The stream of parameter ``key`` under ``seed``: a 64-bit number, as an int64."""
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return _signed(int.from_bytes(digest, "little"))


@torch.no_grad()
def fill(target: torch.Tensor, dist: Distribution, *, seed: int, key: str) -> int:
    """Write into ``target`` (a plain tensor: the whole parameter; a DTensor: this rank's block)
    ``dist``'s values at its elements' indices in the whole tensor; the number of values
    generated (0 for a meta tensor: not on this rank)."""
    if target.is_meta:
        return 0
    local = target.to_local() if isinstance(target, DTensor) else target
    if isinstance(dist, Constant):
        local.fill_(dist.value)
        return 0
    if local.numel() == 0:
        return 0
    # A contiguous plain tensor is written in place, chunk by chunk; anything else (a strided
    # view, a float8 training wrapper around the weight) through one buffer of the shard's size.
    direct = (
        type(local) in (torch.Tensor, nn.Parameter)
        and local.is_contiguous()
        and local.dtype.is_floating_point
    )
    out = local if direct else torch.empty(local.shape, dtype=torch.float32, device=local.device)
    flat, key_stream, generated = out.view(-1), stream(seed, key), 0
    bases, inner = _rows(local_runs(target), target.shape, out.device)
    for r0, r1, c0, c1 in _chunks(bases.numel(), inner):
        block = flat[r0 * inner : r1 * inner].view(r1 - r0, inner)[:, c0:c1]
        generated += _fill_rows(block, bases[r0:r1] + c0, dist, key_stream)
    if not direct:
        local.copy_(out)
    for callback in _observers:
        callback(generated)
    return generated


def fill_cost(target: torch.Tensor, dist: Distribution) -> int:
    """The number of values :func:`fill` generates for ``target`` (this rank's block of a meta
    DTensor, say: the dry run's), by the same cutting into rows and chunks, computing none."""
    if isinstance(dist, Constant) or math.prod(_local_shape(target)) == 0:
        return 0
    bases, inner = _rows(local_runs(target), target.shape, torch.device("cpu"))
    total = 0
    for r0, r1, c0, c1 in _chunks(bases.numel(), inner):
        starts = bases[r0:r1] + c0
        total += (r1 - r0) * 2 * _pairs(c1 - c0, aligned=not bool((starts & 1).any()))
    return total


def _local_shape(target: torch.Tensor) -> tuple[int, ...]:
    return tuple((target.to_local() if isinstance(target, DTensor) else target).shape)


def _rows(
    runs: list[list[tuple[int, int]]], shape: torch.Size, device: torch.device
) -> tuple[torch.Tensor, int]:
    """The shard, given per dimension the runs of global indices it holds, as *rows* of
    consecutive elements of the whole tensor: the trailing dimensions held whole, then at most
    one held as a single run, make a row of ``inner`` elements; every combination of the leading
    dimensions' indices starts one, at the flat index in ``bases`` (in the shard's row-major
    order)."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    inner, start, split = 1, 0, len(shape)
    while split > 0:
        dim_runs = runs[split - 1]
        if len(dim_runs) != 1:
            break
        split -= 1
        ((begin, stop),) = dim_runs
        inner *= stop - begin
        start += begin * strides[split]
        if stop - begin != shape[split]:
            break
    bases = torch.full((1,), start, dtype=torch.int64, device=device)
    for d in range(split):
        index = torch.cat([torch.arange(b, e, device=device) for b, e in runs[d]])
        bases = (bases.unsqueeze(-1) + index * strides[d]).reshape(-1)
    return bases, inner


def _chunks(rows: int, inner: int) -> Iterator[tuple[int, int, int, int]]:
    """(first row, end row, first column, end column) of chunks of about ``2 * _CHUNK_PAIRS``
    elements: whole rows together, or a long row in pieces."""
    per_chunk = 2 * _CHUNK_PAIRS
    columns, rows_per_chunk = min(inner, per_chunk), max(1, per_chunk // max(inner, 1))
    for r0 in range(0, rows, rows_per_chunk):
        for c0 in range(0, inner, columns):
            yield r0, min(rows, r0 + rows_per_chunk), c0, min(inner, c0 + columns)


def _pairs(width: int, *, aligned: bool) -> int:
    """Counters per row of ``width`` elements: one more where a row starts at an odd index."""
    return (width + 1) // 2 if aligned else (width + 2) // 2


def _fill_rows(out: torch.Tensor, starts: torch.Tensor, dist: Distribution, key: int) -> int:
    """``out[i, j]`` = the value of element ``starts[i] + j``; values generated."""
    rows, width = out.shape
    device = out.device
    odd = starts & 1
    aligned = not bool(odd.any())
    pairs = _pairs(width, aligned=aligned)
    # key + counter * gamma for every pair of every row: the row's first counter's term plus the
    # pairs' offsets' (one broadcast add, where counters, a multiplication and an add take three).
    weyl = ((starts >> 1) * _signed(_GAMMA) + key).unsqueeze(1) + _offsets(pairs, device)
    values = _pair_values(_mix(weyl.view(-1)), dist).view(rows, 2 * pairs)
    if aligned:
        out.copy_(values[:, :width])
    else:
        out.copy_(values.gather(1, odd.unsqueeze(1) + torch.arange(width, device=device)))
    return values.numel()


@functools.lru_cache(maxsize=8)
def _offsets(pairs: int, device: torch.device) -> torch.Tensor:
    """``counter * gamma`` for the counters ``0 .. pairs`` (int64, wrapping)."""
    return torch.arange(pairs, device=device).mul_(_signed(_GAMMA))


def _hash(counters: torch.Tensor, key: int) -> torch.Tensor:
    """SplitMix64's output for each counter in the stream ``key``."""
    return _mix(counters.mul(_signed(_GAMMA)).add_(key))


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of ``key + counter * gamma``, in place. int64 multiplication
    wraps (two's complement), as unsigned 64-bit arithmetic does; the logical right shifts are
    arithmetic ones masked."""
    t = torch.empty_like(z)
    for shift, multiplier in _MIX:
        torch.bitwise_right_shift(z, shift, out=t)
        z.bitwise_xor_(t.bitwise_and_((1 << (64 - shift)) - 1))
        if multiplier is not None:
            z.mul_(_signed(multiplier))
    return z


def _words(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each 64-bit hash's high and low 32 bits, as int32 (half the width of the int64 lanes, so
    the fields are cut at twice the speed): element ``2p``'s and element ``2p + 1``'s."""
    return (z >> 32).to(torch.int32), z.to(torch.int32)


def _unit(word: torch.Tensor) -> torch.Tensor:
    """A uniform number in (0, 1) from a word's top 24 bits: (k + 1/2) / 2^24, exact in float32."""
    return ((word >> 8) & 0xFFFFFF).to(torch.float32).add_(0.5).mul_(_TWO_M24)


def _pair_values(z: torch.Tensor, dist: Distribution) -> torch.Tensor:
    """(n,) hashes -> (n, 2) float32 values of ``dist``: one per 32-bit word."""
    high, low = _words(z)
    if isinstance(dist, Normal):
        values = _interleave(_standard_normal(high), _standard_normal(low))
        values.mul_(_f32(dist.std))
        return values.add_(_f32(dist.mean)) if dist.mean else values
    if isinstance(dist, Uniform):
        values = _interleave(_unit(high), _unit(low))
        return values.mul_(_f32(dist.high - dist.low)).add_(_f32(dist.low))
    if isinstance(dist, TruncatedNormal):
        return _interleave(_truncated(high, dist), _truncated(low, dist))
    raise TypeError(f"no counter-based generator for {dist!r}")


@functools.lru_cache(maxsize=8)
def _quantiles(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantile table (float32) and its differences between neighbours, on ``device``.
    Computed once in float64 by Python's own inverse normal (the same bits on every rank of a
    platform), made exactly symmetric, rounded to float32 on the host and copied as they are."""
    cells = 1 << _TABLE_BITS
    inverse = statistics.NormalDist().inv_cdf
    lower = [inverse(max(k / cells, _TWO_M24 / 2)) for k in range(cells // 2)]
    table = torch.tensor([*lower, 0.0, *(-q for q in reversed(lower))], dtype=torch.float32)
    return table.to(device), (table[1:] - table[:-1]).to(device)


def _quantile(position: torch.Tensor, fraction: torch.Tensor) -> torch.Tensor:
    """table[k] + f (table[k + 1] - table[k]) for cells ``position`` (int32) and ``fraction``
    in [0, 1), in two correctly rounded operations."""
    table, steps = _quantiles(position.device)
    below = torch.index_select(table, 0, position)
    return fraction.mul_(torch.index_select(steps, 0, position)).add_(below)


def _standard_normal(word: torch.Tensor) -> torch.Tensor:
    """A standard normal from a word's top 24 bits: the quantile at u = (k + 1/2) / 2^24, its
    top 16 bits the table's cell, the next 8 the position within it."""
    cell = (word >> 16) & 0xFFFF
    fraction = ((word >> 8) & 0xFF).to(torch.float32).add_(0.5).mul_(2.0**-8)
    return _quantile(cell, fraction)


def _truncated(word: torch.Tensor, dist: TruncatedNormal) -> torch.Tensor:
    """Inverse distribution function: u uniform between the bounds' probabilities, then the
    quantile at u, scaled and clamped into the bounds."""
    lo, hi = (0.5 * (1.0 + math.erf(b / math.sqrt(2.0))) for b in (dist.lower, dist.upper))
    scaled = (
        _unit(word).mul_(_f32((hi - lo) * (1 << _TABLE_BITS))).add_(_f32(lo * (1 << _TABLE_BITS)))
    )
    cell = scaled.floor().clamp_(0, (1 << _TABLE_BITS) - 1)
    values = _quantile(cell.to(torch.int32), scaled.sub_(cell))
    values.mul_(_f32(dist.std)).add_(_f32(dist.mean))
    bounds = (dist.mean + dist.lower * dist.std, dist.mean + dist.upper * dist.std)
    return values.clamp_(_f32(bounds[0]), _f32(bounds[1]))


def _interleave(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(n,) and (n,) -> (n, 2): one elementwise kernel (a complex tensor's real and imaginary
    parts are interleaved floats), where a stack or strided writes take several times longer."""
    return torch.view_as_real(torch.complex(x, y))


__all__ = [
    "Constant",
    "Distribution",
    "Normal",
    "TruncatedNormal",
    "Uniform",
    "fill",
    "fill_cost",
    "observe",
    "stream",
]
