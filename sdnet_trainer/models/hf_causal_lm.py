"""Any ``transformers`` causal language model, trained as it is (``model.name=hf_causal_lm``).

``model.hf_config=PATH`` (a folder with ``config.json``, or that file) builds the architecture
with random weights (``AutoModelForCausalLM.from_config``); ``model.weights=hf:PATH`` loads a
saved model folder (``from_pretrained``, local files only, fp32). ``model.kwargs`` overrides
fields of the config (``num_hidden_layers``, ``attn_implementation``, ...).

:class:`HFCausalLM` is the one adapter between such a model and the Trainer: its forward takes the
token ids alone and returns the logits tensor (``output.logits``, no cache), as the project's GPT
does, so the loss, evaluation, FLOPs count and export paths stay the same. Its decoder layers,
found from the model's own ``_no_split_modules`` (the classes ``transformers`` itself never splits
across devices), are the blocks FSDP2 shards one by one and activation checkpointing and compile
wrap. DDP and FSDP2 (and ZeRO-1) run it; tensor and pipeline parallelism do not (see
:func:`validate_hf_causal_lm`).

``transformers`` is the ``llm`` extra: it is imported only when such a model is built.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdnet_trainer.config.schema import Config, ModelConfig
from sdnet_trainer.data import is_language_model_data
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.attention import token_positions
from sdnet_trainer.models.family import LoRATargets, ModelFamily
from sdnet_trainer.models.hf_folder import (
    HF_PREFIX,
    check_dtype_field,
    check_stored,
    hf_weights_folder,
    listed,
    read_hf_config,
    stored_tensors,
)

logger = logging.getLogger(__name__)

HF_CAUSAL_LM = "hf_causal_lm"
LLM_EXTRA_HINT = "pip install 'sdnet_trainer[llm]'"
# config.json fields that give the longest sequence a model takes, by architecture.
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


# The attention function context parallel gives a transformers model, by its config's id (one
# model per process in practice; a dict keeps two apart).
CONTEXT_PARALLEL_ATTENTION = "sdnet_context_parallel"
_ATTEND: dict[int, Callable[..., torch.Tensor]] = {}


def _context_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (as its ``sdpa_attention_forward``): (B, heads,
    T, head_dim) in, (B, T, heads, head_dim) out. No mask is built for a custom function; the
    causal rule across the shards is the attend function's."""
    attend = _ATTEND[id(module.config)]
    out = attend(query, key, value, scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM seen as this project's language models are: int64 tokens
    (B, T) in, logits (B, T, vocab) out. The model is ``self.lm``, so its parameters are named
    ``lm.<transformers' own name>``. ``positions`` (context parallel: models/attention.py) are
    passed as ``position_ids``."""

    positions: torch.Tensor | None = None

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        # A transformers PreTrainedModel: its config is a PretrainedConfig.
        config: Any = lm.config
        self.vocab_size = int(config.vocab_size)
        # The context (serving reads it as a GPT's seq_len); None where config.json gives none.
        self.seq_len = context_length(config.to_dict())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        extra = {}
        if tokens.is_meta:
            # Shapes only (the dry run, the FLOPs count): transformers' mask preparation reads
            # values (a packed-sequence check calls .item()), but passes a 4-D mask through.
            length = tokens.shape[1]
            causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
            extra["attention_mask"] = causal.expand(tokens.shape[0], 1, length, length)
        if self.positions is not None:
            extra["position_ids"] = token_positions(
                self.positions, tokens.shape[1], tokens.device
            ).expand(tokens.shape[0], -1)
        logits: torch.Tensor = self.lm(input_ids=tokens, use_cache=False, **extra).logits
        return logits

    def parallel_blocks(self) -> list[nn.Module]:
        """The decoder layers, in order: FSDP2 units, activation checkpointing, compile."""
        return decoder_layers(self.lm)

    def use_attention(self, attend: Callable[..., torch.Tensor]) -> None:
        """Every attention layer computes through ``attend(q, k, v, scale=, dropout_p=)``
        (context parallel), by transformers' attention-function registry; a model that does not
        dispatch its attention through it is refused."""
        transformers = require_transformers("parallel.cp")
        transformers.AttentionInterface.register(
            CONTEXT_PARALLEL_ATTENTION, _context_parallel_attention
        )
        lm: Any = self.lm  # a transformers PreTrainedModel
        try:
            lm.set_attn_implementation(CONTEXT_PARALLEL_ATTENTION)
        except (ValueError, ImportError) as err:
            raise ConfigError(
                f"parallel.cp: this {type(self.lm).__name__} does not take an attention function "
                f"from transformers' registry ({err}), so its attention cannot span the "
                f"sequence's shards; use parallel.cp=1"
            ) from err
        _ATTEND[id(self.lm.config)] = attend


def decoder_layers(lm: nn.Module) -> list[nn.Module]:
    """The repeated layers of a ``transformers`` model: the modules of the classes named in its
    ``_no_split_modules``, else the children of its longest ModuleList of one class."""
    names = set(getattr(lm, "_no_split_modules", None) or ())
    layers = [m for m in lm.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists: list[list[nn.Module]] = [
        list(m)
        for m in lm.modules()
        if isinstance(m, nn.ModuleList) and len({type(c) for c in m}) == 1 and len(m) > 0
    ]
    return max(lists, key=len) if lists else []


def context_length(config: dict[str, Any]) -> int | None:
    for key in CONTEXT_FIELDS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def require_transformers(key: str) -> Any:
    """The ``transformers`` module, or a ConfigError naming ``key`` and the extra to install."""
    try:
        import transformers
    except ImportError as err:
        raise ConfigError(
            f"{key} needs the `transformers` package (the llm extra), which is not installed: "
            f"{LLM_EXTRA_HINT}"
        ) from err
    return transformers


def build_hf_causal_lm(cfg: ModelConfig) -> HFCausalLM:
    """The model of ``model.hf_config`` (random init, from the torch generator) or of
    ``model.weights=hf:PATH`` (its saved weights, fp32)."""
    key, folder = source_folder(cfg)
    transformers = require_transformers(f"model.name={HF_CAUSAL_LM}")
    try:
        config = transformers.AutoConfig.from_pretrained(
            str(folder), local_files_only=True, **dict(cfg.kwargs)
        )
        if key == "model.weights":
            check_folder(transformers, config, folder)
            lm, report = transformers.AutoModelForCausalLM.from_pretrained(
                str(folder),
                config=config,
                local_files_only=True,
                output_loading_info=True,
                **{dtype_key(transformers): torch.float32},
            )
            _check_report(report, folder)
        else:
            lm = transformers.AutoModelForCausalLM.from_config(config)
    except ConfigError:
        raise  # the folder's own check: it names the tensor and the file
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{key}={str(folder)!r}: transformers cannot build a causal LM from it: "
            f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err) else ''}"
        ) from err
    return HFCausalLM(lm)


def check_folder(transformers: Any, config: Any, folder: Path) -> None:
    """Before ``from_pretrained`` allocates the model config.json describes: that model, built
    on the meta device, against what the folder's safetensors headers declare (names, shapes,
    dtypes, every file whole). Some architectures are stored under other names than the model's
    (transformers fuses a MoE's experts as it loads them): where the tensors the two sides do not
    share hold the same number of elements, only the shared names are compared here, and
    transformers' own loading report (:func:`_check_report`) judges the rest."""
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    first: dict[int, str] = {}
    tied = []  # the second name of a tied weight (the output layer): stored once
    for name, param in meta.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            tied.append(name)
    expected = {name: tuple(p.shape) for name, p in meta.named_parameters(remove_duplicate=False)}
    stored = stored_tensors(folder)
    ignored = [
        re.compile(p) for p in getattr(meta, "_keys_to_ignore_on_load_unexpected", None) or []
    ]
    known = set(meta.state_dict()) | {n for n in stored if any(p.search(n) for p in ignored)}
    ours = [n for n in expected if n not in stored and n not in tied]
    theirs = [n for n in stored if n not in known]
    if ours and _numel(expected[n] for n in ours) == _numel(stored[n].shape for n in theirs):
        expected = {n: shape for n, shape in expected.items() if n in stored}
        known |= set(theirs)
    what = f"the {type(meta).__name__} of its config.json"
    check_stored(expected, stored, folder, optional=tied, known=known, what=what)
    check_dtype_field(config.to_dict(), stored, f"model.weights=hf:{folder}: config.json")


def _numel(shapes: Any) -> int:
    return sum(math.prod(shape) for shape in shapes)


def _check_report(report: dict[str, Any], folder: Path) -> None:
    """transformers' loading report: a weight it had to initialise (missing from the folder), a
    stored one it had no place for, or one of another shape is an error here, not a warning: a
    run that starts from a folder starts from all of its weights."""
    problems = []
    for field, what in (
        ("missing_keys", "lacks tensors the model needs"),
        ("mismatched_keys", "holds tensors of other shapes than the model's"),
        ("unexpected_keys", "holds tensors the model has no place for"),
    ):
        names = sorted(str(n) for n in report.get(field) or ())
        if names:
            problems.append(f"{what}: {listed(names)}")
    if problems:
        raise ConfigError(
            f"model.weights=hf:{folder} {'; and '.join(problems)} (transformers' loading report)"
        )


def source_folder(cfg: ModelConfig) -> tuple[str, Path]:
    """Which key names the model (``model.weights`` or ``model.hf_config``) and its folder."""
    weights, hf_config = cfg.weights, getattr(cfg, "hf_config", None)
    if weights is not None and hf_config is not None:
        raise ConfigError(
            f"model.weights={weights!r} and model.hf_config={hf_config!r}: give one; the weights' "
            f"folder holds its own config.json"
        )
    if weights is not None:
        folder = hf_weights_folder(weights)
        if folder is None:
            raise ConfigError(
                f"model.weights={weights!r}: model.name={HF_CAUSAL_LM} loads a saved transformers "
                f"folder, written model.weights={HF_PREFIX}PATH"
            )
        key, path = "model.weights", folder
    elif hf_config is not None:
        key, path = "model.hf_config", Path(hf_config).expanduser()
        if path.name == "config.json" and path.is_file():
            path = path.parent
    else:
        raise ConfigError(
            f"model.name={HF_CAUSAL_LM} needs model.hf_config=PATH (a folder with config.json: "
            f"random weights) or model.weights={HF_PREFIX}PATH (a saved model folder)"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}={str(path)!r}: no config.json there")
    return key, path


def dtype_key(transformers: Any) -> str:
    """from_pretrained's dtype keyword: ``dtype`` from transformers 4.56, ``torch_dtype`` before."""
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def validate_hf_causal_lm(cfg: Config, *, tp: int, pp: int) -> None:
    """``model.name=hf_causal_lm`` against the layout and the data, before launch."""
    if tp > 1 or pp > 1:
        raise ConfigError(
            f"model.name={HF_CAUSAL_LM} with parallel.tp={tp}, parallel.pp={pp}: a transformers "
            f"model is trained as it is, and it has neither a tensor-parallel plan here (which "
            f"of its layers split by rows or columns) nor a pipeline split (its forward passes "
            f"masks, positions and rotary tables between layers, not one tensor); train it with "
            f"parallel.tp=1 and parallel.pp=1 under parallel=ddp or parallel=fsdp (one FSDP2 unit "
            f"per decoder layer), or use one of this project's own model families (model=gpt_*, "
            f"model=llama3_*) for tensor and pipeline parallelism"
        )
    key, folder = source_folder(cfg.model)
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            f"model.name={HF_CAUSAL_LM} needs the `transformers` package (the llm extra), which "
            f"is not installed: {LLM_EXTRA_HINT}"
        )
    config = {**read_hf_config(folder, key=key), **dict(cfg.model.kwargs)}
    data = cfg.data
    if not is_language_model_data(data):
        return
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and data.vocab_size is not None and data.vocab_size > vocab:
        raise ConfigError(
            f"data.vocab_size={data.vocab_size} is larger than the model's vocabulary "
            f"(vocab_size={vocab} in {folder / 'config.json'}, {key})"
        )
    context = context_length(config)
    if context is not None and data.seq_len > context:
        raise ConfigError(
            f"data.seq_len={data.seq_len} is longer than the model's context ({context} in "
            f"{folder / 'config.json'}, {key})"
        )


FAMILY = ModelFamily(
    name=HF_CAUSAL_LM,
    build=build_hf_causal_lm,
    language=True,
    context_parallel=True,
    validate=validate_hf_causal_lm,
    # model.lora: peft's adapters go into the transformers model, under its own names.
    lora=LoRATargets(root="lm"),
)

__all__ = [
    "FAMILY",
    "HF_CAUSAL_LM",
    "HFCausalLM",
    "build_hf_causal_lm",
    "context_length",
    "decoder_layers",
    "dtype_key",
    "require_transformers",
    "validate_hf_causal_lm",
]
