"""Parallel layouts rejected before launch, each with the keys and numbers in the message; and
the pipeline split by module name."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import PipelineConfig
from sdnet_trainer.distributed.mesh import ParallelDims, parallel_dims
from sdnet_trainer.distributed.pipeline import StageModule, split_model, stage_ids, stage_owner
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models import build_model
from sdnet_trainer.models.parallel_spec import Unit, pipeline_units
from sdnet_trainer.preflight import validate

GPT = ["model=gpt_tiny", "data=tokens"]


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            ["parallel.tp=3"],
            4,
            "world size 4 is not divisible by parallel.pp (1) x parallel.dp_shard (1) x "
            "parallel.cp (1) x parallel.tp (3) = 3",
        ),
        (
            ["parallel.dp_replicate=2", "parallel.tp=3"],
            4,
            "parallel.pp (1) x parallel.dp_replicate (2) x "
            "parallel.dp_shard (1) x parallel.cp (1) x parallel.tp (3) = 6 ranks, but the world "
            "size is 4",
        ),
        (["parallel.dp_replicate=-1", "parallel.dp_shard=-1"], 4, "are both -1"),
        (["parallel.tp=0"], 2, "parallel.tp=0 must be a positive degree"),
        (
            ["parallel.dp_shard=2"],
            2,
            "parallel.strategy=ddp replicates the model, so parallel.dp_shard=2",
        ),
        (
            ["parallel=zero1", "parallel.tp=2"] + GPT,
            4,
            "parallel.strategy=zero1 runs with plain data parallelism",
        ),
        (
            ["parallel.tp=2", "parallel.dp_replicate=2"] + GPT,
            4,
            "DDP does not take tensor-parallel",
        ),
        (
            ["parallel=fsdp", "precision=fp16"],
            2,
            "precision.dtype=fp16 with parallel.strategy=fsdp",
        ),
        (
            ["parallel=fsdp", "parallel.fsdp.param_dtype=int8"],
            2,
            "parallel.fsdp.param_dtype='int8' is not one of",
        ),
        (["parallel.tensor_parallel.loss_parallel=true"], 2, "need parallel.tp > 1"),
        (
            ["parallel=fsdp", "parallel.fsdp.cpu_offload=true"],
            2,
            "parallel.fsdp.cpu_offload=true moves sharded state",
        ),
        (
            ["parallel.tp=2", "model.gpt.n_heads=3", "model.gpt.dim=63"] + GPT,
            2,
            "model.gpt.n_heads=3 must be divisible by parallel.tp=2",
        ),
        (
            ["parallel.pp=2", "parallel.pipeline.microbatches=3"],
            2,
            "the batch per data-parallel rank (64 = loop.global_batch_size 64 / 1 data-parallel "
            "ranks) is not divisible by parallel.pipeline.microbatches=3",
        ),
        (
            ["parallel.pp=2", "loop.grad_accum_steps=2"],
            2,
            "loop.grad_accum_steps=2 with parallel.pp=2",
        ),
        (
            ["parallel.pp=2", "parallel.pipeline.schedule=Interleaved1F1B"],
            2,
            "set parallel.pipeline.stages_per_rank=2",
        ),
        (
            ["parallel.pp=2", "parallel.pipeline.stages_per_rank=2"],
            2,
            "parallel.pipeline.schedule=1F1B runs one stage per rank",
        ),
        (
            [
                "parallel.pp=2",
                "parallel.pipeline.schedule=ZBVZeroBubble",
                "parallel.pipeline.stages_per_rank=3",
            ],
            2,
            "places exactly 2 stages per rank",
        ),
        (
            ["parallel.pp=2", "parallel.pipeline.schedule=1f1b"],
            2,
            "parallel.pipeline.schedule='1f1b' is not one of",
        ),
        (
            ["parallel.pp=2", "parallel.pipeline.split_points=[layer2,layer3]"],
            2,
            "split_points has 2 names, but parallel.pp (2) x stages_per_rank (1) = 2 stages need 1",
        ),
        (
            ["parallel=fsdp", "parallel.tp=2", "loop.global_batch_size=5"],
            4,
            "loop.global_batch_size=5 is not divisible by data-parallel "
            "size (2 = world size 4 / (parallel.tp 2 x parallel.cp 1 x parallel.pp 1))",
        ),
        (
            ["data=tokens", "model=gpt_tiny", "data.vocab_size=100"],
            1,
            "data.vocab_size=100 differs from model.gpt.vocab_size=64",
        ),
    ],
)
def test_bad_layouts_are_rejected_before_launch(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides), world_size=world)
    assert message in str(err.value)


def test_degrees_fill_the_world_and_name_every_rank():
    dims = parallel_dims(compose(["parallel=fsdp", "parallel.tp=2", "parallel.pp=2"]).parallel, 16)
    assert dims == ParallelDims(pp=2, dp_replicate=1, dp_shard=4, tp=2) and dims.dp == 4
    # Row-major over (pp, dp_replicate, dp_shard, cp, tp), as init_device_mesh lays the ranks out.
    assert dims.coordinates(13) == {"pp": 1, "dp_replicate": 0, "dp_shard": 2, "cp": 0, "tp": 1}
    assert dims.dp_rank(13) == 2 and dims.dp_rank(5) == 2  # pipeline peers share their data
    assert sorted(dims.dp_rank(r) for r in range(16)) == sorted(list(range(4)) * 4)
    # Context-parallel peers load the same samples (each cuts its part of the sequences).
    cp = parallel_dims(compose(["parallel=fsdp", "parallel.cp=2", "parallel.tp=2"]).parallel, 16)
    assert cp == ParallelDims(dp_replicate=1, dp_shard=4, cp=2, tp=2) and cp.batch_ranks == 8
    assert cp.coordinates(6) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 1, "tp": 0}
    assert cp.dp_rank(6) == cp.dp_rank(4) == 1


def test_stage_placement_loop_and_v():
    loop = PipelineConfig(schedule="Interleaved1F1B", stages_per_rank=2)
    v = PipelineConfig(schedule="ZBVZeroBubble", stages_per_rank=2)
    assert [stage_ids(loop, r, 4) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_ids(v, r, 4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    for cfg in (loop, v):
        assert all(stage_owner(s, cfg, 4) == r for r in range(4) for s in stage_ids(cfg, r, 4))


def _resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def test_split_points_by_module_name_prune_the_rest_and_keep_names():
    model = _resnet()
    full_names = {n for n, _ in model.named_parameters()}
    ids, stages, num = split_model(
        model, PipelineConfig(split_points=["layer3"]), model_name="resnet18", pp_rank=1, pp=2
    )
    assert ids == [1] and num == 2
    assert stages[0].unit_names[0] == "layer3.0" and stages[0].unit_names[-1] == "fc"
    kept = {n for n, _ in model.named_parameters()}
    assert (
        kept and kept < full_names and all(n.startswith(("layer3", "layer4", "fc")) for n in kept)
    )


def test_stages_compose_to_the_whole_forward():
    reference, x = _resnet().eval(), torch.randn(2, 3, 32, 32)
    halves = []
    for rank in range(2):
        model = _resnet().eval()
        _, stages, _ = split_model(
            model,
            PipelineConfig(split_points=["layer2.1"]),
            model_name="resnet18",
            pp_rank=rank,
            pp=2,
        )
        halves.append(stages[0])
    torch.testing.assert_close(halves[1](halves[0](x)), reference(x))


@pytest.mark.parametrize(
    "points, message",
    [
        (["layer5"], "'layer5' is not a pipeline unit of model.name='resnet18'"),
        (["conv1"], "after the first one ('conv1')"),
    ],
)
def test_split_points_that_do_not_exist_are_named(points, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        split_model(
            _resnet(), PipelineConfig(split_points=points), model_name="resnet18", pp_rank=0, pp=2
        )


def test_a_pipeline_with_fewer_layers_than_stages_is_refused():
    gpt = build_model(compose(GPT).model)  # 2 blocks
    with pytest.raises(ConfigError, match="has 2 blocks, fewer than the 4 pipeline stages"):
        split_model(
            gpt,
            PipelineConfig(schedule="Interleaved1F1B", stages_per_rank=2),
            model_name="gpt",
            pp_rank=0,
            pp=2,
        )


def test_default_split_balances_blocks_and_units_cover_the_gpt():
    gpt = build_model(compose(GPT + ["model.gpt.n_layers=4"]).model)
    assert [u.name for u in pipeline_units(gpt, "gpt")][:2] == ["embed", "blocks.0"]
    _, stages, _ = split_model(gpt, PipelineConfig(), model_name="gpt", pp_rank=0, pp=2)
    assert stages[0].unit_names == ["embed", "blocks.0", "blocks.1"]


def test_models_without_units_get_a_clear_error():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.a(x) + self.b(x)

    with pytest.raises(ConfigError, match="has no pipeline split"):
        pipeline_units(Branchy(), "branchy")
    assert isinstance(StageModule([Unit("a")], [nn.Identity()]), nn.Module)
