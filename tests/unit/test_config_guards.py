"""Keys behind a switch (sdnet_trainer/config/guards.py): set alone, each is refused before launch
naming itself and its switch; with the switch on it passes; and every key of a group behind a
switch has been decided on, so a key added later without a decision fails here."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, cast

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_module
from omegaconf import DictConfig, OmegaConf

from sdnet_trainer.config import CONFIG_MODULE, compose, to_config
from sdnet_trainer.config.guards import (
    ACTS_ALONE,
    GUARDS,
    SWITCHED_GROUPS,
    UNCHECKED,
    given_keys,
    schema_defaults,
    validate_switched_keys,
    value_of,
)
from sdnet_trainer.config.schema import Config
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.preflight import validate
from tests.support import REPO, TINY, main_in_process

FT = [
    *TINY,
    "loop.global_batch_size=12",
    "fault_tolerance.enabled=true",
    "fault_tolerance.lighthouse=http://localhost:1",
]
LLAMA_LORA = ["+recipe=llama3_debug", "model.lora.enabled=true"]

# What turns each guard's switch on (keyed by Guard.needs), and the world size it validates at.
SWITCH_ON: dict[str, tuple[list[str], int]] = {
    "model.lora.enabled=true": (LLAMA_LORA, 1),
    "model.ema.enabled=true": (["model.ema.enabled=true"], 1),
    "fault_tolerance.enabled=true": (FT, 1),
    "fault_tolerance.mode=local_sgd or diloco": ([*FT, "fault_tolerance.mode=local_sgd"], 1),
    "fault_tolerance.mode=diloco": ([*FT, "fault_tolerance.mode=diloco"], 1),
    "compile.enabled=true": (["compile=on"], 1),
    "profile.enabled=true": (["profile=on"], 1),
    "elastic.enabled=true": (["elastic=on", "loop.micro_batch_size=8"], 1),
    "precision.dtype=fp16": (["precision=fp16"], 1),
    "optim.weight_decay > 0": (["optim.weight_decay=0.1"], 1),
    "sched.name=cosine or wsd": (["sched=wsd"], 1),
    "sched.name=wsd": (["sched=wsd"], 1),
    "sched.name=step": (["sched=step"], 1),
    "sched.name=step or multistep": (["sched=multistep"], 1),
    "sched.name=multistep": (["sched=multistep"], 1),
    "sched.warmup_steps > 0": (["sched.warmup_steps=10"], 1),
    "comm.hook=powersgd": (["comm.hook=powersgd"], 2),
    "comm.hook=local_sgd": (["comm.hook=local_sgd"], 2),
    "parallel.activation_checkpointing=full": (["parallel.activation_checkpointing=full"], 1),
    "mlflow in logging.trackers": (["logging.trackers=[jsonl,mlflow]"], 1),
    "wandb in logging.trackers": (["logging.trackers=[jsonl,wandb]"], 1),
    "logging.prometheus.port": (["logging.prometheus.port=9400"], 1),
    "logging.flops=true": (["logging.flops=true"], 1),
}
# What the switch-off case needs besides the default config: the outer switch of a nested one,
# and logging.flops, on by default.
SWITCH_OFF = {
    "optim.weight_decay > 0": ["optim.weight_decay=0"],  # the sgd group's default decays
    "fault_tolerance.mode=local_sgd or diloco": FT,
    "fault_tolerance.mode=diloco": FT,
    "logging.flops=true": ["logging.flops=false"],
}
# Keys whose switch-on case the rest of the config does not allow here.
NOT_ON_HERE = {
    "model.lora.adapter": "needs a peft folder (tests/unit/test_lora.py loads one)",
    "comm.powersgd.batched": "refused on this torch (distributed/comm_hooks.py)",
}
# Values that differ from the default and are valid with the switch on; bools, ints and floats
# are derived from the default.
VALUES: dict[str, Any] = {
    "model.lora.target_modules": ["q_proj", "v_proj"],
    "model.lora.adapter": "{tmp}/adapter",
    "fault_tolerance.lighthouse": "http://localhost:2",
    "fault_tolerance.replica_backend": "gloo",
    "fault_tolerance.mode": "diloco",  # with sync_every, outer_lr and outer_momentum set too
    "compile.mode": "default",
    "compile.backend": "aot_eager",
    "compile.dynamic": True,
    "elastic.batch_policy": "keep_per_rank",
    "sched.milestones": [10, 20],
    "sched.min_lr": 0.001,
    "sched.decay_steps": 20,
    "sched.decay_ratio": 0.2,
    "sched.decay_type": "cosine",
    "logging.mlflow.tracking_uri": "{tmp}/mlruns",
    "logging.mlflow.experiment": "guards",
    "logging.mlflow.run_name": "guards",
    "logging.wandb.project": "guards",
    "logging.wandb.entity": "guards",
    "logging.wandb.mode": "offline",
    "logging.prometheus.host": "127.0.0.1",
    "logging.peak_tflops": 1.0,
}


DEFAULTS = schema_defaults()  # every key of the schema, walked from the root config
GUARDED = [(guard, key) for guard in GUARDS for key in guard.keys]


def _value(key: str, tmp: str) -> Any:
    if key in VALUES:
        value = VALUES[key]
        return value.format(tmp=tmp) if isinstance(value, str) else value
    default = DEFAULTS[key]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2 if default else 0.1  # halves keep the timeouts' order
    raise AssertionError(f"{key}: no value to set; add one to VALUES")


def _override(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    if isinstance(value, list):
        return f"{key}=[{','.join(str(v) for v in value)}]"
    return f"{key}={value}"


@functools.cache
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def _with_keys(base: list[str], keys: list[str]) -> Config:
    """``base`` composed by Hydra once, then ``keys`` merged onto it as Hydra merges a command
    line's key=value (the same typed merge), without composing again for each key (0.25 s)."""
    merged = OmegaConf.merge(_composed(tuple(base)), OmegaConf.from_dotlist(keys))
    return to_config(cast(DictConfig, merged))


