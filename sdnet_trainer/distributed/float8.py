"""Float8 training through torchao (``precision.float8``, the ``float8`` extra).

``precision.float8=rowwise|tensorwise`` turns the model's eligible ``nn.Linear`` layers into
torchao's ``Float8Linear``: each matmul casts its operands to float8 with scales computed from the
tensors themselves (per row, or one per tensor), multiplies on the GPU's float8 tensor cores and
returns the high-precision result. Weights, gradients, optimizer state and checkpoints stay in the
run's precision (``precision.dtype``, bf16 or fp32): only the matmuls change.

Eligible: a Linear whose input and output sizes are both multiples of 16 (what the float8 matmul
kernels take), except the output layer: it produces the logits the loss's softmax reads, and a
tied one shares its weight with the token embedding; and except what a model keeps in high
precision: a module whose class declares ``high_precision_children`` (child names) keeps those
children, and every Linear inside them, out of float8. The MoE layer declares its router: the
choice of experts is made in float32 from the router's weight read directly, which under the
float8 all-gather would be a float8-casting wrapper and in float8 would round the small
differences between experts' scores away. A declaration on the class rather than a list of
names matched against paths: it follows the module wherever a model nests it, and a family
outside the package marks its own modules the same way. :func:`float8_eligible` names the
eligible layers.

The conversion runs first in ``parallelize()``, before the pipeline split, tensor parallelism,
activation checkpointing, compile and FSDP2, as torchtitan applies its converters; the model may
still be on the meta device. Each converted layer stays the same module object with the same
parameters: the Trainer's init steps, which it listed from the meta build, then write the
initial weights into the float8 layers too, and the state dict's names (``...wq.weight``) are the
plain model's, so checkpoints and exports are interchangeable with runs without float8.

Under FSDP2 the tensorwise recipe also all-gathers the weights in float8 (half of bf16's bytes),
with one scale per weight computed for all of them at once after each optimizer step
(:func:`refresh_float8_scales`); torchao offers that all-gather for tensorwise scaling only.
Under tensor parallelism tensorwise layers take torchao's float8 TP styles
(``models/decoder.py``: ``tensor_parallel_styles``), rowwise ones torch's own, as torchtitan does.

torchao is imported only when a run sets ``precision.float8``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import weakref
from typing import Any

import torch
from torch import nn

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.config.schema import Config, names_stock_trainer
from sdnet_trainer.data import is_language_model_data
from sdnet_trainer.distributed.env import resolve_backend, resolve_device
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.runtime.quiet import import_quietly

logger = logging.getLogger(__name__)

FLOAT8_RECIPES = ("rowwise", "tensorwise")
FLOAT8_EXTRA_HINT = "pip install 'sdnet_trainer[float8]'"
# The float8 matmul kernels (cuBLAS, CUTLASS) take operands whose dimensions are multiples of 16.
FLOAT8_MULTIPLE = 16
# Float8 tensor cores: Ada (8.9), Hopper (9.0) and later.
FLOAT8_MIN_CAPABILITY = (8, 9)
# Names a model gives its output layer when it has no get_output_embeddings().
HEAD_NAMES = ("head", "lm_head")
# The class attribute naming the children a module keeps out of float8 (module docstring).
HIGH_PRECISION_CHILDREN = "high_precision_children"

# The models convert_float8 set up for FSDP2's float8 all-gather: their weights' scales are
# recomputed after every optimizer step (refresh_float8_scales). Weak: a finished run's model goes.
_SCALES_AFTER_STEP: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def validate_float8(cfg: Config, *, device: torch.device | str | None = None) -> None:
    """``precision.float8``, checked before launch: a recipe, torchao installed, a GPU with float8
    tensor cores (``device``: where rank 0 runs, by default as the run resolves ``dist.device``),
    and a precision torchao trains float8 with."""
    recipe = cfg.precision.float8
    if recipe is None:
        return
    check_choice("precision.float8", recipe, FLOAT8_RECIPES)
    if cfg.precision.dtype == "fp16":
        raise ConfigError(
            f"precision.float8={recipe} with precision.dtype=fp16: torchao's float8 recipes train "
            f"with bf16 or fp32 weights and gradients (torchtitan's with bf16); fp16 would add its "
            f"loss scaling on top of float8's own per-tensor scaling of the gradients, a pair "
            f"neither torchao nor torchtitan runs; use precision=bf16"
        )
    _torchao_float8(recipe)
    _check_model_before_launch(cfg)
    device = resolve_device(cfg.dist, local_rank=0) if device is None else torch.device(device)
    tp = cfg.parallel.tensor_parallel
    backend = resolve_backend(cfg.dist, device)
    if (
        recipe == "tensorwise"
        and cfg.parallel.tp > 1
        and tp.sequence_parallel
        and backend == "gloo"
    ):
        # torchao's float8 TP styles all-gather the output gradients in float8 along the
        # sequence, and gloo has no float8 collectives (its all-gather raises "Invalid scalar
        # type"); NCCL has them.
        raise ConfigError(
            f"precision.float8=tensorwise with parallel.tp={cfg.parallel.tp} and "
            f"parallel.tensor_parallel.sequence_parallel=true gathers float8 tensors, which the "
            f"gloo backend (dist.backend={cfg.dist.backend}, dist.device={cfg.dist.device}) "
            f"cannot send; use precision.float8=rowwise, sequence_parallel=false, or NCCL on GPUs"
        )
    # Without a visible GPU, dist.device=cuda is validate_dist's error, with its own message.
    if device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < FLOAT8_MIN_CAPABILITY:
            major, minor = capability
            raise ConfigError(
                f"precision.float8={recipe} needs float8 tensor cores (compute capability "
                f"{'.'.join(map(str, FLOAT8_MIN_CAPABILITY))} or later: Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; "
                f"set precision.float8=null"
            )
        # Context parallel: a rank holds data.seq_len / cp tokens of each sequence.
        cp = max(1, cfg.parallel.cp)
        tokens = cfg.data.seq_len // cp
        if is_language_model_data(cfg.data) and tokens % FLOAT8_MULTIPLE:
            # The weight gradient is (output gradient)^T @ input: the tokens of a micro-batch are
            # its inner dimension, which the float8 kernels take in multiples of 16.
            raise ConfigError(
                f"precision.float8={recipe} with data.seq_len={cfg.data.seq_len} / parallel.cp="
                f"{cp} = {tokens} tokens per sequence on a rank: every float8 weight-gradient "
                f"matmul runs over a micro-batch's tokens, which the GPU kernels take in "
                f"multiples of {FLOAT8_MULTIPLE}; use a data.seq_len that is a multiple of "
                f"{FLOAT8_MULTIPLE * cp}"
            )


def _torchao_float8(recipe: str) -> Any:
    """``torchao.float8``, or a ConfigError naming the key and the extra that installs it."""
    try:
        # Without torch's deprecation notices about torchao's Enums (runtime/quiet.py).
        float8 = import_quietly("torchao.float8")
    except ImportError as err:
        raise ConfigError(
            f"precision.float8={recipe} trains through torchao, which cannot be imported "
            f"({err}): {FLOAT8_EXTRA_HINT}"
        ) from None
    return float8


# ---------------------------------------------------------------------- which layers


def float8_eligible(model: nn.Module) -> list[str]:
    """The names of the Linear layers :func:`convert_float8` turns into float8 ones."""
    return list(_sort_linears(model)[0])


def _sort_linears(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """The eligible Linear layers' names, and every other Linear's name with the reason."""
    heads = _output_layers(model)
    kept = _kept_in_high_precision(model)
    eligible: list[str] = []
    left: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        keeper = next((why for top, why in kept.items() if _within(name, top)), None)
        if id(module) in heads:
            left[name] = "the output layer"
        elif keeper is not None:
            left[name] = keeper
        elif module.in_features % FLOAT8_MULTIPLE or module.out_features % FLOAT8_MULTIPLE:
            left[name] = (
                f"{module.in_features} -> {module.out_features}: not multiples of {FLOAT8_MULTIPLE}"
            )
        else:
            eligible.append(name)
    return eligible, left


def _kept_in_high_precision(model: nn.Module) -> dict[str, str]:
    """The names of the modules that their parents' classes keep out of float8 (a class attribute
    ``high_precision_children``), each with the reason the log gives."""
    kept: dict[str, str] = {}
    for name, module in model.named_modules():
        children = getattr(type(module), HIGH_PRECISION_CHILDREN, ())
        if isinstance(children, str):  # ("router") for ("router",): one name, not its letters
            children = (children,)
        for child in children:
            if isinstance(getattr(module, child, None), nn.Module):
                full = f"{name}.{child}" if name else child
                kept[full] = f"kept in high precision by {type(module).__name__}"
    return kept


def _within(name: str, top: str) -> bool:
    return name == top or name.startswith(f"{top}.")


def _output_layers(model: nn.Module) -> set[int]:
    """The ids of the model's output layers: what ``get_output_embeddings()`` returns
    (transformers' models, also inside a wrapper such as HFCausalLM's ``lm``), else its children
    named ``head`` or ``lm_head`` (the GPT and Llama decoders). A model that is one Linear is its
    own output layer."""
    if isinstance(model, nn.Linear):
        return {id(model)}
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        if callable(getter):
            found = getter()
            if isinstance(found, nn.Module):
                return {id(found)}
    return {id(child) for name, child in model.named_children() if name in HEAD_NAMES}


# ---------------------------------------------------------------------- the conversion


def _eligible_or_refused(model: nn.Module, cfg: Config) -> tuple[list[str], dict[str, str]]:
    """:func:`_sort_linears`, or a ConfigError for a model with no layer float8 can run."""
    eligible, left = _sort_linears(model)
    if not eligible:
        skipped = "; ".join(f"{name}: {why}" for name, why in left.items()) or "none"
        raise ConfigError(
            f"precision.float8={cfg.precision.float8}: model.name={cfg.model.name!r} has no "
            f"Linear layer float8 can run (input and output sizes multiples of "
            f"{FLOAT8_MULTIPLE}, not the output layer nor one the model keeps in high "
            f"precision); its Linear layers: {skipped}. Set "
            f"precision.float8=null"
        )
    return eligible, left


def _check_model_before_launch(cfg: Config) -> None:
    """The model's eligible layers, from a build on the meta device (nothing allocated), where
    the stock Trainer builds it from the config alone: a Trainer subclass's model, and a
    transformers model read from its weights, are checked when they are built."""
    if not names_stock_trainer(cfg) or cfg.model.weights is not None:
        return
    from sdnet_trainer.models import build_model

    with torch.device("meta"):
        model = build_model(cfg.model)
    _eligible_or_refused(model, cfg)


def convert_float8(model: nn.Module, cfg: Config, *, fsdp: bool) -> None:
    """Turn the eligible Linear layers of ``model`` into torchao's Float8Linear, in place and
    keeping each module object (module docstring); ``fsdp``: the model will be wrapped by FSDP2,
    whose all-gather then runs in float8 for the tensorwise recipe."""
    recipe = cfg.precision.float8
    assert recipe is not None, "convert_float8 runs only with precision.float8 set"
    float8 = _torchao_float8(recipe)
    eligible, left = _eligible_or_refused(model, cfg)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    all_gather = fsdp and recipe == "tensorwise"
    if all_gather and cfg.model.ema.enabled:
        # The weight average reads each weight's storage, which torchao's float8-casting weight
        # (a wrapper tensor, no storage of its own) does not have: the all-gather stays in the
        # run's precision, the matmuls still run in float8.
        all_gather = False
        logger.info(
            "precision.float8=tensorwise with model.ema.enabled=true: FSDP all-gathers the "
            "weights in the run's precision (parallel.fsdp.param_dtype=%s), not in float8: the "
            "weight average needs plain weights",
            cfg.parallel.fsdp.param_dtype,
        )
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    originals = {name: model.get_submodule(name) for name in eligible}
    chosen = set(eligible)
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda _module, name: name in chosen
    )
    for name, original in originals.items():
        _adopt(original, model.get_submodule(name))
        _set_submodule(model, name, original)
    if all_gather:
        _SCALES_AFTER_STEP.add(model)
    if cfg.compile.enabled and recipe == "rowwise":
        # Inductor fuses rowwise float8's bf16 casts without eager's intermediate roundings, and a
        # recomputation under activation checkpointing then rounds differently from the forward:
        # NaN losses (pytorch/pytorch#150859). Emulating eager's casts is torchtitan's fix (its
        # float8 converter sets the same process-wide flag). Imported here: compile runs only.
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    logger.info(
        "precision.float8=%s: %d of %d Linear layers compute in float8 (torchao Float8Linear%s): "
        "%s; left in high precision: %s",
        recipe,
        len(eligible),
        len(eligible) + len(left),
        ", float8 FSDP all-gather" if all_gather else "",
        _grouped({name: "" for name in eligible}),
        _grouped(left) or "none",
    )


def _grouped(names: dict[str, str]) -> str:
    """Layer names (each with a reason, or "") for the log, the indices of repeated layers folded
    into ``*`` with a count: one entry per projection, not one per layer of an 80-block model."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, why in names.items():
        groups.setdefault((re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name), why), []).append(name)
    return ", ".join(
        (f"{pattern} x{len(members)}" if len(members) > 1 else members[0])
        + (f" ({why})" if why else "")
        for (pattern, why), members in groups.items()
    )


