"""Typed schemas of the language models' sizes: ``model.gpt`` (``sdnet_trainer/models/gpt.py``)
and ``model.llama`` (``sdnet_trainer/models/llama/``), kept beside ``schema.py``, whose
``ModelConfig`` includes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128  # the context length: the largest sequence the position embedding covers
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0


@dataclass
class RopeScalingConfig:
    # default: plain rotary frequencies; llama3: Llama 3.1's scaling for long contexts (the
    # low frequencies slowed by `factor`, a smooth blend between low_freq_factor and
    # high_freq_factor of the original context's wavelengths), as Hugging Face's rope_type.
    rope_type: str = "default"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class LlamaConfig:
    # The Llama architecture (model.name=llama; configs/model/llama3_*): RMSNorm, rotary
    # positions, a SwiGLU MLP, grouped-query attention. Hugging Face's LlamaConfig names in
    # brackets; model.hf_config / model.weights=hf:PATH take them from a config.json instead.
    vocab_size: int = 256
    seq_len: int = 128  # the longest sequence it is used on (max_position_embeddings)
    dim: int = 128  # (hidden_size)
    n_layers: int = 2  # (num_hidden_layers)
    n_heads: int = 4  # (num_attention_heads)
    # Key/value heads, each shared by n_heads / n_kv_heads query heads; null: n_heads (no
    # grouping). (num_key_value_heads)
    n_kv_heads: Optional[int] = None
    hidden_dim: int = 344  # the MLP's channels (intermediate_size)
    norm_eps: float = 1.0e-5  # (rms_norm_eps)
    rope_theta: float = 500000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    # The output layer shares the token embedding's weights (tie_word_embeddings); not with
    # pipeline parallelism, where the two live on different stages.
    tie_embeddings: bool = False


__all__ = ["GPTConfig", "LlamaConfig", "RopeScalingConfig"]
