"""A GPT-style decoder-only language model, laid out for every parallelism the trainer offers.

The structure is deliberately flat: ``embed -> blocks[0..n) -> norm -> head``, each a child
module that takes and returns one tensor. That one shape, shared with the Llama family, serves
three consumers through :class:`~sdnet_trainer.models.decoder.Decoder` and the GPT's declared
:data:`~sdnet_trainer.models.parallel_spec.GPT_LAYOUT`:

- pipeline parallelism cuts the model at unit boundaries (``pipeline_units``), which is also why
  a head tied to the token embedding (``tie_embeddings``, GPT-2's) is refused there: the two
  would live on different stages;
- FSDP, activation checkpointing and ``torch.compile`` wrap one transformer block at a time
  (``parallel_blocks``);
- tensor parallelism (``apply_tensor_parallel``) shards the linear layers Megatron-style.
  Attention derives the number of heads from the *local* projection width, so the same forward
  runs unchanged whether a rank holds all heads or only its share of them.

The linear layers have no biases; the LayerNorms have them unless ``bias=False`` (nanoGPT's
``bias=False``). Hugging Face sees it as a GPT-2 (``models/gpt_hf.py``, ``format=hf``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sdnet_trainer.config.schema import Config, ModelConfig
from sdnet_trainer.data import is_language_model_data
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.attention import CausalAttention, token_positions
from sdnet_trainer.models.decoder import (
    Decoder,
    Named,
    check_head_shards,
    check_sequence,
    check_sequence_shards,
)
from sdnet_trainer.models.family import HFAdapter, ModelFamily, check_kwargs, config_dict
from sdnet_trainer.models.gpt_hf import gpt2_config, gpt2_tensors
from sdnet_trainer.models.parallel_spec import GPT_LAYOUT

_MODEL_GPT: Named = "model.gpt.{}={}".format


class Embedding(nn.Module):
    """Token embedding plus a learned position embedding, then dropout: (B, T) -> (B, T, dim)."""

    def __init__(self, vocab_size: int, seq_len: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.drop = nn.Dropout(dropout)
        self.seq_len = seq_len
        # Set by tensor parallelism with sequence parallel: the sequence is split into this many
        # equal shards, so T must divide evenly.
        self.sequence_shards = 1
        # The tokens' positions where a layout sets them (models/attention.py).
        self.positions: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        check_sequence(
            tokens.shape[1],
            seq_len=self.seq_len,
            sequence_shards=self.sequence_shards,
            context_key="model.gpt.seq_len",
        )
        positions = token_positions(self.positions, tokens.shape[1], tokens.device)
        return self.drop(self.tok(tokens) + self.pos(positions))


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v/o projections (shardable by columns)."""

    def __init__(self, dim: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.dropout = dropout
        self.drop = nn.Dropout(dropout)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length = x.shape[:2]

        def heads(t: torch.Tensor) -> torch.Tensor:
            # -1, not n_heads: under tensor parallelism this rank's projection holds only its heads.
            return t.view(batch, length, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        out = self.core(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        out = out.transpose(1, 2).reshape(batch, length, -1)
        return self.drop(self.wo(out))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.w2(F.gelu(self.w1(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``; the
    LayerNorms without a bias when not ``bias``."""

    def __init__(self, dim: int, n_heads: int, hidden: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, bias=bias)
        self.attn = Attention(dim, n_heads, dropout)
        self.norm2 = nn.LayerNorm(dim, bias=bias)
        self.mlp = MLP(dim, hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(Decoder):
    """Decoder-only transformer: int64 tokens (B, T) with T <= seq_len -> logits (B, T,
    vocab_size). The keyword arguments are ``model.gpt``'s keys."""

    layout = GPT_LAYOUT
    config_key = "model.gpt"

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        dim: int,
        n_layers: int,
        n_heads: int,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        tie_embeddings: bool = False,
        bias: bool = True,
    ) -> None:
        super().__init__()
        _check_sizes(
            vocab_size=vocab_size,
            seq_len=seq_len,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            mlp_ratio=mlp_ratio,
            dropout=dropout,
        )
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.dim = dim
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.dropout = dropout
        self.mlp_ratio = mlp_ratio
        self.hidden = int(mlp_ratio * dim)
        self.tie_embeddings = tie_embeddings
        # Not ``self.bias``: code that walks modules reads a module's ``bias`` as its tensor.
        self.norm_bias = bias
        self.embed = Embedding(vocab_size, seq_len, dim, dropout)
        self.blocks = nn.ModuleList(
            Block(dim, n_heads, self.hidden, dropout, bias) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(dim, bias=bias)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self._tie()
        # Every parameter from its distribution (Decoder.distribution: GPT-2's init), a tied
        # weight once, as the embedding.
        self.apply_own_init()

    def check_tensor_parallel(self, tp: int, *, sequence_parallel: bool) -> None:
        """Whether this GPT shards over ``tp`` ranks (see :meth:`Decoder.apply_tensor_parallel`)."""
        check_tensor_parallel(
            n_heads=self.n_heads,
            dim=self.dim,
            mlp_ratio=self.mlp_ratio,
            seq_len=self.seq_len,
            dropout=self.dropout,
            tp=tp,
            sequence_parallel=sequence_parallel,
        )


def validate_gpt(cfg: Config, *, tp: int, pp: int = 1) -> None:
    """``model.gpt.*`` (for ``model.name=gpt``) against the data, ``parallel.tp`` and
    ``parallel.pp``, before launch."""
    data, gpt = cfg.data, cfg.model.gpt
    sizes = gpt_sizes(cfg.model)
    if pp > 1 and sizes["tie_embeddings"]:
        raise ConfigError(
            f"model.gpt.tie_embeddings=true with parallel.pp={pp}: the token embedding and the "
            f"output layer share one weight and cannot live on different pipeline stages "
            f"(parallel.pp=1, or model.gpt.tie_embeddings=false)"
        )
    if is_language_model_data(data):
        if data.vocab_size != gpt.vocab_size:
            raise ConfigError(
                f"data.vocab_size={data.vocab_size} differs from "
                f"model.gpt.vocab_size={gpt.vocab_size}"
            )
        if data.seq_len > gpt.seq_len:
            raise ConfigError(
                f"data.seq_len={data.seq_len} is longer than the model's context "
                f"model.gpt.seq_len={gpt.seq_len}"
            )
    if tp > 1:
        check_tensor_parallel(
            n_heads=gpt.n_heads,
            dim=gpt.dim,
            mlp_ratio=gpt.mlp_ratio,
            seq_len=gpt.seq_len,
            dropout=gpt.dropout,
            tp=tp,
            sequence_parallel=cfg.parallel.tensor_parallel.sequence_parallel,
        )


def check_tensor_parallel(
    *,
    n_heads: int,
    dim: int,
    mlp_ratio: float,
    seq_len: int,
    dropout: float,
    tp: int,
    sequence_parallel: bool,
) -> None:
    """Whether a GPT of these sizes shards over ``tp`` ranks (Megatron-style, see
    :meth:`Decoder.apply_tensor_parallel`)."""
    check_head_shards({"n_heads": n_heads}, tp=tp, named=_MODEL_GPT)
    hidden = int(mlp_ratio * dim)
    if hidden % tp:
        # Row-parallel w2 takes equal slices of the hidden channels (the vocabulary may be uneven).
        raise ConfigError(
            f"model.gpt.mlp_ratio={mlp_ratio} x model.gpt.dim={dim} = {hidden} "
            f"MLP channels must be divisible by parallel.tp={tp}"
        )
    check_sequence_shards(seq_len, tp=tp, sequence_parallel=sequence_parallel, named=_MODEL_GPT)
    if dropout > 0 and not sequence_parallel:
        # Without sequence parallel the residual stream is replicated, and each rank would
        # drop different elements of its copy (ranks draw their own random streams): the
        # copies drift apart. With it, every rank drops only in its own sequence slice.
        raise ConfigError(
            f"model.gpt.dropout={dropout} with parallel.tp={tp} needs "
            f"parallel.tensor_parallel.sequence_parallel=true (or model.gpt.dropout=0)"
        )


def _check_sizes(**sizes: Any) -> None:
    for key in ("vocab_size", "seq_len", "dim", "n_layers", "n_heads"):
        if sizes[key] < 1:
            raise ConfigError(f"model.gpt.{key}={sizes[key]} must be >= 1")
    if sizes["dim"] % sizes["n_heads"]:
        raise ConfigError(
            f"model.gpt.dim={sizes['dim']} must be divisible by model.gpt.n_heads="
            f"{sizes['n_heads']}: each head gets dim / n_heads channels"
        )
    if int(sizes["mlp_ratio"] * sizes["dim"]) < 1:
        raise ConfigError(
            f"model.gpt.mlp_ratio={sizes['mlp_ratio']} gives an empty MLP at "
            f"model.gpt.dim={sizes['dim']}"
        )
    if not 0.0 <= sizes["dropout"] < 1.0:
        raise ConfigError(f"model.gpt.dropout={sizes['dropout']} must be in [0, 1)")


def gpt_sizes(cfg: ModelConfig) -> dict[str, Any]:
    """``GPT``'s constructor arguments: ``model.gpt``, with ``model.kwargs`` overriding single
    sizes."""
    if cfg.weights is not None:
        raise ConfigError(
            f"model.weights={cfg.weights!r}: model.name={cfg.name!r} has no pretrained weights"
        )
    sizes = config_dict(cfg.gpt)
    # The schema rejects unknown keys in model.gpt, but model.kwargs is a free-form dict.
    check_kwargs(cfg, sizes, "model.gpt")
    return {**sizes, **cfg.kwargs}


def _decoder_sizes(cfg: ModelConfig) -> tuple[int, int]:
    sizes = {**config_dict(cfg.gpt), **cfg.kwargs}
    return int(sizes["dim"]), int(sizes["n_layers"])


def hf_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The GPT's tensors under GPT-2's names (``models/gpt_hf.py``); a tied output layer once."""
    if not isinstance(model, GPT):
        raise ConfigError(
            f"model.name=gpt's Hugging Face names are a GPT's; this model is a "
            f"{type(model).__name__}"
        )
    return gpt2_tensors(model)


FAMILY = ModelFamily(
    name="gpt",
    build=lambda cfg: GPT(**gpt_sizes(cfg)),
    language=True,
    context_parallel=True,
    validate=lambda cfg, *, tp, pp: validate_gpt(cfg, tp=tp, pp=pp),
    decoder_sizes=_decoder_sizes,
    # format=hf: a GPT-2 (transformers' GPT2LMHeadModel), zero biases where the GPT has none.
    hf=HFAdapter(tensors=hf_tensors, config=gpt2_config),
)
