"""``parallel=auto`` (sdnet_trainer/plan/auto.py): the layouts it chooses, what it says when
nothing fits, the figures it reads, and how a launch and a resume take its choice. Planning
starts no process: every test here plans in this one. The 4-process run of a chosen layout,
compared with one process, is ``gpt_auto`` in tests/distributed/test_layouts.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sdnet_trainer.cli import _layout_keys
from sdnet_trainer.config import compose
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.plan import auto
from sdnet_trainer.plan.auto import layout_overrides, plan_layout, resolve_auto, table, with_layout
from sdnet_trainer.plan.estimate import Layout, estimate
from sdnet_trainer.plan.hardware import hardware, read_calibration
from sdnet_trainer.plan.layouts import recorded_layout
from sdnet_trainer.plan.model_stats import model_stats
from sdnet_trainer.preflight import validate
from sdnet_trainer.training.fits import GIB
from tests.distributed.test_layouts import AUTO_FSDP, GPT
from tests.support import main_in_process

CPU = torch.device("cpu")
# Llama 3.1 8B at 8,192 tokens on nodes of 8 GPUs of 80 GB (an H100's bf16 peak).
LLAMA_8B = [
    "+recipe=llama3_8b",
    "parallel=auto",
    "parallel.auto.device=cuda",
    "parallel.memory_per_rank_gib=80",
    "parallel.auto.peak_tflops=989",
    "parallel.auto.ranks_per_node=8",
]


def _plan(overrides: list[str], world_size: int):
    cfg = compose(overrides)
    return cfg, plan_layout(cfg, world_size, hardware(cfg, CPU))


@pytest.mark.full  # about 20 seconds: an 8B model measured once, three dry runs
def test_llama3_8b_follows_the_rules_users_know_at_8_64_and_1024_ranks():
    """FSDP within a node (TP 2 at most); FSDP x TP with TP inside the node at 64; stages across
    nodes at 1,024 (the recipe's 32 sequences give at most 32 data-parallel ranks, TP at most the
    8 key/value heads). The dry run of each choice counts bytes that fit, and the table says why
    each runner-up lost."""
    chosen = {}
    for world_size in (8, 64, 1024):
        cfg, plan = _plan(LLAMA_8B, world_size)
        layout = plan.layout
        chosen[world_size] = layout
        for rank in plan.checked:  # the dry run's own count, on the first and last stage
            assert rank.params + rank.grads + rank.optim + rank.activations <= plan.hardware.memory
        assert plan.hardware.memory == int(0.85 * 80 * GIB)
        text = table(plan, cfg)
        assert "chosen" in text and f"{world_size} ranks (8 per node)" in text
        assert text.count(" s ") >= 1 or "more per rank" in text  # each loser's reason
        assert "as keys: parallel=fsdp" in text
        # The keys the table prints launch the same layout without the planner (the recipe's
        # tensor-parallel options are turned off where the choice has none).
        keys = compose(["+recipe=llama3_8b", *layout_overrides(layout)])
        validate(keys, world_size=world_size)
        assert _layout_keys(keys) == _layout_keys(with_layout(cfg, layout))
    eight, sixty_four, thousand = chosen[8], chosen[64], chosen[1024]
    # The activations are measured in fp32 (plan/model_stats.py), twice what a bf16 run keeps,
    # and the loss's peak over a sequence's logits is three fp32 copies of 8,192 x 128,256 (11.7
    # GiB, split by TP's loss_parallel): FSDP over 8 without activation checkpointing does not
    # fit, FSDP 4 x TP 2 barely; splitting each sequence over context-parallel ranks (or the
    # model over TP 2 or stages) costs less than recomputing every block.
    assert eight.strategy == "fsdp" and eight.tp <= 2 and eight.cp * eight.tp * eight.pp > 1
    cfg = compose(LLAMA_8B)
    for old in (Layout("fsdp", 1, 8, 1, 1, False, 1, 4), Layout("fsdp", 1, 4, 2, 1, False, 1, 8)):
        scratch = with_layout(cfg, old)
        counted = estimate(scratch, model_stats(scratch), old, hardware(scratch, CPU))
        # The recipe's loss_parallel splits the loss over the vocabulary with TP: FSDP 4 x TP 2,
        # 61.8 GiB before the loss was counted, is 67.7 GiB at backward's start (the limit: 68).
        assert counted.bytes["loss"] > 11 * GIB / old.tp
        assert counted.total_bytes > (68 if old.tp == 1 else 67) * GIB
    assert sixty_four.strategy == "fsdp" and sixty_four.pp == 1
    # Each sequence or the model split inside a node (context parallel's exchanges cost less
    # than TP's at 8,192 tokens), the rest data parallel.
    split = sixty_four.tp * sixty_four.cp
    assert 1 < split <= 8 and sixty_four.dp == 64 // split
    assert thousand.pp > 1 and 1 < thousand.tp <= 8 and thousand.dp <= 32
    # Pipeline stages are the mesh's outermost dimension: each spans whole nodes.
    assert (1024 // thousand.pp) % 8 == 0


def test_fsdp_where_a_replica_per_rank_does_not_fit():
    cfg, plan = _plan(GPT + AUTO_FSDP, 4)
    layout = plan.layout
    assert (layout.strategy, layout.dp_shard, layout.tp, layout.pp) == ("fsdp", 4, 1, 1)
    # No whole replica per rank among the runners-up (DDP or ZeRO-1 without stages or TP).
    whole = [
        e for e in plan.shown if e.layout.strategy != "fsdp" and e.layout.tp * e.layout.pp == 1
    ]
    assert whole == [] and len(plan.shown) == 5
    assert plan.fitting < plan.considered


def test_fsdp_with_tensor_parallel_where_fsdp_alone_does_not_fit():
    """1.4 MiB: below FSDP over 4 (its gathered blocks are whole: 1.58 MiB at least), above FSDP
    x TP (2 x 2) with micro-batches of 8. FSDP x TP, ahead of TP over all 4 (the same
    micro-steps, more communication)."""
    limit = ["parallel.memory_per_rank_gib=0.00161"]
    cfg, plan = _plan(GPT + AUTO_FSDP + limit, 4)
    layout = plan.layout
    assert (layout.strategy, layout.dp_shard, layout.tp, layout.pp) == ("fsdp", 2, 2, 1)
    assert all(e.layout.tp > 1 for e in plan.shown)
    assert "tensor-parallel communication" in table(plan, cfg)  # why TP 4 came second


def test_a_model_without_a_tensor_parallel_plan_gets_no_tensor_parallel_layout():
    cfg, plan = _plan(["model=simple_cnn", "data.image_size=16", "parallel=auto"], 4)
    assert plan.shown and all(e.layout.tp == 1 for e in plan.shown)


def test_nothing_fits_says_what_would():
    cfg = compose(GPT + AUTO_FSDP + ["parallel.memory_per_rank_gib=0.0005"])
    with pytest.raises(ConfigError) as excinfo:
        plan_layout(cfg, 4, hardware(cfg, CPU))
    message = str(excinfo.value)
    assert "no layout of model gpt on 4 ranks fits 0.44 MiB" in message
    assert "the leanest, tp 4 with activation checkpointing on and micro-batch 1" in message
    assert "It would fit with 16 ranks" in message and "parallel.memory_per_rank_gib" in message


def test_the_command_line_plans_before_validating(tmp_path):
    """cli._validated: parallel=auto becomes the plan's layout before the launch's checks."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from sdnet_trainer import cli
    from sdnet_trainer.config import CONFIG_MODULE

    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        composed = hydra_compose(config_name="config", overrides=GPT + AUTO_FSDP)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "4")
        config = cli._validated(composed, tmp_path)
    assert (config.parallel.strategy, config.parallel.dp_shard) == ("fsdp", 4)
    assert config.parallel.activation_checkpointing in ("none", "full")
    assert cli._layout_keys(config)[0] == "fsdp"