def _under(key: str, group: str) -> bool:
    return key.startswith(f"{group}.")


def test_the_table_names_keys_of_the_schema_each_decided_once():
    switches = {guard.switch for guard in GUARDS}
    named = [*switches, *(key for _, key in GUARDED), *ACTS_ALONE, *UNCHECKED]
    assert not [key for key in named if key not in DEFAULTS]
    decided = [*ACTS_ALONE, *UNCHECKED]
    assert len(set(decided)) == len(decided)
    guarded = {key for _, key in GUARDED}
    assert not guarded & set(decided)
    assert not switches & set(decided)
    for key in decided:  # the lists are about the switched groups alone
        assert any(_under(key, group) for group in SWITCHED_GROUPS), key
    assert set(SWITCH_ON) == {guard.needs for guard in GUARDS}


def test_every_key_of_a_group_behind_a_switch_is_decided():
    """A new key under model.lora, fault_tolerance, ... must be guarded or listed with a reason."""
    decided = {guard.switch for guard in GUARDS} | {key for _, key in GUARDED}
    decided |= set(ACTS_ALONE) | set(UNCHECKED)
    undecided = [
        key
        for key in DEFAULTS
        if any(_under(key, group) for group in SWITCHED_GROUPS) and key not in decided
    ]
    assert not undecided, (
        f"{undecided}: add each to a Guard in sdnet_trainer/config/guards.py, or to ACTS_ALONE "
        f"or UNCHECKED with the reason"
    )


@pytest.mark.parametrize("guard, key", GUARDED, ids=[f"{k}@{g.needs}" for g, k in GUARDED])
def test_a_guarded_key_set_alone_is_refused_naming_both_keys(guard, key, tmp_path):
    value = _value(key, str(tmp_path))
    given = _override(key, value)
    cfg = _with_keys(SWITCH_OFF.get(guard.needs, []), [given])
    with pytest.raises(ConfigError) as err:
        validate_switched_keys(cfg, given_keys([given]))
    message = str(err.value)
    assert f"{key}=" in message and guard.needs in message and "no effect" in message
    # Not given on the command line (a recipe's, checked by the shipped configs' test): passes.
    validate_switched_keys(cfg, given_keys(["seed=1"]))