def _adopt(original: nn.Module, converted: nn.Module) -> None:
    """Make ``original`` the Float8Linear that torchao built as ``converted``: its class, its
    float8 settings, and its parameters (the same tensors, or under FSDP's float8 all-gather the
    weight wrapped in torchao's float8-casting subclass). Keeping the object keeps every reference
    to it valid: the Trainer's init steps of a meta build name the modules they initialise."""
    own = vars(original)
    for key, value in vars(converted).items():
        if key not in own:  # torchao's own attributes (config, scaling types, matmul configs)
            setattr(original, key, value)
    for key, param in converted.named_parameters(recurse=False):
        original.register_parameter(key, param)
    original.__class__ = type(converted)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


# ---------------------------------------------------------------------- after the optimizer step


def refresh_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: under FSDP2's float8 all-gather (tensorwise), the scales of the
    updated weights for the next all-gathers, all in one all-reduce (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``, which torchtitan runs after each step) instead
    of one per weight. A no-op for every other run."""
    if model not in _SCALES_AFTER_STEP:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


__all__ = [
    "FLOAT8_EXTRA_HINT",
    "HIGH_PRECISION_CHILDREN",
    "FLOAT8_RECIPES",
    "convert_float8",
    "float8_eligible",
    "refresh_float8_scales",
    "validate_float8",
]
