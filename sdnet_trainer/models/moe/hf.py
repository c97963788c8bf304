"""Hugging Face Qwen3-MoE and Mixtral checkpoints in and out: config.json and the tensor names,
kept as data.

config.json's ``model_type`` picks the names: ``qwen3_moe`` (per-head query/key norms, a head size
of its own, ``norm_topk_prob``) or ``mixtral`` (no query/key norms, the top-k weights always
renormalised). The hub's checkpoints, and what ``transformers``' ``save_pretrained`` writes by
default, store each expert's projections as 2-D tensors of their own
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``; Mixtral's
``model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight``); ``transformers`` 5 keeps them in
memory as 3-D tensors, and ``save_pretrained(save_original_format=False)`` writes those:
``model.layers.{i}.mlp.experts.gate_up_proj`` (the gate's rows, then the up projection's, for
every expert) and ``model.layers.{i}.mlp.experts.down_proj``, the router as
``model.layers.{i}.mlp.gate.weight`` for both types. Both layouts are read (:class:`Layout`);
the per-expert one is written, which ``transformers`` 4 and 5 both load.

Anything this family cannot represent is refused by the field and the file: Qwen3's dense layers
(``mlp_only_layers``, ``decoder_sparse_step``), a sliding window in use, attention biases, rotary
scaling, another activation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.llama.state_dict_adapter import HF_NAMES as LLAMA_HF_NAMES
from sdnet_trainer.models.llama.state_dict_adapter import NameMap
from sdnet_trainer.models.moe.model import MoEDecoder

QWEN3, MIXTRAL = "qwen3_moe", "mixtral"
MODEL_TYPES = (QWEN3, MIXTRAL)

# This project's names -> Hugging Face's outside the MoE layers, the same in both types ({i}: the
# layer): the Llama's (embedding, norms, attention, head) and Qwen3's query/key norms.
HF_NAMES: tuple[tuple[str, str], ...] = tuple(
    pair for pair in LLAMA_HF_NAMES if ".mlp." not in pair[0]
) + (
    ("blocks.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("blocks.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
)
_ROUTER = re.compile(r"blocks\.(\d+)\.mlp\.router\.weight")
_EXPERTS = re.compile(r"blocks\.(\d+)\.mlp\.experts\.(w[123])")


@dataclass(frozen=True)
class Layout:
    """Where a folder keeps a block's MoE tensors ({i}: the layer, {e}: the expert): the router,
    and either each expert's three projections (``per_expert``: the gate ``w1``, up ``w3``,
    down ``w2``) or transformers 5's fused 3-D tensors."""

    router: str
    per_expert: dict[str, str]
    fused: bool = False


_PER_EXPERT = {
    QWEN3: Layout(
        "model.layers.{i}.mlp.gate.weight",
        {
            "w1": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
            "w3": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
            "w2": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
        },
    ),
    MIXTRAL: Layout(
        "model.layers.{i}.block_sparse_moe.gate.weight",
        {
            "w1": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
            "w3": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
            "w2": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
        },
    ),
}
FUSED = Layout("model.layers.{i}.mlp.gate.weight", {}, fused=True)
GATE_UP = "model.layers.{i}.mlp.experts.gate_up_proj"
DOWN = "model.layers.{i}.mlp.experts.down_proj"


def layout_of(model_type: str, names: Iterable[str]) -> Layout:
    """The layout of a folder holding ``names``: fused where it holds a fused expert tensor."""
    if any(name.endswith(".mlp.experts.gate_up_proj") for name in names):
        return FUSED
    return _PER_EXPERT[model_type]


def written_layout(model_type: str) -> Layout:
    """The layout an export writes: the hub's, per expert."""
    return _PER_EXPERT[model_type]


@dataclass(frozen=True)
class Stored:
    """Where one of the model's tensors is in a folder: one tensor, or a block of its rows
    starting at ``row_offset`` (the up projection in a fused ``gate_up_proj``); or with
    ``per_expert`` one 2-D tensor per expert, stacked along a first dimension. ``shape``: each
    named tensor's, as stored."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    per_expert: bool = False
    row_offset: int = 0


_NAMES = NameMap(HF_NAMES)


def to_hf_name(name: str) -> str:
    """Hugging Face's name of one of the model's tensors outside the MoE layers (attention,
    norms, embedding, head: the same in both model types); KeyError for the others."""
    hf = _NAMES.to_hf(name)
    if hf is None:
        raise KeyError(name)
    return hf


def stored_as(name: str, shape: tuple[int, ...], layout: Layout) -> Stored | None:
    """Where the model's tensor ``name`` of ``shape`` is in a folder of ``layout``; None for
    what Hugging Face's models do not have (shared experts, the routing bias)."""
    try:
        return Stored((to_hf_name(name),), shape)
    except KeyError:
        pass
    match = _ROUTER.fullmatch(name)
    if match:
        return Stored((layout.router.format(i=match[1]),), shape)
    match = _EXPERTS.fullmatch(name)
    if match is None:
        return None
    layer, which = match[1], match[2]
    experts, rows, cols = shape
    if layout.fused and which == "w2":
        return Stored((DOWN.format(i=layer),), shape)
    if layout.fused:
        fused_shape = (experts, 2 * rows, cols)
        return Stored((GATE_UP.format(i=layer),), fused_shape, row_offset=rows * (which == "w3"))
    template = layout.per_expert[which]
    names = tuple(template.format(i=layer, e=e) for e in range(experts))
    return Stored(names, (rows, cols), per_expert=True)


