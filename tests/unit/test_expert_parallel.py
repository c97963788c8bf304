"""Expert parallel (``parallel.ep``) without processes: the refusals before launch, the dry run's
count of each rank's experts and all-to-alls, and the load a MoE run logs (metrics file and
Prometheus). Training under EP against one process: tests/distributed/test_layouts.py."""

from __future__ import annotations

import json

import pytest
import torch

from sdnet_trainer.config import compose
from sdnet_trainer.distributed.mesh import parallel_dims
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models import build_model
from sdnet_trainer.models.moe import GroupedExperts
from sdnet_trainer.preflight import validate
from tests.unit.test_dry_run_settings import _collectives, _plan

MOE = ["model=moe_debug", "data=tokens", "data.seq_len=32", "data.vocab_size=256"]


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        # moe_debug has 8 experts.
        (
            ["parallel=fsdp", "parallel.dp_shard=3", "parallel.ep=3"],
            3,
            "divisible by parallel.ep=3",
        ),
        (["parallel=fsdp", "parallel.dp_shard=2", "parallel.ep=4"], 2, "parallel.dp_shard=2"),
        (["parallel.ep=2"], 2, "parallel.dp_shard=1"),  # DDP replicates: no dp_shard to take
        (
            ["parallel=fsdp", "parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=2"],
            4,
            "parallel.cp=2",
        ),
        (
            ["parallel=fsdp", "parallel.ep=2", "parallel.activation_checkpointing=selective"],
            2,
            "activation_checkpointing=full",
        ),
    ],
)
def test_a_layout_expert_parallel_cannot_split_is_refused_before_launch(overrides, world, message):
    cfg = compose([*MOE, "loop.global_batch_size=12", *overrides])
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate(cfg, world_size=world)


def test_expert_parallel_on_a_model_without_experts_names_the_model():
    cfg = compose(
        ["model=llama3_debug", "data=tokens", "data.seq_len=32", "parallel=fsdp", "parallel.ep=2"]
    )
    with pytest.raises(ConfigError, match="model.name='llama' has no experts"):
        validate(cfg, world_size=2)


def test_the_mesh_lays_dp_shard_out_as_its_expert_groups():
    cfg = compose([*MOE, "parallel=fsdp", "parallel.dp_shard=8", "parallel.ep=4"])
    dims = parallel_dims(cfg.parallel, 8)
    assert (dims.dp_shard, dims.ep, dims.batch_ranks) == (8, 4, 8)
    assert dims.describe().endswith("experts over ep 4")


def _expert_numel(cfg) -> int:
    with torch.device("meta"):
        model = build_model(cfg.model)
    return sum(
        p.numel() for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    )


def test_the_dry_run_counts_each_ranks_experts_and_their_all_to_alls(tmp_path, capsys):
    """8 ranks of FSDP, the 8 experts over ep=4: each rank holds 2 experts, sharded over the 2
    ranks that hold the same ones (an eighth of the experts' bytes, as FSDP alone gives, but
    gathered over 2 ranks instead of 8), with AdamW's two moments; per MoE layer and step the
    routed rows (micro-batch 2 x 32 tokens x top-2 x width 64, fp32) go out and back in forward
    and their gradients in backward."""
    common = [*MOE, "parallel=fsdp", "loop.global_batch_size=16", "optim=adamw"]
    plans, text = _plan(tmp_path, capsys, ["world_size=8", *common, "parallel.ep=4"])
    experts = _expert_numel(compose(MOE)) * 4  # fp32
    [rank] = plans
    assert rank["expert_params"] == experts // 8
    assert rank["expert_optim"] == 2 * experts // 8
    assert rank["expert_params"] < rank["params"] and rank["expert_optim"] < rank["optim"]
    assert "of which experts" in text
    collectives = _collectives(rank)
    assert collectives["all_gather (GroupedExperts)"]["over"] == "dp_shard_mod_ep"
    assert collectives["all_gather (GroupedExperts)"]["bytes_each"] == experts // 8 // 2 * 2
    layers = 2
    dispatch = collectives["all_to_all (EP dispatch, combine)"]
    assert (dispatch["over"], dispatch["count"]) == ("ep", 4 * layers)
    assert dispatch["bytes_each"] == 2 * 32 * 2 * 64 * 4
    plain, _ = _plan(tmp_path, capsys, ["world_size=8", *common])
    assert plain[0]["expert_params"] == experts // 8
    assert not any("EP" in kind for kind in _collectives(plain[0]))


def test_a_moe_run_logs_each_layers_load_and_the_auxiliary_loss(tmp_path):
    """One process, 2 steps: every step's routed slots (16 sequences x 32 tokens x top-2) are in
    the metrics file per layer and expert, with the fewest/most ratio and the auxiliary loss."""
    from sdnet_trainer.training.trainer import Trainer

    cfg = compose(
        [
            *MOE,
            "data.train_size=64",
            "data.val_size=16",
            "loop.max_steps=2",
            "loop.global_batch_size=16",
            "logging.log_every_n_steps=1",
            "logging.trackers=[jsonl]",
            "logging.flops=false",
            "checkpoint.save_on_exit=false",
        ]
    )
    Trainer(cfg, output_dir=tmp_path).fit()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "moe/aux_loss" in line]
    assert [line["step"] for line in steps] == [1, 2]
    for line in steps:
        for layer in (0, 1):
            tokens = [line[f"moe/layer{layer}/expert{e}/tokens"] for e in range(8)]
            assert sum(tokens) == 16 * 32 * 2
            low, high = line[f"moe/layer{layer}/tokens_min"], line[f"moe/layer{layer}/tokens_max"]
            assert (low, high) == (min(tokens), max(tokens))
            assert line[f"moe/layer{layer}/load_min_max"] == pytest.approx(low / high)
        # 2 layers, each about coeff (0.01) x E x sum(f P) ~ 0.01 when balanced.
        assert 0.01 < line["moe/aux_loss"] < 0.1


def test_prometheus_gives_the_layer_and_expert_as_labels():
    pytest.importorskip("prometheus_client")
    from sdnet_trainer.observability.prometheus import FAMILIES, PrometheusExporter

    resolve = PrometheusExporter._resolve
    exporter = PrometheusExporter.__new__(PrometheusExporter)
    exporter.rank, exporter._help = 0, dict(FAMILIES)
    tokens = resolve(exporter, "moe/layer3/expert7/tokens")
    assert tokens is not None and tokens.name == "sdnet_moe_expert_tokens"
    assert tokens.labels == (("layer", "3"), ("expert", "7"))
    ratio = resolve(exporter, "moe/layer3/load_min_max")
    assert ratio is not None and (ratio.name, ratio.labels) == (
        "sdnet_moe_load_min_max",
        (("layer", "3"),),
    )
    aux = resolve(exporter, "moe/aux_loss")
    assert aux is not None and aux.name == "sdnet_moe_aux_loss"
