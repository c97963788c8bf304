"""Rotary position embeddings (RoPE) with Llama 3's frequency scaling, in Hugging Face's layout.

Each head's channels are rotated in pairs (i, i + head_dim / 2) by an angle proportional to the
position: ``x * cos + rotate_half(x) * sin`` as in ``transformers``' Llama, so checkpoints of that
layout load with no permutation of the query and key projections (Meta's original weights pair
adjacent channels instead; Hugging Face's conversion script permutes them once, and this project
reads the converted ones).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.attention import token_positions

ROPE_TYPES = ("default", "llama3")


def inverse_frequencies(
    head_dim: int,
    *,
    theta: float,
    rope_type: str = "default",
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> torch.Tensor:
    """theta ** (-2i / head_dim) for i < head_dim / 2, in float32; with ``rope_type="llama3"``
    the wavelengths longer than the original context / low_freq_factor slowed by ``factor``,
    those shorter than context / high_freq_factor kept, and a smooth blend between (Llama 3.1)."""
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_type={rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "default":
        return inv_freq
    context = original_max_position_embeddings
    low_wavelen, high_wavelen = context / low_freq_factor, context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class Rotary(nn.Module):
    """Applies the rotation to queries and keys of shape (B, heads, T, head_dim) at positions
    0..T-1 (or ``positions``: models/attention.py). Its one buffer (the inverse frequencies) is
    computed, never saved: checkpoints hold only the projections."""

    inv_freq: torch.Tensor
    positions: torch.Tensor | None = None

    def __init__(self, head_dim: int, *, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = dict(scaling or {})
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Also the init step that fills the buffer after a build on the meta device.
        with torch.no_grad():
            freqs = inverse_frequencies(self.head_dim, theta=self.theta, **self.scaling)
            self.inv_freq.copy_(freqs.to(self.inv_freq.device))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = token_positions(self.positions, q.shape[-2], q.device).float()
        # In float32 whatever the compute dtype, as transformers does (angles reach 1e5 radians);
        # an elementwise product, which autocast leaves alone, rather than a matmul.
        freqs = positions[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


__all__ = ["ROPE_TYPES", "Rotary", "inverse_frequencies"]
