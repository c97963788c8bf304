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
transcendental (``log``, ``cos``) on the body of a chunk and the scalar libm one on its tail, and
the two differ in the last bit. So every step here is an integer operation or one of IEEE's
correctly rounded float32 operations (``+ - * /``, ``sqrt``, conversions), each in its own kernel
(no fused multiply-add, no division turned into a multiplication by a reciprocal): the logarithm
and the sine and cosine are written as polynomials of those. The values are then the same on any
CPU and on CUDA.

A standard normal takes a counter per *pair* of elements (Box-Muller gives two values from one
64-bit draw): elements ``2p`` and ``2p + 1`` share counter ``p``. A shard whose rows start at odd
indices computes one value of a pair it does not keep at each end of a row.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
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
_LN2 = _f32(math.log(2.0))
_SQRT2_FRACTION = 0x3504F3  # the 23 fraction bits of sqrt(2) in float32
_QUARTER_PI = _f32(math.pi / 4)
# ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.172 for m in [sqrt(1/2), sqrt(2)): the odd
# series to s^7 is within 3e-8 of it, half a float32 step of ln m's range.
_ATANH = tuple(_f32(1.0 / (2 * k + 1)) for k in range(4))
# cos and sin on [-pi/4, pi/4] by Taylor polynomials to x^8 and x^9 (errors below 3e-8).
_COS = tuple(_f32((-1) ** k / math.factorial(2 * k)) for k in range(5))
_SIN = tuple(_f32((-1) ** k / math.factorial(2 * k + 1)) for k in range(5))
# Giles (2010), "Approximating the erfinv function": single precision, from w = -ln(1 - x^2).
_ERFINV_CENTRAL = tuple(
    _f32(c)
    for c in (
        1.50140941,
        0.246640727,
        -0.00417768164,
        -0.00125372503,
        0.00021858087,
        -4.39150654e-06,
        -3.5233877e-06,
        3.43273939e-07,
        2.81022636e-08,
    )
)
_ERFINV_TAIL = tuple(
    _f32(c)
    for c in (
        2.83297682,
        1.00167406,
        0.00943887047,
        -0.0076224613,
        0.00573950773,
        -0.00367342844,
        0.00134934322,
        0.000100950558,
        -0.000200214257,
    )
)
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
    direct = type(local) is torch.Tensor and local.is_contiguous() and local.dtype.is_floating_point
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
    counters = (starts >> 1).unsqueeze(1) + torch.arange(pairs, device=device)
    values = _pair_values(_hash(counters.view(-1), key), dist).view(rows, 2 * pairs)
    if aligned:
        out.copy_(values[:, :width])
    else:
        out.copy_(values.gather(1, odd.unsqueeze(1) + torch.arange(width, device=device)))
    return values.numel()


def _hash(counters: torch.Tensor, key: int) -> torch.Tensor:
    """SplitMix64's output for each counter in the stream ``key``: the finaliser of
    ``key + counter * gamma``. int64 multiplication wraps (two's complement), as unsigned 64-bit
    arithmetic does; the logical right shifts are arithmetic ones masked."""
    z = counters.mul_(_signed(_GAMMA)).add_(key)
    t = torch.empty_like(z)
    for shift, multiplier in _MIX:
        torch.bitwise_right_shift(z, shift, out=t)
        z.bitwise_xor_(t.bitwise_and_((1 << (64 - shift)) - 1))
        if multiplier is not None:
            z.mul_(_signed(multiplier))
    return z


def _words(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each 64-bit hash's high and low 32 bits, as int32 (half the width of the int64 lanes, so
    the fields are cut at twice the speed)."""
    return (z >> 32).to(torch.int32), z.to(torch.int32)


def _unit(word: torch.Tensor) -> torch.Tensor:
    """A uniform number in (0, 1) from a word's top 24 bits: (k + 1/2) / 2^24, exact in float32."""
    return ((word >> 8) & 0xFFFFFF).to(torch.float32).add_(0.5).mul_(_TWO_M24)


def _pair_values(z: torch.Tensor, dist: Distribution) -> torch.Tensor:
    """(n,) hashes -> (n, 2) float32 values of ``dist``: two per hash."""
    high, low = _words(z)
    if isinstance(dist, Normal):
        values = _normal_pairs(high, low)
        return values.mul_(_f32(dist.std)).add_(_f32(dist.mean))
    if isinstance(dist, Uniform):
        values = _interleave(_unit(high), _unit(low))
        return values.mul_(_f32(dist.high - dist.low)).add_(_f32(dist.low))
    if isinstance(dist, TruncatedNormal):
        return _truncated_pairs(high, low, dist)
    raise TypeError(f"no counter-based generator for {dist!r}")


