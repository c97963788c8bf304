"""The mixture-of-experts decoder (Qwen3-MoE and Mixtral shapes), laid out like the Llama for the
parallel layouts.

``embed -> blocks[0..n) -> norm -> head`` as every decoder here (``models/decoder.py``), each
block ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))`` with RMSNorms. The embedding and the
attention are the Llama's (``models/llama/model.py``), the attention with its two Qwen3 settings:
the head size ``head_dim`` of its own (not ``dim / n_heads``), and with ``qk_norm`` each query and
key head passing an RMSNorm over its channels before the rotation. The MLP is a
:class:`~.experts.MoE`: a router and stacked SwiGLU experts. Parameter names map one to one onto
Hugging Face's Qwen3-MoE and Mixtral (``models/moe/hf.py``), whose rotary layout this model uses.

Tensor parallel is refused (:func:`refuse_tensor_parallel`): it would split the attention and
leave every expert whole on each tensor-parallel rank, computing each token's experts ``tp``
times. Expert parallel (``parallel.ep``) splits the experts.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from sdnet_trainer.config.schema import Config
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.decoder import (
    INIT_STD,
    Decoder,
    Named,
    check_data_and_stages,
)
from sdnet_trainer.models.init_values import Distribution, Normal
from sdnet_trainer.models.llama.model import Attention, Embedding, RMSNorm, norm_distribution
from sdnet_trainer.models.moe.experts import LOAD_BALANCE, GroupedExperts, MoE
from sdnet_trainer.models.parallel_spec import MOE_LAYOUT

# Names the size checks use when the sizes are model.moe's own.
_MODEL_MOE: Named = "model.moe.{}={}".format


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` with ``mlp`` a MoE.
    ``attn`` and ``mlp`` build the two, called in the order of the block's modules (the order
    its init replays their draws in)."""

    def __init__(
        self, attn: Callable[[], Attention], mlp: Callable[[], MoE], *, dim: int, eps: float
    ) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim, eps)
        self.attn = attn()
        self.norm2 = RMSNorm(dim, eps)
        self.mlp = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MoEDecoder(Decoder):
    """int64 tokens (B, T) with T <= seq_len -> logits (B, T, vocab_size). The keyword arguments
    are ``model.moe``'s keys; ``bias_update_rate`` is kept for the training loop, which moves
    each layer's routing bias by it (:meth:`MoE.update_bias`)."""

    layout = MOE_LAYOUT
    config_key = "model.moe"

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        dim: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        qk_norm: bool = True,
        num_experts: int = 4,
        top_k: int = 2,
        moe_hidden_dim: int = 128,
        num_shared_experts: int = 0,
        norm_topk_prob: bool = True,
        load_balance: str = "aux_loss",
        aux_loss_coeff: float = 0.001,
        bias_update_rate: float = 0.001,
        norm_eps: float = 1e-6,
        rope_theta: float = 1000000.0,
        tie_embeddings: bool = False,
    ) -> None:
        super().__init__()
        check_sizes(
            {
                "vocab_size": vocab_size,
                "seq_len": seq_len,
                "dim": dim,
                "n_layers": n_layers,
                "n_heads": n_heads,
                "n_kv_heads": n_kv_heads,
                "head_dim": head_dim,
                "num_experts": num_experts,
                "top_k": top_k,
                "moe_hidden_dim": moe_hidden_dim,
                "num_shared_experts": num_shared_experts,
                "load_balance": load_balance,
                "aux_loss_coeff": aux_loss_coeff,
                "bias_update_rate": bias_update_rate,
            }
        )
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        head_dim = dim // n_heads if head_dim is None else head_dim
        self.vocab_size, self.seq_len, self.dim, self.n_layers = vocab_size, seq_len, dim, n_layers
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.qk_norm, self.num_experts, self.top_k = qk_norm, num_experts, top_k
        self.moe_hidden_dim, self.num_shared_experts = moe_hidden_dim, num_shared_experts
        self.norm_topk_prob, self.load_balance = norm_topk_prob, load_balance
        self.aux_loss_coeff, self.bias_update_rate = aux_loss_coeff, bias_update_rate
        self.norm_eps, self.rope_theta, self.tie_embeddings = norm_eps, rope_theta, tie_embeddings
        self.embed = Embedding(vocab_size, seq_len, dim, context_key="model.moe.seq_len")
        self.blocks = nn.ModuleList(
            Block(
                partial(
                    Attention,
                    dim,
                    n_heads,
                    n_kv_heads,
                    theta=rope_theta,
                    head_dim=head_dim,
                    qk_norm=qk_norm,
                    eps=norm_eps,
                ),
                partial(
                    MoE,
                    dim,
                    num_experts,
                    top_k,
                    moe_hidden_dim,
                    num_shared_experts=num_shared_experts,
                    norm_topk_prob=norm_topk_prob,
                    load_balance=load_balance,
                    aux_loss_coeff=aux_loss_coeff,
                ),
                dim=dim,
                eps=norm_eps,
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
        """The stacked experts as linear layers (``w2`` writes into the residual stream); the
        RMSNorms at one."""
        if isinstance(module, GroupedExperts):
            return Normal(residual_std if name == "w2" else INIT_STD)
        return norm_distribution(module)

    def check_tensor_parallel(self, tp: int, *, sequence_parallel: bool) -> None:
        refuse_tensor_parallel(tp)


def check_sizes(sizes: dict[str, Any], named: Named = _MODEL_MOE) -> None:
    """The sizes a MoE decoder can be built with (``model.moe``'s keys, ``n_kv_heads`` and
    ``head_dim`` may be None); each error names its key as ``named(key, value)`` does."""
    positive = ("vocab_size", "seq_len", "dim", "n_layers", "n_heads", "num_experts", "top_k")
    for key in (*positive, "moe_hidden_dim", "n_kv_heads", "head_dim"):
        value = sizes[key]
        if value is not None and value < 1:
            raise ConfigError(f"{named(key, value)} must be >= 1")
    for key in ("num_shared_experts", "aux_loss_coeff", "bias_update_rate"):
        if sizes[key] < 0:
            raise ConfigError(f"{named(key, sizes[key])} must be >= 0")
    dim, heads, head_dim = sizes["dim"], sizes["n_heads"], sizes["head_dim"]
    if head_dim is None and dim % heads:
        raise ConfigError(
            f"{named('dim', dim)} must be divisible by {named('n_heads', heads)} when the head "
            f"size is dim / n_heads (model.moe.head_dim=null)"
        )
    if (head_dim or dim // heads) % 2:
        raise ConfigError(
            f"the head size {named('head_dim', head_dim or dim // heads)} must be even (rotary "
            f"positions rotate channel pairs)"
        )
    kv_heads = sizes["n_kv_heads"] or heads
    if heads % kv_heads:
        raise ConfigError(
            f"{named('n_heads', heads)} must be a multiple of {named('n_kv_heads', kv_heads)}: "
            f"each key/value head serves a group of query heads"
        )
    if sizes["top_k"] > sizes["num_experts"]:
        raise ConfigError(
            f"{named('top_k', sizes['top_k'])} experts per token is more than the layer's "
            f"{named('num_experts', sizes['num_experts'])}"
        )
    if sizes["load_balance"] not in LOAD_BALANCE:
        raise ConfigError(
            f"{named('load_balance', repr(sizes['load_balance']))} is not one of "
            f"{', '.join(LOAD_BALANCE)}"
        )


def refuse_tensor_parallel(tp: int) -> None:
    """Tensor parallel would split the attention and leave the experts whole on every
    tensor-parallel rank: each would compute every token's experts again (``tp`` x the experts'
    FLOPs and activations), where a plan counts them split. Refused until the experts split over
    ``tp`` (expert tensor parallel); expert parallel splits them over data-parallel ranks."""
    if tp > 1:
        raise ConfigError(
            f"parallel.tp={tp} with a mixture of experts: tensor parallel would compute every "
            f"expert on each of the {tp} tensor-parallel ranks (the experts are not split over "
            f"tp); use parallel.tp=1 and split the experts with parallel.ep (parallel=fsdp, "
            f"ranks taken from parallel.dp_shard)"
        )


def validate_moe(
    cfg: Config, sizes: dict[str, Any], *, tp: int, pp: int, named: Named = _MODEL_MOE
) -> None:
    """The MoE decoder's ``sizes`` (``model.moe``, or a Hugging Face config's) against the data
    and the layout, before launch; ``named(key, value)`` says where a size came from
    (``model.moe.KEY=VALUE``, or config.json's field), for the messages."""
    check_sizes(sizes, named)
    check_data_and_stages(cfg, sizes, pp=pp, named=named)
    if sizes["load_balance"] == "aux_loss" and cfg.precision.dtype == "fp16":
        # The auxiliary loss's gradient enters backward beside the loss, not through it, so the
        # fp16 GradScaler's scale would not be on it.
        raise ConfigError(
            "model.moe.load_balance=aux_loss with precision.dtype=fp16: use precision=bf16 (or "
            "model.moe.load_balance=bias, which has no loss)"
        )
    refuse_tensor_parallel(tp)


__all__ = ["MoEDecoder", "check_sizes", "refuse_tensor_parallel", "validate_moe"]
