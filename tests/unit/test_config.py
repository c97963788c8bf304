"""Composition, typed schemas and whole-config validation."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from sdnet_trainer.config import compose, recipe_names
from sdnet_trainer.config.resolvers import rank0_only, run_id
from sdnet_trainer.distributed.batching import BatchLayout, batch_layout
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.preflight import validate

RECIPES = [
    "custom_spirals",
    "gpt_fsdp",
    "gpt_pipeline",
    "gpt_tp_fsdp",
    "llama3_8b",
    "llama3_debug",
    "llama3_sft",
    "moe_debug",
    "quickstart",
    "resnet152",
    "resnet152_fsdp",
    "resnet152_pipeline",
    "resnet18_cifar10",
    "resnet50",
]
# Recipes with pipeline stages or tensor-parallel groups need that many ranks at least.
MODEL_PARALLEL = {"gpt_pipeline", "gpt_tp_fsdp", "resnet152_pipeline"}
# Recipes for a node of 8 GPUs or more (tensor parallel over 8), validated at 8 and 64 ranks.
NODE_SCALE = {"llama3_8b"}


def _error_text(excinfo) -> str:
    """Hydra wraps the OmegaConf error; the key's name is in the chain."""
    err, parts = excinfo.value, []
    while err is not None:
        parts.append(str(err))
        err = err.__cause__
    return "\n".join(parts)


def test_every_recipe_is_registered():
    assert sorted(recipe_names()) == RECIPES


@pytest.mark.parametrize(
    "recipe, world_size",
    [
        (r, w)
        for r in RECIPES
        for w in (1, 2, 4)
        if (w > 1 or r not in MODEL_PARALLEL) and r not in NODE_SCALE
    ]
    + [(r, w) for r in NODE_SCALE for w in (8, 64)],
)
def test_every_recipe_composes_and_validates(recipe, world_size):
    cfg = compose([f"+recipe={recipe}"])
    validate(cfg, world_size=world_size)
    assert cfg.run.name == recipe


def test_resnet152_recipe_is_what_it_says():
    cfg = compose(["+recipe=resnet152"])
    assert (cfg.model.name, cfg.data.num_classes, cfg.data.image_size) == ("resnet152", 1000, 224)
    assert (cfg.optim.name, cfg.optim.nesterov, cfg.loss.label_smoothing) == ("SGD", True, 0.1)
    assert (cfg.sched.name, cfg.precision.dtype, cfg.optim.clip_grad_norm) == (
        "cosine",
        "auto",
        1.0,
    )
    assert cfg.sched.warmup_steps > 0 and cfg.parallel.strategy == "ddp"


def test_resnet18_cifar10_recipe_is_what_it_says():
    cfg = compose(["+recipe=resnet18_cifar10", "data.root=/data/cifar"])
    assert (cfg.model.name, cfg.model.cifar_stem, cfg.data.name, cfg.optim.name) == (
        "resnet18",
        True,
        "cifar10",
        "SGD",
    )


def test_command_line_overrides_win_over_the_recipe():
    cfg = compose(["+recipe=quickstart", "optim.lr=0.123", "precision=bf16", "loop.max_steps=7"])
    assert (cfg.optim.lr, cfg.precision.dtype, cfg.loop.max_steps) == (0.123, "bf16", 7)


def test_misspelled_key_fails_at_compose_naming_the_key():
    with pytest.raises(ConfigCompositionException) as excinfo:
        compose(["+recipe=quickstart", "optim.lrr=0.1"])
    assert "optim.lrr" in _error_text(excinfo)
    assert "Key 'lrr' not in 'OptimConfig'" in _error_text(excinfo)
    # Appending (which lifts Hydra's struct flag) does not get past the schema either.
    with pytest.raises(
        ConfigError, match=r"unknown config key optim.lrr .*did you mean optim.lr\?"
    ):
        compose(["+optim.lrr=0.1"])
    compose(["+optim.kwargs.foreach=true"])  # free-form dicts take new keys


