"""Keys that act only behind a switch, and the one check that refuses them set alone.

``model.lora.r=8`` without ``model.lora.enabled=true`` used to train the full model without a
word. Each :class:`Guard` below names a switch, the values of it that turn its keys on, and the
keys; :func:`validate_switched_keys` (run by the command line, ``cli.py`` and ``plan/cli.py``, on
the keys it was given) refuses a guarded key whose value differs from the schema's default while
its switch is off, in one ConfigError that names the key, its value and the switch.

"Set" means given on the command line (``--plan`` and ``--dry-run`` included) with a value that
differs from the schema's default. A key a recipe or group file sets while its switch is off is the
shipped config's fault, not the user's, and tests/unit/test_config_guards.py holds every shipped
config free of one (``given=None``: every key that differs from its default); and a switch turned
off on the command line (``+recipe=resnet50 model.ema.enabled=false``) turns off what the recipe
set behind it, as a user expects, without a list of keys to reset. A user's own recipe is not
checked: the composed config no longer says where a value came from.

``SWITCHED_GROUPS`` are the config groups that sit behind a switch; every key in them is a switch,
a guarded key, or named in ``ACTS_ALONE`` or ``UNCHECKED`` with the reason, so a key added later
without a decision fails the test.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Collection, Iterable
from typing import Any

from sdnet_trainer.config.auto_layout import AutoLayoutConfig
from sdnet_trainer.config.schema import Config, PipelineConfig
from sdnet_trainer.config.synonyms import split_override
from sdnet_trainer.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Guard:
    switch: str  # the key that turns the guarded keys on
    on: Callable[[Any], bool]  # whether the switch's value does
    needs: str  # the switch's value that does, as the message says it: model.lora.enabled=true
    keys: tuple[str, ...]
    fix: str = ""  # how to turn it on, where "set <needs>" would not say it; "": that

    @property
    def remedy(self) -> str:
        return self.fix or f"set {self.needs}"


def _true(value: Any) -> bool:
    return bool(value)


def _one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda value: value in choices


def _lists(name: str) -> Callable[[Any], bool]:
    return lambda value: name in value


def _keys(group: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{group}.{name}" for name in names)


_FT = "fault_tolerance"
_TRACKERS = "e.g. logging.trackers=[tensorboard,jsonl,{0}]"

# Checked in this order, so a key behind two switches (fault_tolerance.outer_lr: enabled, then
# mode=diloco) is reported against the outer one first.
GUARDS: tuple[Guard, ...] = (
    Guard(
        "model.lora.enabled",
        _true,
        "model.lora.enabled=true",
        _keys("model.lora", "r", "alpha", "dropout", "target_modules", "use_dora", "adapter"),
    ),
    Guard(
        "model.ema.enabled",
        _true,
        "model.ema.enabled=true",
        _keys("model.ema", "decay", "every_n_steps", "warmup_steps"),
    ),
    Guard(
        f"{_FT}.enabled",
        _true,
        f"{_FT}.enabled=true",
        _keys(_FT, "replica_group", "groups", "min_groups", "lighthouse", "bucket_mb")
        + _keys(f"{_FT}.timeouts", "connect_s", "step_s", "quorum_s")
        + _keys(_FT, "replica_backend", "mode", "sync_every", "outer_lr", "outer_momentum"),
    ),
    Guard(
        f"{_FT}.mode",
        _one_of("local_sgd", "diloco"),
        f"{_FT}.mode=local_sgd or diloco",
        _keys(_FT, "sync_every"),
    ),
    Guard(
        f"{_FT}.mode",
        _one_of("diloco"),
        f"{_FT}.mode=diloco",
        _keys(_FT, "outer_lr", "outer_momentum"),
    ),
    Guard(
        "compile.enabled",
        _true,
        "compile.enabled=true",
        _keys("compile", "mode", "backend", "fullgraph", "dynamic"),
        fix="set compile.enabled=true (compile=on)",
    ),
    Guard(
        "profile.enabled",
        _true,
        "profile.enabled=true",
        _keys("profile", "wait", "warmup", "active", "repeat", "record_shapes")
        + _keys("profile", "profile_memory", "with_stack", "memory_snapshot", "top_k"),
        fix="set profile.enabled=true (profile=on)",
    ),
    Guard(
        "elastic.enabled",
        _true,
        "elastic.enabled=true",
        _keys("elastic", "batch_policy"),
        fix="set elastic.enabled=true (elastic=on)",
    ),
    # auto never chooses fp16 (runtime/precision.py): the GradScaler runs under fp16 alone.
    Guard(
        "precision.dtype",
        _one_of("fp16"),
        "precision.dtype=fp16",
        _keys("precision", "init_scale", "growth_interval"),
        fix="set precision=fp16",
    ),
    # Which tensors weight decay leaves out: none are decayed at weight_decay 0.
    Guard(
        "optim.weight_decay",
        lambda decay: decay > 0,
        "optim.weight_decay > 0",
        _keys("optim", "no_decay_norm_and_bias", "no_decay_embeddings"),
        fix="set optim.weight_decay (optim=adamw sets 0.05)",
    ),
    Guard(
        "sched.name",
        _one_of("cosine", "wsd"),
        "sched.name=cosine or wsd",
        _keys("sched", "min_lr_ratio", "decay_steps"),
        fix="choose sched=cosine or sched=wsd",
    ),
    # The same switch, a Guard of its own: a Guard's keys are valid set all at once (the test
    # sets them so), and min_lr excludes min_lr_ratio (training/optim.py refuses both).
    Guard(
        "sched.name",
        _one_of("cosine", "wsd"),
        "sched.name=cosine or wsd",
        _keys("sched", "min_lr"),
        fix="choose sched=cosine or sched=wsd",
    ),
    Guard(
        "sched.name",
        _one_of("wsd"),
        "sched.name=wsd",
        _keys("sched", "decay_ratio", "decay_type"),
        fix="choose sched=wsd",
    ),
    Guard(
        "sched.name",
        _one_of("step"),
        "sched.name=step",
        _keys("sched", "step_size"),
        fix="choose sched=step",
    ),
    Guard(
        "sched.name",
        _one_of("step", "multistep"),
        "sched.name=step or multistep",
        _keys("sched", "gamma"),
        fix="choose sched=step or sched=multistep",
    ),
    Guard(
        "sched.name",
        _one_of("multistep"),
        "sched.name=multistep",
        _keys("sched", "milestones"),
        fix="choose sched=multistep",
    ),
    Guard(
        "sched.warmup_steps",
        lambda steps: steps > 0,
        "sched.warmup_steps > 0",
        _keys("sched", "warmup_start_factor"),
        fix="set sched.warmup_steps",
    ),
    Guard(
        "comm.hook",
        _one_of("powersgd"),
        "comm.hook=powersgd",
        _keys("comm.powersgd", "rank", "start_iter", "min_compression_rate")
        + _keys("comm.powersgd", "use_error_feedback", "warm_start", "batched"),
    ),
    Guard(
        "comm.hook",
        _one_of("local_sgd"),
        "comm.hook=local_sgd",
        _keys("comm.local_sgd", "period", "start_step"),
    ),
    # distributed/activation_checkpointing.py refuses it first, in its own words; listed here so
    # that the inventory is whole.
    Guard(
        "parallel.activation_checkpointing",
        _one_of("full"),
        "parallel.activation_checkpointing=full",
        _keys("parallel", "activation_checkpointing_every"),
    ),
    Guard(
        "logging.trackers",
        _lists("mlflow"),
        "mlflow in logging.trackers",
        _keys("logging.mlflow", "tracking_uri", "experiment", "run_name"),
        fix=f"add mlflow to logging.trackers ({_TRACKERS.format('mlflow')})",
    ),
    Guard(
        "logging.trackers",
        _lists("wandb"),
        "wandb in logging.trackers",
        _keys("logging.wandb", "project", "entity", "mode"),
        fix=f"add wandb to logging.trackers ({_TRACKERS.format('wandb')})",
    ),
    # The Pushgateway is pushed to, not served: only the port's server binds the host.
    Guard(
        "logging.prometheus.port",
        lambda port: port is not None,
        "logging.prometheus.port",
        _keys("logging.prometheus", "host"),
        fix="set logging.prometheus.port=PORT",
    ),
    Guard("logging.flops", _true, "logging.flops=true", _keys("logging", "peak_tflops")),
)

# The groups behind a switch (see the module's docstring).
SWITCHED_GROUPS = (
    "model.lora",
    "model.ema",
    _FT,
    "compile",
    "profile",
    "elastic",
    "precision",
    "sched",
    "comm",
    "logging",
    "parallel.auto",
    "parallel.tensor_parallel",
    "parallel.pipeline",
)

# Keys in those groups that act whatever the switch says (the switches above are decided too).
ACTS_ALONE: dict[str, str] = {
    "precision.tf32": "CUDA's fp32 matmuls, under every dtype",
    "precision.float8": "itself the switch of float8 training (null: off)",
    "logging.log_every_n_steps": "every tracker and the console",
    "logging.progress_bar": "the console",
    "logging.level": "the console and train.log",
    "logging.per_rank_metrics": "metrics.jsonl and every tracker",
    "logging.prometheus.pushgateway": "itself a switch: pushes to that URL",
}

# Keys that act only behind a switch but are not refused here, and why.
_PLANNED = (
    "parallel=auto: the planner replaces parallel.strategy=auto with the layout it chose before "
    "preflight.validate sees the config, so a planned run cannot be told from one without auto "
    "here; plan/auto.py checks their values"
)
_DEGREE = (
    "needs parallel.tp > 1, which distributed/parallelize.py checks against the resolved degree "
    "(a degree may be -1); the planner resets it where it plans tp=1"
)
_STAGES = (
    "needs parallel.pp > 1; recipes set it with their stages on, and a planned layout without "
    "stages keeps it, so refusing it would refuse plans and recipes turned to pp=1"
)
UNCHECKED: dict[str, str] = {
    **{f"parallel.auto.{f.name}": _PLANNED for f in dataclasses.fields(AutoLayoutConfig)},
    "parallel.tensor_parallel.loss_parallel": _DEGREE,
    "parallel.tensor_parallel.sequence_parallel": _DEGREE,
    **{f"parallel.pipeline.{f.name}": _STAGES for f in dataclasses.fields(PipelineConfig)},
}


@functools.cache
def _defaults() -> dict[str, Any]:
    return schema_defaults()


def schema_defaults(schema: type = Config, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of ``schema`` (dotted, from the root) and its default."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out.update(schema_defaults(type(default), f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = default
    return out


def value_of(cfg: Config, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)


def _shown(value: Any) -> str:
    """``value`` as it is written on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    return str(value)