def _write_checkpoint(folder: Path, world_size: int, meta: dict) -> None:
    """A committed checkpoint's folder as a run leaves it: its manifest (``meta`` as
    ``checkpointer.run_meta`` writes it) and the one file it lists."""
    step = folder / "step_00000010"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"x" * 7)
    manifest = {
        "format_version": 2,
        "step": 10,
        "world_size": world_size,
        "created": 0.0,
        "meta": meta,
        "files": [{"name": ".metadata", "bytes": 7, "crc32": 0}],
    }
    (step / "manifest.json").write_text(json.dumps(manifest))


def test_a_resume_keeps_its_checkpoints_layout_and_another_world_size_plans_again(
    tmp_path, monkeypatch
):
    from sdnet_trainer import Trainer
    from sdnet_trainer.plan.estimate import Layout
    from sdnet_trainer.training.checkpointer import run_meta

    cfg = compose(GPT + ["parallel=auto", "parallel.auto.ranks_per_node=4"])
    # What a run of DDP over 4 ranks, 2 accumulation steps, recorded in its checkpoints.
    written = auto.with_layout(cfg, Layout("ddp", 4, 1, 1, 1, False, 2, 2))
    _write_checkpoint(tmp_path, 4, run_meta(written, Trainer, 16, 4))

    def no_planning(*args, **kwargs):
        raise AssertionError("planned although the checkpoint recorded its layout")

    with monkeypatch.context() as mp:
        mp.setattr(auto, "plan_layout", no_planning)
        same = resolve_auto(cfg, 4, checkpoint_dir=tmp_path, device=CPU)
    assert (same.parallel.strategy, same.parallel.dp_replicate, same.loop.grad_accum_steps) == (
        "ddp",
        4,
        2,
    )
    other = resolve_auto(cfg, 2, checkpoint_dir=tmp_path, device=CPU)  # written by 4 ranks
    assert other.parallel.strategy != "auto"
    degrees = (other.parallel.dp_replicate, other.parallel.dp_shard, other.parallel.tp)
    assert math.prod(degrees) * other.parallel.pp == 2
    # A manifest whose layout is not whole (a degree that is no positive integer) is no layout.
    meta = run_meta(written, Trainer, 16, 4)
    meta["config"]["parallel"]["tp"] = "8; rm -rf"
    _write_checkpoint(tmp_path / "bad", 4, meta)
    assert recorded_layout(cfg, tmp_path / "bad", 4) is None
    for field, value in (("tp", 10**400), ("dp_replicate", 2)):  # past any float; 2 x 1 != 4
        meta = run_meta(written, Trainer, 16, 4)
        meta["config"]["parallel"][field] = value
        meta["global_batch_size"] = 1.0
        _write_checkpoint(tmp_path / f"lies_{field}", 4, meta)
        assert recorded_layout(cfg, tmp_path / f"lies_{field}", 4) is None