@pytest.mark.usefixtures("main_in_this_process")
@pytest.mark.parametrize("command", [[], ["--dry-run", "world_size=1"]], ids=["run", "dry_run"])
def test_the_command_line_refuses_a_guarded_key_given_alone(command, tmp_path, monkeypatch, capfd):
    code, output = main_in_process(
        [*command, *TINY, f"run.root={tmp_path}", "model.lora.r=8"], monkeypatch, capfd
    )
    assert code == 2, output[-3000:]
    assert "model.lora.r=8 has no effect without model.lora.enabled=true" in output


# The LoRA case builds the adapters on the meta device through peft (seconds): the full tier.
SLOW_ON = {"model.lora.enabled=true"}


@pytest.mark.parametrize(
    "guard",
    [
        pytest.param(g, marks=[pytest.mark.full] if g.needs in SLOW_ON else [], id=g.needs)
        for g in GUARDS
    ],
)
def test_with_the_switch_on_the_guarded_keys_pass(guard, tmp_path):
    if guard.needs == "wandb in logging.trackers" and importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed: validation refuses the tracker")
    overrides, world_size = SWITCH_ON[guard.needs]
    keys = [key for key in guard.keys if key not in NOT_ON_HERE]
    cfg = compose([*overrides, *(_override(k, _value(k, str(tmp_path))) for k in keys)])
    assert not [key for key in keys if DEFAULTS[key] == value_of(cfg, key)]
    validate(cfg, world_size=world_size)


GROUP_FILES = sorted(
    path for path in (REPO / "configs").glob("*/*.yaml") if path.parent.name != "hydra"
)


# Each option's file on the schema's defaults: what it sets, with the switches as it and the
# schema leave them (Hydra's composition of all of them takes 0.25 s each). The recipes are
# validated whole, this check included, by tests/unit/test_config.py.
@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}={p.stem}")
def test_no_shipped_config_sets_a_guarded_key_without_its_switch(path):
    option = {path.parent.name: OmegaConf.load(path)}
    data_root = {"data": {"root": "/data"}}  # the options of files on disk leave it mandatory
    validate_switched_keys(
        to_config(
            cast(DictConfig, OmegaConf.merge(OmegaConf.structured(Config), option, data_root))
        )
    )


def test_the_message_names_the_key_its_value_and_the_switch():
    with pytest.raises(ConfigError) as err:
        validate_switched_keys(compose(["model.lora.r=8"]), given_keys(["+model.lora.r=8"]))
    assert str(err.value) == (
        "model.lora.r=8 has no effect without model.lora.enabled=true: set "
        "model.lora.enabled=true (or leave model.lora.r at its default, 16)"
    )


def test_a_recipe_switch_turned_off_takes_what_the_recipe_set_behind_it_along():
    overrides = ["+recipe=resnet50", "data.root=/data", "model.ema.enabled=false"]
    cfg = compose(overrides)
    validate_switched_keys(cfg, given_keys(overrides))  # the user's keys: none guarded
    # Every key that differs from its default (the shipped configs' check): listed at once.
    with pytest.raises(ConfigError) as err:
        validate_switched_keys(cfg)
    message = str(err.value)
    assert message.startswith(
        "model.ema.decay=0.99890773, model.ema.every_n_steps=32, model.ema.warmup_steps=6255 "
        "have no effect without model.ema.enabled=true"
    )
    assert "model.ema.decay=0.9999, model.ema.every_n_steps=1, model.ema.warmup_steps=0" in message


def test_a_default_that_follows_another_key_is_not_taken_for_a_setting(tmp_path):
    # logging.mlflow.tracking_uri is ${run.root}/mlruns: another run.root moves it.
    validate_switched_keys(compose([f"run.root={tmp_path}"]))
    with pytest.raises(ConfigError, match="logging.mlflow.tracking_uri="):
        validate_switched_keys(compose([f"logging.mlflow.tracking_uri={tmp_path}/elsewhere"]))