# An interpolation of another key, as the schema's defaults hold them: ${run.root}.
_REFERENCE = re.compile(r"\$\{([\w.]+)\}")


def _is_default(cfg: Config, key: str, value: Any, default: Any) -> bool:
    if isinstance(default, str) and "${" in default:
        # Compared as this config resolves it (logging.mlflow.tracking_uri: ${run.root}/mlruns is
        # /x/mlruns under run.root=/x, without anyone setting it); a resolver's value (a run id)
        # cannot be told from a setting, so it counts as the default.
        default = _REFERENCE.sub(lambda ref: str(value_of(cfg, ref[1])), default)
        if "${" in default:
            return True
    if isinstance(default, (list, tuple)):
        return list(value) == list(default)
    return bool(value == default)


def given_keys(overrides: Iterable[str]) -> set[str]:
    """The keys a command line's ``key=value`` overrides set (``+``/``++``/``~`` stripped)."""
    return {parts[0] for parts in map(split_override, overrides) if parts is not None}


def validate_switched_keys(cfg: Config, given: Collection[str] | None = None) -> None:
    """Refuse a guarded key set (not at its schema default) while its switch is off: among
    ``given`` (a command line's keys, :func:`given_keys`), or every key with ``None``."""
    defaults = _defaults()
    for guard in GUARDS:
        if guard.on(value_of(cfg, guard.switch)):
            continue
        set_alone = [
            (key, value_of(cfg, key))
            for key in guard.keys
            if (given is None or key in given)
            and not _is_default(cfg, key, value_of(cfg, key), defaults[key])
        ]
        if not set_alone:
            continue
        settings = ", ".join(f"{key}={_shown(value)}" for key, value in set_alone)
        state = (
            "" if guard.on is _true else f" ({guard.switch}={_shown(value_of(cfg, guard.switch))})"
        )
        first = set_alone[0][0]
        verb, leave = (
            ("has", f"leave {first} at its default, {_shown(defaults[first])}")
            if len(set_alone) == 1
            else (
                "have",
                "leave them at their defaults: "
                + ", ".join(f"{key}={_shown(defaults[key])}" for key, _ in set_alone),
            )
        )
        raise ConfigError(
            f"{settings} {verb} no effect without {guard.needs}{state}: {guard.remedy} (or {leave})"
        )


__all__ = [
    "ACTS_ALONE",
    "GUARDS",
    "SWITCHED_GROUPS",
    "UNCHECKED",
    "Guard",
    "given_keys",
    "schema_defaults",
    "validate_switched_keys",
    "value_of",
]