# ---------------------------------------------------------------------- config.json

# model.moe's keys <- config.json's fields, per model type (Qwen3's expert count may be spelled
# either way: the hub's num_experts, or num_local_experts as transformers 5 writes it).
_COMMON_FIELDS = {
    "vocab_size": "vocab_size",
    "seq_len": "max_position_embeddings",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "top_k": "num_experts_per_tok",
}
_FIELDS = {
    QWEN3: {**_COMMON_FIELDS, "moe_hidden_dim": "moe_intermediate_size"},
    MIXTRAL: {
        **_COMMON_FIELDS,
        "moe_hidden_dim": "intermediate_size",
        "num_experts": "num_local_experts",
    },
}
# The keys read with transformers' default where their field is absent (the messages name them
# by field too).
_OPTIONAL_FIELDS = {
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "norm_topk_prob": "norm_topk_prob",
    "aux_loss_coeff": "router_aux_loss_coef",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
}
_ROPE_THETA = {QWEN3: 10000.0, MIXTRAL: 1000000.0}  # transformers' defaults
_NORM_EPS = {QWEN3: 1e-6, MIXTRAL: 1e-5}


def config_fields(config: dict[str, Any]) -> dict[str, str]:
    """model.moe's keys -> the config.json fields they come from (for the messages)."""
    model_type = config.get("model_type")
    fields = {**_FIELDS.get(str(model_type), _COMMON_FIELDS), **_OPTIONAL_FIELDS}
    if model_type == QWEN3:
        fields["num_experts"] = (
            "num_local_experts" if "num_local_experts" in config else "num_experts"
        )
    return fields


