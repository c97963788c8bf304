"""Typed schemas of the language models' sizes: ``model.gpt`` (``sdnet_trainer/models/gpt.py``),
``model.llama`` (``sdnet_trainer/models/llama/``), ``model.moe`` (``sdnet_trainer/models/moe/``)
and the adapters of ``model.lora`` (``sdnet_trainer/models/lora.py``), kept beside ``schema.py``,
whose ``ModelConfig`` includes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128  # the context length: the largest sequence the position embedding covers
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    # The output layer shares the token embedding's weight (GPT-2's; tie_word_embeddings): one
    # parameter, initialised once, split by vocabulary rows under tensor parallelism; not with
    # pipeline parallelism (parallel.pp > 1), where the two live on different stages.
    tie_embeddings: bool = False
    # Biases in the LayerNorms (the linear layers here never have one); false: no bias anywhere,
    # nanoGPT's bias=False. format=hf writes a GPT-2 with zero biases where this model has none.
    bias: bool = True


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


@dataclass
class MoEConfig:
    # The mixture-of-experts decoder (model.name=moe; configs/model/moe_*): Llama's attention (with
    # Qwen3's per-head query/key RMSNorms when qk_norm) and, in every block, a router that sends
    # each token to top_k of num_experts SwiGLU experts. The shapes of Qwen3-MoE and Mixtral;
    # Hugging Face's names in brackets; model.hf_config / model.weights=hf:PATH take them from a
    # Qwen3-MoE or Mixtral config.json instead.
    vocab_size: int = 256
    seq_len: int = 128  # (max_position_embeddings)
    dim: int = 128  # (hidden_size)
    n_layers: int = 2  # (num_hidden_layers)
    n_heads: int = 4  # (num_attention_heads)
    n_kv_heads: Optional[int] = None  # null: n_heads (num_key_value_heads)
    head_dim: Optional[int] = None  # null: dim // n_heads (head_dim)
    qk_norm: bool = True  # Qwen3's RMSNorm on each query and key head; Mixtral has none
    num_experts: int = 4  # (num_experts, num_local_experts)
    top_k: int = 2  # experts per token (num_experts_per_tok)
    moe_hidden_dim: int = 128  # one expert's channels (moe_intermediate_size, intermediate_size)
    # Experts every token passes through besides its routed ones (DeepSeek's shared experts,
    # ungated), each of moe_hidden_dim channels; 0: none (Qwen3-MoE, Mixtral).
    num_shared_experts: int = 0
    # The top_k routing weights renormalised to sum to 1 (norm_topk_prob; Mixtral always does).
    norm_topk_prob: bool = True
    # Load balancing: aux_loss (a per-sequence auxiliary loss, aux_loss_coeff x num_experts x
    # sum over experts of (their share of the sequence's routed tokens) x (their mean router
    # probability), added to the training loss) | bias (DeepSeek-V3's auxiliary-loss-free
    # balancing: a per-expert bias on the routing scores, used for the choice of experts only,
    # moved by bias_update_rate towards balance after every optimizer step from the global
    # batch's expert load) | none.
    load_balance: str = "aux_loss"
    aux_loss_coeff: float = 0.001  # (router_aux_loss_coef)
    bias_update_rate: float = 0.001
    norm_eps: float = 1.0e-6  # (rms_norm_eps)
    rope_theta: float = 1000000.0
    tie_embeddings: bool = False  # (tie_word_embeddings)


@dataclass
class LoRAConfig:
    # Low-rank adapters through peft (pip install 'sdnet_trainer[lora]') on model.name=llama or
    # hf_causal_lm: the base weights frozen (sharded without gradients or optimizer state under
    # FSDP2), only the adapters trained, checkpointed and resumed; export format=peft writes them
    # as a peft folder, format=hf merge_lora=true the merged model (docs/language-models.md).
    # Under parallel=fsdp, ddp or zero1, pipeline and context parallel (parallel.tp > 1,
    # precision.float8 and model.ema refused). Every key below needs enabled=true: set without
    # it, it is refused before launch (sdnet_trainer/config/guards.py).
    enabled: bool = False
    r: int = 16  # the adapters' rank (needs enabled=true, as every key below)
    alpha: float = 32.0  # the update is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapters' input (0: none)
    # The layers the adapters wrap, in Hugging Face's names (q_proj, k_proj, v_proj, o_proj,
    # gate_proj, up_proj, down_proj), or [all-linear]: every one of them (every linear layer but
    # the output layer). Names that match no layer are refused before launch.
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])
    # Weight-decomposed adapters (DoRA): a learned magnitude per output channel besides A and B.
    use_dora: bool = False
    # A peft adapter folder (adapter_config.json + adapter_model.safetensors) to start from; its
    # adapter_config.json gives r, alpha, target_modules and use_dora (this section's are not
    # used). null: fresh adapters (A random, B zero: the base model's outputs at step 0).
    adapter: Optional[str] = None


__all__ = ["GPTConfig", "LlamaConfig", "LoRAConfig", "MoEConfig", "RopeScalingConfig"]