def test_wrong_type_fails_at_compose_naming_the_key():
    with pytest.raises(ConfigCompositionException) as excinfo:
        compose(["loop.max_steps=many"])
    assert "loop.max_steps" in _error_text(excinfo)
    assert isinstance(excinfo.value.__cause__, ValidationError)


def test_unknown_group_option_lists_the_choices():
    with pytest.raises(ConfigCompositionException) as excinfo:
        compose(["precision=bf61"])
    text = _error_text(excinfo)
    assert "precision" in text and "bf16" in text


@pytest.mark.parametrize(
    "world_size, accum, expected", [(1, 1, 64), (2, 1, 32), (2, 2, 16), (4, 4, 4)]
)
def test_micro_batch_split(world_size, accum, expected):
    cfg = compose([f"loop.grad_accum_steps={accum}"])
    assert batch_layout(cfg, world_size).micro_batch_size == expected


def test_elastic_batch_policies():
    keep_global = compose(["elastic=on", "loop.micro_batch_size=8", "loop.global_batch_size=64"])
    assert [batch_layout(keep_global, w) for w in (1, 2, 4)] == [
        BatchLayout(64, 8, 8),
        BatchLayout(64, 4, 8),
        BatchLayout(64, 2, 8),
    ]  # accumulation follows
    keep_rank = compose(
        [
            "elastic=on",
            "elastic.batch_policy=keep_per_rank",
            "loop.micro_batch_size=8",
            "loop.grad_accum_steps=2",
        ]
    )
    assert [batch_layout(keep_rank, w) for w in (1, 3)] == [
        BatchLayout(16, 2, 8),
        BatchLayout(48, 2, 8),
    ]


def test_batch_not_divisible_names_the_keys_and_numbers():
    cfg = compose(["loop.global_batch_size=100", "loop.grad_accum_steps=3"])
    with pytest.raises(ConfigError) as excinfo:
        validate(cfg, world_size=2)
    message = str(excinfo.value)
    assert "loop.global_batch_size=100" in message and "loop.grad_accum_steps (3)" in message
    assert "(2)" in message and "= 6" in message


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["loop.max_epochs=2"], "loop.max_steps"),  # both set
        (["optim.clip_grad_norm=1", "optim.clip_grad_value=1"], "optim.clip_grad_value"),
        (["model.num_classes=5"], "data.num_classes=10"),
        (["optim.name=Adamm"], "did you mean 'Adam'"),
        (["optim.name=torch.nn.Linear"], "not a torch.optim.Optimizer"),
        (["precision.dtype=bf61"], "precision.dtype='bf61'"),
        (["sched.name=cosin"], "did you mean 'cosine'"),
        (["sched.name=multistep", "sched.milestones=[5,3]"], "sched.milestones"),
        (["loss.label_smoothing=1.5"], "loss.label_smoothing"),
        (["dist.backend=nccl", "dist.device=cpu"], "dist.backend=nccl"),
        (["parallel.sync_batchnorm=true", "dist.device=cpu"], "parallel.sync_batchnorm"),
        (["loop.max_steps=0"], "loop.max_steps=0"),
        (["logging.progress_bar=maybe"], "logging.progress_bar"),
        (["health.nonfinite=ignore"], "health.nonfinite='ignore'"),
        (["checkpoint.keep_last=0"], "checkpoint.keep_last=0"),
        (["elastic.batch_policy=keep_all"], "elastic.batch_policy"),
        (["elastic=on", "elastic.batch_policy=keep_per_rank"], "needs loop.micro_batch_size"),
        (["loop.micro_batch_size=16", "loop.grad_accum_steps=1"], "needs loop.grad_accum_steps=4"),
        (["elastic=on", "loop.micro_batch_size=24"], "x loop.micro_batch_size (24)"),
    ],
)
def test_invalid_combinations_name_the_key(overrides, key):
    cfg = compose(overrides)
    with pytest.raises(ConfigError, match=None) as excinfo:
        validate(cfg, world_size=1)
    assert key in str(excinfo.value)