def moe_sizes_from_hf(config: dict[str, Any], *, source: str) -> dict[str, Any]:
    """The architecture's ``model.moe`` keys from a Hugging Face config (a dict of config.json):
    every key but the training loop's (``load_balance``, ``bias_update_rate``). A config this
    family cannot represent is a ConfigError naming ``source`` and the field."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"{source}: field 'model_type' is {model_type!r}; model.name=moe reads Qwen3-MoE and "
            f"Mixtral checkpoints (model_type {' or '.join(map(repr, MODEL_TYPES))}); for other "
            f"architectures use model=hf_causal_lm"
        )

    def field(name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = config.get(name)
        if value is None:  # absent, or null: transformers' default
            if default is None:
                raise ConfigError(f"{source}: field {name!r} is missing")
            return default
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise ConfigError(f"{source}: field {name!r} is {value!r}, expected {kind}")
        return value

    _refuse_unrepresentable(config, source)
    fields = config_fields(config)
    sizes = {ours: field(fields[ours], int) for ours in [*_FIELDS[model_type], "num_experts"]}
    sizes["n_kv_heads"] = field("num_key_value_heads", int, sizes["n_heads"])
    # Absent or null (Mixtral's default): hidden_size / num_attention_heads.
    sizes["head_dim"] = None if config.get("head_dim") is None else field("head_dim", int)
    sizes["qk_norm"] = model_type == QWEN3
    sizes["num_shared_experts"] = 0
    sizes["norm_topk_prob"] = model_type == MIXTRAL or field("norm_topk_prob", bool, False)
    sizes["aux_loss_coeff"] = float(field("router_aux_loss_coef", (int, float), 0.001))
    sizes["norm_eps"] = float(field("rms_norm_eps", (int, float), _NORM_EPS[model_type]))
    sizes["rope_theta"] = _rope_theta(config, source, default=_ROPE_THETA[model_type])
    sizes["tie_embeddings"] = field("tie_word_embeddings", bool, False)
    return sizes


def _refuse_unrepresentable(config: dict[str, Any], source: str) -> None:
    model_type = config["model_type"]
    expect: dict[str, tuple[Any, str]] = {
        "hidden_act": ("silu", "SwiGLU experts"),
        "attention_bias": (False, "no attention biases"),
        "attention_dropout": (0.0, "no dropout"),
    }
    if model_type == QWEN3:
        expect["mlp_only_layers"] = ([], "a MoE in every layer")
        expect["decoder_sparse_step"] = (1, "a MoE in every layer")
    for name, (wanted, why) in expect.items():
        value = config.get(name)
        if value is not None and value != wanted:
            raise ConfigError(
                f"{source}: field {name!r} is {value!r}; the MoE family here has {why} "
                f"({name}={wanted!r})"
            )
    # Qwen3 uses its window only with use_sliding_window; a window as long as the context is
    # the whole context.
    window, context = config.get("sliding_window"), config.get("max_position_embeddings")
    if model_type == QWEN3 and not config.get("use_sliding_window"):
        window = None
    if window is not None and not (
        isinstance(window, int) and isinstance(context, int) and window >= context
    ):
        raise ConfigError(
            f"{source}: field 'sliding_window' is {window!r}, shorter than the context "
            f"(max_position_embeddings={context!r}); the MoE family here attends to the whole "
            f"context"
        )


def _rope_theta(config: dict[str, Any], source: str, *, default: float) -> float:
    """theta from transformers 5's ``rope_parameters`` or the older ``rope_theta``; rotary
    scaling is refused (this family has none)."""
    params = config.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta")}
        field = "rope_scaling"
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: field {field!r} is {params!r}, expected an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(
            f"{source}: field '{field}.rope_type' is {rope_type!r}; the MoE family here has no "
            f"rotary scaling ('default')"
        )
    theta = params.get("rope_theta")
    theta = default if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: field 'rope_theta' is {theta!r}, expected a number > 0")
    return float(theta)


def hf_model_type(model: nn.Module) -> str:
    """The Hugging Face type a MoE decoder exports as: ``qwen3_moe`` with query/key norms,
    ``mixtral`` without; a model neither represents is a ConfigError naming the key."""
    if not isinstance(model, MoEDecoder):
        raise ConfigError(
            f"model.name=moe's Hugging Face names are a MoEDecoder's; this model is a "
            f"{type(model).__name__}"
        )
    moe: Any = model  # its sizes are plain attributes
    if moe.num_shared_experts:
        raise ConfigError(
            f"model.moe.num_shared_experts={moe.num_shared_experts}: Qwen3-MoE and Mixtral have "
            f"no shared experts, so format=hf cannot write this model"
        )
    biased = [b for name, b in model.named_buffers() if name.endswith(".expert_bias")]
    if any(bool(b.any()) for b in biased):
        raise ConfigError(
            "model.moe.load_balance=bias: this model chooses its experts with a routing bias, "
            "which Qwen3-MoE and Mixtral do not have; format=hf would route differently"
        )
    if moe.qk_norm:
        return QWEN3
    for key, value, wanted in (
        ("norm_topk_prob", moe.norm_topk_prob, True),
        ("head_dim", moe.head_dim, moe.dim // moe.n_heads),
    ):
        if value != wanted:
            raise ConfigError(
                f"model.moe.{key}={value} with model.moe.qk_norm=false: a model without "
                f"query/key norms is written as Mixtral, which has {key}={wanted}"
            )
    return MIXTRAL


def hf_config_of(model: nn.Module, *, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for ``model`` (a :class:`~sdnet_trainer.models.moe.MoEDecoder`), as
    ``transformers``' Qwen3MoeConfig or MixtralConfig reads it (the ``rope_theta`` spelling
    transformers 4 and 5 both read)."""
    moe: Any = model  # its sizes are plain attributes
    model_type = hf_model_type(model)
    own = {ours: getattr(moe, ours) for ours in _FIELDS[model_type]}
    config = {theirs: own[ours] for ours, theirs in _FIELDS[model_type].items()}
    common = {
        "num_key_value_heads": moe.n_kv_heads,
        "head_dim": moe.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": moe.norm_eps,
        "rope_theta": moe.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": moe.tie_embeddings,
        "attention_dropout": 0.0,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "output_router_logits": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if model_type == QWEN3:
        specific = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": moe.num_experts,
            "intermediate_size": moe.moe_hidden_dim,  # of dense layers, which there are none of
            "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
        }
    else:
        specific = {
            "architectures": ["MixtralForCausalLM"],
            "sliding_window": None,
            "router_jitter_noise": 0.0,
        }
    return {"model_type": model_type, **config, **common, **specific}


__all__ = [
    "FUSED",
    "to_hf_name",
    "HF_NAMES",
    "MIXTRAL",
    "MODEL_TYPES",
    "QWEN3",
    "Layout",
    "Stored",
    "config_fields",
    "hf_config_of",
    "hf_model_type",
    "layout_of",
    "moe_sizes_from_hf",
    "stored_as",
    "written_layout",
]
