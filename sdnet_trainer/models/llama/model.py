"""The Llama architecture (Llama 2/3 shapes), laid out like the GPT for every parallel layout.

``embed -> blocks[0..n) -> norm -> head`` as the GPT (see ``models/decoder.py``), with Llama's
parts: RMSNorm before attention and MLP, rotary positions (with Llama 3's frequency scaling,
``models/rotary.py``) applied to queries and keys inside attention, grouped-query attention
(``n_kv_heads`` key/value heads, each shared by ``n_heads / n_kv_heads`` query heads) through
``F.scaled_dot_product_attention``, and a SwiGLU MLP ``w2(silu(w1 x) * w3 x)``. Parameter names
map one to one onto Hugging Face's ``LlamaForCausalLM`` (``models/llama/hf.py``), whose rotary
layout this model uses, so its checkpoints load and export without permutation.

The output layer may share the token embedding's weights (``tie_embeddings``, Llama 3.2 1B and
3B): one parameter under two names, which pipeline parallelism cannot split over stages.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sdnet_trainer.config.schema import Config
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.attention import CausalAttention
from sdnet_trainer.models.decoder import (
    Decoder,
    Named,
    check_data_and_stages,
    check_head_shards,
    check_sequence,
    check_sequence_shards,
)
from sdnet_trainer.models.init_values import Constant, Distribution
from sdnet_trainer.models.parallel_spec import LLAMA_LAYOUT
from sdnet_trainer.models.rotary import ROPE_TYPES, Rotary

_MODEL_LLAMA: Named = "model.llama.{}={}".format


class Embedding(nn.Module):
    """Token embedding alone (positions are rotary, inside attention): (B, T) -> (B, T, dim).
    ``context_key``: the key a too long sequence is named by (the MoE family's own)."""

    def __init__(
        self, vocab_size: int, seq_len: int, dim: int, *, context_key: str = "model.llama.seq_len"
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.seq_len, self.context_key = seq_len, context_key
        # Set by tensor parallelism with sequence parallel (see the GPT's Embedding).
        self.sequence_shards = 1

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        check_sequence(
            tokens.shape[1],
            seq_len=self.seq_len,
            sequence_shards=self.sequence_shards,
            context_key=self.context_key,
        )
        return self.tok(tokens)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the mean square taken in float32 (as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def norm_distribution(module: nn.Module) -> Distribution | None:
    """An RMSNorm's weight starts at one (the identity)."""
    return Constant(1.0) if isinstance(module, RMSNorm) else None


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions; head counts follow the local
    projection widths (tensor parallelism gives each rank whole query and key/value heads).
    ``head_dim`` defaults to ``dim / n_heads``; with ``qk_norm`` (Qwen3's, the MoE family's) an
    RMSNorm of ``eps`` on each query and key head, over its channels, before the rotation."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        *,
        theta: float,
        scaling: dict | None = None,
        head_dim: int | None = None,
        qk_norm: bool = False,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.head_dim = dim // n_heads if head_dim is None else head_dim
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.rotary = Rotary(self.head_dim, theta=theta, scaling=scaling)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length = x.shape[:2]

        def heads(t: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
            t = t.view(batch, length, -1, self.head_dim)  # (B, T, heads, head_dim)
            return (t if norm is None else norm(t)).transpose(1, 2)

        q, k = heads(self.wq(x), self.q_norm), heads(self.wk(x), self.k_norm)
        v = heads(self.wv(x))
        q, k = self.rotary(q, k)
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (Hugging Face: gate_proj, up_proj, down_proj)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        hidden: int,
        *,
        eps: float,
        theta: float,
        scaling: dict,
    ) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim, eps)
        self.attn = Attention(dim, n_heads, n_kv_heads, theta=theta, scaling=scaling)
        self.norm2 = RMSNorm(dim, eps)
        self.mlp = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Llama(Decoder):
    """int64 tokens (B, T) with T <= seq_len -> logits (B, T, vocab_size). The keyword
    arguments are ``model.llama``'s keys (``rope_scaling`` as a dict)."""

    layout = LLAMA_LAYOUT
    config_key = "model.llama"

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        dim: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        hidden_dim: int = 344,
        norm_eps: float = 1e-5,
        rope_theta: float = 500000.0,
        rope_scaling: dict[str, Any] | None = None,
        tie_embeddings: bool = False,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        scaling = dict(rope_scaling or {"rope_type": "default"})
        check_sizes(
            vocab_size=vocab_size,
            seq_len=seq_len,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            hidden_dim=hidden_dim,
            rope_scaling=scaling,
        )
        self.vocab_size, self.seq_len, self.dim = vocab_size, seq_len, dim
        self.n_layers, self.n_heads, self.n_kv_heads = n_layers, n_heads, n_kv_heads
        self.hidden_dim, self.norm_eps, self.rope_theta = hidden_dim, norm_eps, rope_theta
        self.rope_scaling = scaling
        self.tie_embeddings = tie_embeddings
        self.embed = Embedding(vocab_size, seq_len, dim)
        self.blocks = nn.ModuleList(
            Block(
                dim,
                n_heads,
                n_kv_heads,
                hidden_dim,
                eps=norm_eps,
                theta=rope_theta,
                scaling=scaling,
            )
            for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim, norm_eps)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self._tie()
        self.apply_own_init()

    def module_distribution(
        self, module: nn.Module, name: str, *, residual_std: float
    ) -> Distribution | None:
        return norm_distribution(module)

    def check_tensor_parallel(self, tp: int, *, sequence_parallel: bool) -> None:
        check_tensor_parallel(
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            hidden_dim=self.hidden_dim,
            seq_len=self.seq_len,
            tp=tp,
            sequence_parallel=sequence_parallel,
        )


def check_sizes(**sizes: Any) -> None:
    """The sizes a Llama can be built with, each error naming its ``model.llama`` key."""
    for key in ("vocab_size", "seq_len", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim"):
        if sizes[key] < 1:
            raise ConfigError(f"model.llama.{key}={sizes[key]} must be >= 1")
    if sizes["dim"] % sizes["n_heads"] or (sizes["dim"] // sizes["n_heads"]) % 2:
        raise ConfigError(
            f"model.llama.dim={sizes['dim']} must be divisible by model.llama.n_heads="
            f"{sizes['n_heads']} into an even head size (rotary positions rotate channel pairs)"
        )
    if sizes["n_heads"] % sizes["n_kv_heads"]:
        raise ConfigError(
            f"model.llama.n_heads={sizes['n_heads']} must be a multiple of "
            f"model.llama.n_kv_heads={sizes['n_kv_heads']}: each key/value head serves a group "
            f"of query heads"
        )
    rope_type = sizes["rope_scaling"].get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"model.llama.rope_scaling.rope_type={rope_type!r} is not one of "
            f"{', '.join(ROPE_TYPES)}"
        )


def check_tensor_parallel(
    *,
    n_heads: int,
    n_kv_heads: int,
    hidden_dim: int,
    seq_len: int,
    tp: int,
    sequence_parallel: bool,
) -> None:
    """Whether a Llama of these sizes shards over ``tp`` ranks: whole query and key/value heads
    and equal MLP slices on every rank."""
    check_head_shards({"n_heads": n_heads, "n_kv_heads": n_kv_heads}, tp=tp, named=_MODEL_LLAMA)
    if hidden_dim % tp:
        raise ConfigError(
            f"model.llama.hidden_dim={hidden_dim} MLP channels must be divisible by "
            f"parallel.tp={tp}"
        )
    check_sequence_shards(seq_len, tp=tp, sequence_parallel=sequence_parallel, named=_MODEL_LLAMA)


def validate_llama(
    cfg: Config,
    sizes: dict[str, Any],
    *,
    tp: int,
    pp: int,
    named: Named = _MODEL_LLAMA,
) -> None:
    """The Llama's ``sizes`` (``model.llama``, or a Hugging Face config's) against the data and
    the layout, before launch; ``named(key, value)`` says where a size came from
    (``model.llama.KEY=VALUE``, or config.json's field), for the messages."""
    check_data_and_stages(cfg, sizes, pp=pp, named=named)
    if tp > 1:
        check_tensor_parallel(
            n_heads=sizes["n_heads"],
            n_kv_heads=sizes.get("n_kv_heads") or sizes["n_heads"],
            hidden_dim=sizes["hidden_dim"],
            seq_len=sizes["seq_len"],
            tp=tp,
            sequence_parallel=cfg.parallel.tensor_parallel.sequence_parallel,
        )


__all__ = ["Llama", "check_sizes", "check_tensor_parallel", "validate_llama"]
