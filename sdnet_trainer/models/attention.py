"""The attention kernel the decoder families share, as a module of its own.

``CausalAttention`` is ``softmax(q k^T / sqrt(d)) v`` over each query's own and earlier positions,
torch's ``scaled_dot_product_attention``, nothing more: no parameters, so adding it changes no
state-dict key. It is the one place a layout replaces the kernel: context parallel
(``distributed/context_parallel.py``) computes attention across the sequence's shards there.

A module that needs the positions of its tokens (rotary angles, a learned position table)
declares a ``positions`` attribute: None means ``0..T-1``; context parallel sets it to the
positions of the tokens this rank holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sdnet_trainer.errors import ConfigError


class CausalAttention(nn.Module):
    """(B, heads, T, head_dim) queries over (B, kv_heads, T, head_dim) keys and values; grouped
    queries when there are fewer key/value heads. ``attend``, where a layout sets it, computes
    it instead (context parallel: this rank's queries over the whole sequence)."""

    attend: Callable[..., torch.Tensor] | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0
    ) -> torch.Tensor:
        if self.attend is not None:
            return self.attend(q, k, v, dropout_p=dropout_p)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=q.shape[1] != k.shape[1]
        )


def token_positions(
    positions: torch.Tensor | None, length: int, device: torch.device
) -> torch.Tensor:
    """The positions of a sequence's ``length`` tokens: ``positions`` where a layout set them
    (context parallel: this rank's share, checked against ``length``), else ``0..length-1``."""
    if positions is None:
        return torch.arange(length, device=device)
    if positions.shape[0] != length:
        raise ConfigError(
            f"context parallel was set up for {positions.shape[0]} tokens per sequence on this "
            f"rank, but a batch has {length}: every batch must have data.seq_len tokens"
        )
    return positions


__all__ = ["CausalAttention", "token_positions"]