def _polynomial(x: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    """sum_k c_k x^k by Horner's rule, one rounded multiply and add at a time."""
    acc = torch.mul(x, coefficients[-1]).add_(coefficients[-2])
    for c in reversed(coefficients[:-2]):
        acc.mul_(x).add_(c)
    return acc


def _log(x: torch.Tensor) -> torch.Tensor:
    """Natural logarithm of positive normal float32 numbers, from their bits: x = m 2^e with m
    in [sqrt(1/2), sqrt(2)) (integer operations: a mantissa at or above sqrt(2)'s takes the
    exponent of [1/2, 1)), then ln m by the atanh series."""
    bits = x.view(torch.int32)
    fraction = bits & 0x7FFFFF
    # 1 where the mantissa 1.fraction >= sqrt(2) (fraction >= 0x3504F3), else 0.
    high = (fraction + (0x800000 - _SQRT2_FRACTION)) >> 23
    mantissa = fraction.bitwise_or_((127 - high) << 23).view(torch.float32)
    e = ((bits >> 23) - 127 + high).to(torch.float32)
    s = (mantissa - 1.0).div_(mantissa + 1.0)
    series = _polynomial(s * s, _ATANH).mul_(s).mul_(2.0)
    return e.mul_(_LN2).add_(series)


def _normal_pairs(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Box-Muller: a radius sqrt(-2 ln u) and an angle uniform on the circle (a quarter turn
    ``k`` from the low word's two lowest bits, within it an offset in [-pi/4, pi/4), where the
    polynomials are accurate) give two independent standard normals."""
    radius = _log(_unit(high)).mul_(-2.0).sqrt_()
    delta = _unit(low).mul_(2.0).sub_(1.0).mul_(_QUARTER_PI)
    square = delta * delta
    cos = _polynomial(square, _COS).mul_(radius)
    sin = _polynomial(square, _SIN).mul_(delta).mul_(radius)
    # The quarter turn k = k0 + 2 k1 rotates (cos, sin) to (cos, sin), (-sin, cos), (-cos, -sin)
    # or (sin, -cos): a swap by k0, then signs; as exact products with 0, 1 and -1.
    k0 = (low & 1).to(torch.float32)
    k1 = ((low >> 1) & 1).to(torch.float32)
    x = torch.mul(sin, k0).add_(torch.mul(cos, 1.0 - k0))
    y = cos.mul_(k0).add_(sin.mul_(1.0 - k0))
    x.mul_((k0 - k1).abs_().mul_(-2.0).add_(1.0))  # negative for k = 1, 2
    y.mul_(k1.mul_(-2.0).add_(1.0))  # negative for k = 2, 3
    return _interleave(x, y)


def _interleave(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(n,) and (n,) -> (n, 2): one elementwise kernel (a complex tensor's real and imaginary
    parts are interleaved floats), where a stack or strided writes take several times longer."""
    return torch.view_as_real(torch.complex(x, y))


def _truncated_pairs(high: torch.Tensor, low: torch.Tensor, dist: TruncatedNormal) -> torch.Tensor:
    """Inverse distribution function: u uniform between the bounds' probabilities, then
    mean + std sqrt(2) erfinv(2u - 1)."""
    lo, hi = (0.5 * (1.0 + math.erf(b / math.sqrt(2.0))) for b in (dist.lower, dist.upper))
    u = _interleave(_unit(high), _unit(low))
    x = u.mul_(_f32(2.0 * (hi - lo))).add_(_f32(2.0 * lo - 1.0))
    values = _erfinv(x).mul_(_f32(math.sqrt(2.0) * dist.std)).add_(_f32(dist.mean))
    return values.clamp_(
        _f32(dist.mean + dist.lower * dist.std), _f32(dist.mean + dist.upper * dist.std)
    )


def _erfinv(x: torch.Tensor) -> torch.Tensor:
    """erfinv on (-1, 1), Giles' single-precision approximation; both branches computed and the
    one for each element kept by exact products with 0 and 1."""
    w = _log((1.0 - x).mul_(x + 1.0)).neg_()
    tail = (w >= 5.0).to(torch.float32)
    central = _polynomial(w - 2.5, _ERFINV_CENTRAL)
    outer = _polynomial(w.sqrt_().sub_(3.0), _ERFINV_TAIL)
    return central.mul_(1.0 - tail).add_(outer.mul_(tail)).mul_(x)


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