def test_run_id_is_shared_by_ranks(monkeypatch):
    monkeypatch.setenv("SDNET_RUN_ID", "job-42")
    assert run_id() == "job-42"
    monkeypatch.delenv("SDNET_RUN_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-7")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert run_id() == "rdzv-7"  # several nodes: only the rendezvous id is common to all
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    # One node: the launcher's (parent's) start time, the same for every local rank.
    assert run_id() == run_id() and run_id() != "rdzv-7"


def test_ranks_that_resolved_different_runs_stop_before_training(monkeypatch, tmp_path):
    """The check after the process group is up: one directory, one run.id and one layout on every
    rank, or a ConfigError naming both values and what makes them agree (ranks started without
    torchrun or a job id each take run.id from their own clock; parallel=auto on nodes that read
    different memory may choose differently)."""
    from sdnet_trainer import cli

    layout = ("fsdp", 1, 4, 1, 1, "1F1B", 4, False, 1)
    same = (str(tmp_path), "2026-11-28_01-50-56", layout)
    monkeypatch.setattr(cli, "all_gather_objects", lambda mine: [mine, same])
    cli._check_same_run(tmp_path, same[1], layout)  # every rank alike: passes
    with pytest.raises(ConfigError, match="SDNET_RUN_ID") as excinfo:
        cli._check_same_run(tmp_path, "2026-11-28_01-50-57", layout)  # another id
    assert "'2026-11-28_01-50-56'" in str(excinfo.value)
    assert "'2026-11-28_01-50-57'" in str(excinfo.value)
    with pytest.raises(ConfigError, match="different run directories"):
        cli._check_same_run(tmp_path / "elsewhere", same[1], layout)
    with pytest.raises(ConfigError, match="parallel.memory_per_rank_gib") as excinfo:
        cli._check_same_run(tmp_path, same[1], ("ddp", 4, 1, 1, 1, "1F1B", 4, False, 1))
    assert "'ddp'" in str(excinfo.value) and "'fsdp'" in str(excinfo.value)


def test_rank0_only(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert rank0_only(".hydra") == ".hydra"
    monkeypatch.setenv("RANK", "3")
    assert rank0_only(".hydra") is None


# ---------------------------------------------------------------------- backend, device and GPUs


def _dist_error(overrides) -> str:
    from sdnet_trainer.distributed.env import validate_dist

    with pytest.raises(ConfigError) as excinfo:
        validate_dist(compose(overrides))
    return str(excinfo.value)


def test_nccl_on_a_machine_without_cuda_names_the_keys_and_the_device(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    message = _dist_error(["dist.backend=nccl"])  # dist.device=auto finds no GPU
    assert "dist.backend=nccl needs CUDA devices" in message
    assert "dist.device=auto resolved to cpu" in message and "dist.backend=gloo" in message
    assert "dist.device=cpu" in _dist_error(["dist.backend=nccl", "dist.device=cpu"])
    message = _dist_error(["dist.device=cuda"])
    assert "dist.device=cuda" in message and "is_available() is False" in message


def test_local_rank_needs_a_gpu_of_its_own(monkeypatch):
    from sdnet_trainer.distributed.env import validate_dist

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "2")
    message = _dist_error([])  # dist.device=auto: CUDA
    assert "LOCAL_RANK=2" in message and "shows 2 CUDA device(s)" in message
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert "CUDA_VISIBLE_DEVICES='0,1'" in _dist_error(["dist.backend=nccl"])
    monkeypatch.setenv("LOCAL_RANK", "1")
    validate_dist(compose(["dist.backend=nccl"]))  # GPU 1 of 2
    monkeypatch.setenv("LOCAL_RANK", "5")
    validate_dist(compose(["dist.device=cpu"]))  # no GPU needed
    monkeypatch.setenv("LOCAL_RANK", "one")
    assert "LOCAL_RANK='one' is not an integer" in _dist_error([])