def test_a_calibration_file_is_untrusted_input(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"flops": 2e13, "intra_node_gbps": 300, "device": "H100"}))
    assert read_calibration(str(path)) == {"flops": 2e13, "intra_node_gbps": 300.0}
    cfg = compose(GPT + AUTO_FSDP + [f"parallel.auto.calibration={path}"])
    hw = hardware(cfg, CPU)
    assert hw.flops == 2e13 and hw.intra == 300e9 and "measured" in hw.flops_source
    for bad, field in (
        ({"flops": -1}, "flops"),
        ({"latency_us": "1e-3"}, "latency_us"),
        ({"flops": 10**400}, "flops"),  # an integer past any float
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=f"parallel.auto.calibration=.*{field}"):
            read_calibration(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="a JSON object"):
        read_calibration(str(path))


@pytest.mark.usefixtures("main_in_this_process")
def test_the_plan_command_prints_the_table_and_writes_its_choice(tmp_path, monkeypatch, capfd):
    out = tmp_path / "plan.json"
    code, output = main_in_process(
        ["--plan", "world_size=4", *GPT, *AUTO_FSDP[1:], f"json={out}"], monkeypatch, capfd
    )
    assert code == 0, output[-3000:]
    assert "parallel=auto: model gpt, 4 ranks (4 per node)" in output
    record = json.loads(out.read_text())
    assert record["shown"][0]["overrides"][:3] == [
        "parallel=fsdp",
        "parallel.dp_replicate=1",
        "parallel.dp_shard=4",
    ]
    assert record["dry_run"][0]["rank"] == 0
    # --dry-run of parallel=auto: the plan's table, then the dry run of its choice on every rank.
    code, output = main_in_process(
        ["--dry-run", "world_size=4", "ranks=all", *GPT, *AUTO_FSDP], monkeypatch, capfd
    )
    assert code == 0, output[-3000:]
    assert "parallel=auto: model gpt" in output
    assert "world size 4: pp 1 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 1 (fsdp)" in output
    assert output.count("\nrank ") == 4
    code, output = main_in_process(
        ["--plan", "world_size=4", *GPT, "parallel.auto.memory_fraction=1.5"], monkeypatch, capfd
    )
    assert code == 2 and "parallel.auto.memory_fraction=1.5 must be at most 1" in output
    # Without parallel.auto.ranks_per_node, --plan plans nodes of 8 (no launcher says here).
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    without = [o for o in AUTO_FSDP if not o.startswith("parallel.auto.ranks_per_node=")]
    code, output = main_in_process(["--plan", "world_size=8", *GPT, *without], monkeypatch, capfd)
    assert code == 0, output[-3000:]
    assert "parallel=auto: model gpt, 8 ranks (8 per node)" in output


