"""Whether this machine can train float8 on the CPU: torchao installed, and a CPU
torch._scaled_mm that computes the recipe's products. Shared by the float8 unit tests and the
layouts' float8 cases (tests/distributed/test_layouts.py), which leave a case out of their launch
where it could not run rather than fail the whole launch."""

from __future__ import annotations

import importlib.util
from functools import cache

import torch


@cache
def scaled_mm_refusal(recipe: str) -> str | None:
    """Why this machine's CPU torch._scaled_mm cannot compute a product as ``recipe`` scales it
    (float8_e4m3fn operands, fp32 scales: one per tensor, or one per row of the first operand
    and per column of the second, as torchao passes them), or None where it can. Asked of a
    16x16 product, not of the torch version: the CPU kernels differ by build and by CPU too."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants it
    shapes = {"tensorwise": ((), ()), "rowwise": ((16, 1), (1, 16))}[recipe]
    scale_a, scale_b = (torch.ones(shape) for shape in shapes)
    try:
        out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"torch {torch.__version__}'s CPU torch._scaled_mm refuses {recipe} scales: {reason}"
    if not torch.equal(out, torch.full((16, 16), 16.0, dtype=torch.bfloat16)):
        return f"torch {torch.__version__}'s CPU torch._scaled_mm computes {recipe} scales wrong"
    return None


def float8_cpu_refusal(recipe: str) -> str | None:
    """:func:`scaled_mm_refusal`, or first that the float8 extra (torchao) is not installed."""
    if importlib.util.find_spec("torchao") is None:
        return "the float8 extra (torchao) is not installed"
    return scaled_mm_refusal(recipe)
