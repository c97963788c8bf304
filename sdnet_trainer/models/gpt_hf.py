"""The GPT (``models/gpt.py``) as a Hugging Face GPT-2, for ``format=hf``: config.json as
``transformers.GPT2Config`` reads it, and the tensors under ``GPT2LMHeadModel``'s names.

GPT-2 is this GPT's architecture (learned positions, pre-norm blocks, LayerNorms of eps 1e-5,
attention scaled by 1/sqrt(head_dim), the exact GELU that config.json's
``activation_function: gelu`` names), laid out differently in three ways:

- its linear layers are ``Conv1D``s, ``x @ W + b``, whose weight is the transpose of
  ``nn.Linear``'s;
- its query, key and value projections are one layer (``attn.c_attn``: the three side by side,
  in that order, so its heads are this model's heads);
- every linear layer and LayerNorm has a bias, which transformers' GPT-2 cannot leave out.

Where this GPT has no bias (its linear layers always, its LayerNorms under
``model.gpt.bias=false``) a zero one is written. That is exactly this model: ``x @ W + 0`` is
``x @ W`` and a LayerNorm's ``y * w + 0`` is ``y * w``, element by element (adding zero changes no
number), so the GPT-2 computes this model's function (its logits equal to the rounding of
another matmul kernel); fine-tuned in transformers, those biases then train like any other
weight. A tied output layer (``model.gpt.tie_embeddings``) is stored once,
as ``transformer.wte.weight``, and ``tie_word_embeddings: true`` has transformers tie
``lm_head`` back to it; an untied one is ``lm_head.weight``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _conv1d(out: dict[str, torch.Tensor], name: str, *linears: nn.Linear) -> None:
    """``linears`` (one, or several side by side) as one GPT-2 ``Conv1D``: weight (in, out)."""
    out[f"{name}.weight"] = torch.cat([linear.weight for linear in linears]).T
    out[f"{name}.bias"] = torch.cat([_bias(linear.weight, linear.bias) for linear in linears])


def _norm(out: dict[str, torch.Tensor], name: str, norm: nn.LayerNorm) -> None:
    out[f"{name}.weight"] = norm.weight
    out[f"{name}.bias"] = _bias(norm.weight, norm.bias)


def _bias(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # A missing bias is a zero one (see the module docstring), one per output channel.
    return bias if bias is not None else weight.new_zeros(weight.shape[0])


def gpt2_tensors(model: Any) -> dict[str, torch.Tensor]:
    """A whole :class:`~sdnet_trainer.models.gpt.GPT`'s tensors under ``GPT2LMHeadModel``'s names
    (views of the model's or new ones: ``format=hf`` writes them as they are)."""
    with torch.no_grad():
        out: dict[str, torch.Tensor] = {
            "transformer.wte.weight": model.embed.tok.weight,
            "transformer.wpe.weight": model.embed.pos.weight,
        }
        for i, block in enumerate(model.blocks):
            at = f"transformer.h.{i}"
            attn, mlp = block.attn, block.mlp
            _norm(out, f"{at}.ln_1", block.norm1)
            _conv1d(out, f"{at}.attn.c_attn", attn.wq, attn.wk, attn.wv)
            _conv1d(out, f"{at}.attn.c_proj", attn.wo)
            _norm(out, f"{at}.ln_2", block.norm2)
            _conv1d(out, f"{at}.mlp.c_fc", mlp.w1)
            _conv1d(out, f"{at}.mlp.c_proj", mlp.w2)
        _norm(out, "transformer.ln_f", model.norm)
        if not model.tie_embeddings:
            out["lm_head.weight"] = model.head.weight
    return out


def gpt2_config(model: Any, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of ``model`` (a :class:`~sdnet_trainer.models.gpt.GPT`) as a GPT-2."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_positions": model.seq_len,
        "n_embd": model.dim,
        "n_layer": model.n_layers,
        "n_head": model.n_heads,
        "n_inner": model.hidden,
        # torch's exact GELU, F.gelu (GPT-2's own "gelu_new" is the tanh approximation).
        "activation_function": "gelu",
        "resid_pdrop": model.dropout,
        "embd_pdrop": model.dropout,
        "attn_pdrop": model.dropout,
        "layer_norm_epsilon": model.norm.eps,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": model.tie_embeddings,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


__all__ = ["gpt2_config", "gpt2_tensors"]