def test_the_calibration_measures_this_machine_into_a_file_the_planner_reads(tmp_path, monkeypatch):
    """One process (no torchrun: no links measured), a small decoder so that it takes a second."""
    from sdnet_trainer.plan import calibrate

    monkeypatch.setitem(calibrate._SHAPES, "cpu", (64, 2, 32))
    out = tmp_path / "calibration.json"
    assert calibrate.main([f"out={out}", "device=cpu"]) == 0
    measured = read_calibration(str(out))
    assert set(measured) == {"flops", "block_overhead_us"}
    cfg = compose(GPT + AUTO_FSDP + [f"parallel.auto.calibration={out}"])
    hw = hardware(cfg, CPU)
    assert (
        hw.flops == measured["flops"] and hw.block_overhead == measured["block_overhead_us"] * 1e-6
    )


def test_a_mixture_of_experts_is_planned_with_expert_parallel_and_never_tensor_parallel():
    """The candidates of a MoE (8 experts) on 4 ranks: every expert-parallel degree of FSDP's
    shard group, each a layout the launch's validator accepts; no tensor parallel (it would
    compute every expert on each TP rank: refused). A short sequence gets no context parallel."""
    cfg = compose(
        ["model=moe_debug", "data=tokens", "data.seq_len=32", "data.vocab_size=256", *AUTO_FSDP]
    )
    hw = hardware(cfg, CPU)
    estimates = auto._estimates(cfg, model_stats(cfg), 4, hw)
    degrees = {(e.layout.strategy, e.layout.dp_shard, e.layout.ep) for e in estimates}
    assert {("fsdp", 4, 1), ("fsdp", 4, 2), ("fsdp", 4, 4), ("fsdp", 2, 2)} <= degrees
    assert all(e.layout.tp == 1 and e.layout.cp == 1 for e in estimates)
    with_ep = next(e.layout for e in estimates if e.layout.ep == 4)
    validate(with_layout(cfg, with_ep), world_size=4)
    assert "parallel.ep=4" in layout_overrides(with_ep)
    assert with_ep.describe().endswith("experts over ep 4")


def test_context_parallel_is_a_candidate_for_long_sequences_alone():
    """Each rank keeps 1,024 tokens of a sequence at least (auto.MIN_CONTEXT_TOKENS)."""
    assert auto._context_degrees(compose(LLAMA_8B), 8) == [1, 2, 4, 8]  # 8,192 tokens
    assert auto._context_degrees(compose([*LLAMA_8B, "data.seq_len=2048"]), 8) == [1, 2]
    assert auto._context_degrees(compose([*LLAMA_8B, "data.seq_len=1024"]), 8) == [1]
    assert auto._context_degrees(compose(GPT + AUTO_FSDP), 4) == [1]  # 64 tokens


def test_a_named_gpu_gives_the_figures_of_the_one_table_explicit_keys_winning(monkeypatch):
    """parallel.auto.gpu plans GPUs from a laptop (it implies device=cuda): the memory, the bf16
    peak and the links come from runtime/gpus.py's table, the one the MFU reads too; keys given
    win over it; the plan's header names where each figure came from."""
    from sdnet_trainer.observability.flops import peak_tflops
    from sdnet_trainer.runtime.gpus import GPUS, Gpu

    named = ["+recipe=llama3_8b", "parallel=auto", "parallel.auto.gpu=h100"]
    hw = hardware(compose(named), CPU, ranks_per_node=8)  # this machine has no GPU
    assert hw.memory == int(0.85 * 80 * GIB) and "h100, parallel.auto.gpu" in hw.memory_source
    assert hw.flops == pytest.approx(989.4e12 * 0.4)
    assert "989.4 TFLOP/s bf16 peak of h100 (parallel.auto.gpu)" in hw.flops_source
    assert (hw.intra, hw.inter) == (450e9, 50e9)
    a100 = hardware(compose([*named[:2], "parallel.auto.gpu=A100"]), CPU, ranks_per_node=8)
    assert (a100.memory, a100.flops, a100.inter) == (int(0.85 * 80 * GIB), 312e12 * 0.4, 25e9)
    given = [
        "parallel.memory_per_rank_gib=40",
        "parallel.auto.peak_tflops=500",
        "parallel.auto.inter_node_gbps=12.5",
    ]
    hw = hardware(compose([*named, *given]), CPU, ranks_per_node=8)
    assert (hw.memory, hw.flops) == (int(0.85 * 40 * GIB), 500e12 * 0.4)
    assert (hw.intra, hw.inter) == (450e9, 12.5e9)  # the key given, the table's elsewhere
    assert hw.links_source == (
        "intra_node_gbps from h100 (parallel.auto.gpu), inter_node_gbps from "
        "parallel.auto.inter_node_gbps, latency_us from the defaults: nodes of 8 H100/H200 SXM"
    )
    # One table: a row changed there changes both the planner's figures and the MFU's peak.
    monkeypatch.setitem(GPUS, "H100 SXM", Gpu({"bf16": 123.0}, 40, 100, 10))
    hw = hardware(compose(named), CPU, ranks_per_node=8)
    assert (hw.memory, hw.flops, hw.intra, hw.inter) == (
        int(0.85 * 40 * GIB),
        123e12 * 0.4,
        100e9,
        10e9,
    )
    h100 = "NVIDIA H100 80GB HBM3"
    assert peak_tflops(torch.device("cuda"), torch.bfloat16, device_name=h100) == 123.0
    known = "parallel.auto.gpu='h1000' is not one of a10, .*b200, h100, .*did you mean 'h100'"
    with pytest.raises(ConfigError, match=known):
        hardware(compose([*named[:2], "parallel.auto.gpu=h1000"]), CPU)
    with pytest.raises(ConfigError, match="parallel.auto.gpu=h100 plans GPUs, parallel.auto.dev"):
        hardware(compose([*named, "parallel.auto.device=cpu"]), CPU)
    with pytest.raises(ConfigError, match="parallel.auto.gpu=v100 has no dense bf16 peak"):
        hardware(compose([*named[:2], "parallel.auto.gpu=v100"]), CPU)
    # The plan's header, for a model that plans in a moment.
    cfg, plan = _plan([*GPT, *AUTO_FSDP[:1], "parallel.auto.gpu=h200"], 8)
    header = table(plan, cfg).splitlines()[1]
    assert "(h200, parallel.auto.gpu)" in header and "peak of h200 (parallel.auto.gpu)" in header
    assert "between nodes (intra_node_gbps from h200 (parallel.auto.gpu)" in header
