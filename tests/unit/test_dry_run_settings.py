"""The dry run of layouts with context parallel, float8 and activation checkpointing: what a rank
keeps for backward in each mode (``plan/model_stats.py``, measured on the meta model), a rank's
share of each sequence and the collectives context parallel adds (``plan/dry_run.py``), and the
report that names the three settings (``plan/cli.py``). Every dry run here plans in this process
on torch's fake process group; the per-rank parameter, gradient and optimizer bytes of the
context-parallel layouts are checked against real 4-process runs in
tests/distributed/test_layouts.py (``llama_fsdp_cp``, ``llama_fsdp_tp_cp``)."""

from __future__ import annotations

import json

import pytest
import torch

from sdnet_trainer.config import compose
from sdnet_trainer.distributed.activation_checkpointing import apply_activation_checkpointing
from sdnet_trainer.models import build_model
from sdnet_trainer.models.parallel_spec import parallel_blocks
from sdnet_trainer.plan import dry_run
from sdnet_trainer.plan.model_stats import kept_bytes, saved_activations

# The tests' Llama (2 blocks of width 64, 4 query heads over 2 key/value heads of 16): every
# Linear but the output layer has sizes that are multiples of 16, so float8 converts them.
LLAMA = ["model=llama3_debug", "data=tokens", "data.vocab_size=256"]
# Key and value elements of one token of one block: 2 key/value heads of 16.
KV_PER_TOKEN = 2 * 16


def _plan(tmp_path, capsys, argv: list[str]) -> tuple[list[dict], str]:
    """``--dry-run ARGV`` in this process: each rank's plan (its JSON) and the printed report."""
    out = tmp_path / "plan.json"
    assert dry_run([*argv, f"json={out}"]) == 0, capsys.readouterr().err[-3000:]
    return json.loads(out.read_text()), capsys.readouterr().out


def _collectives(plan: dict) -> dict[str, dict]:
    """The rank's collectives by kind, their counts added (one entry per block in the plan)."""
    merged: dict[str, dict] = {}
    for c in plan["collectives"]:
        entry = merged.setdefault(c["kind"], {**c, "count": 0})
        assert (entry["over"], entry["bytes_each"]) == (c["over"], c["bytes_each"]), c
        entry["count"] += c["count"]
    return merged


def test_checkpointing_modes_keep_less_in_order_none_selective_full():
    """Selective keeps the matmuls' and attention's outputs (torch's checkpoint caches them, out
    of autograd's sight), full each block's input, every other block under ``every=2``."""
    cfg = compose([*LLAMA, "data.seq_len=64"])
    kept = {mode: saved_activations(cfg, mode).at(4) for mode in ("none", "selective", "full")}
    assert kept["none"] > kept["selective"] > kept["full"] > 0, kept
    half = saved_activations(cfg, "full", every=2).at(4)
    assert kept["full"] < half < kept["none"]


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_the_meta_estimate_is_what_a_cpu_forward_keeps(mode):
    """The same model on the CPU, its real kernels (the CPU's fused attention among them), keeps
    what the meta measure found, but for the random-number seed and offset of the GPU kernel it
    stands in with (16 bytes per attention call, 2 blocks here; the CPU's kernel has none)."""
    cfg = compose([*LLAMA, "data.seq_len=64"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    apply_activation_checkpointing(list(parallel_blocks(model)), mode)
    on_cpu, _ = kept_bytes(model, torch.zeros(2, 64, dtype=torch.long))
    assert 0 <= saved_activations(cfg, mode).at(2) - on_cpu <= 32, on_cpu


def test_the_estimate_grows_with_the_sequence_as_fused_attention_keeps_it():
    """Linear in the tokens: attention keeps its output and log-sum-exp as a fused kernel does,
    not the T x T weights of the meta device's math path."""
    short = saved_activations(compose([*LLAMA, "data.seq_len=64"]), "none").per_sample
    longer = [*LLAMA, "data.seq_len=128", "model.llama.seq_len=128"]
    long = saved_activations(compose(longer), "none").per_sample
    assert 1.9 < long / short < 2.1, (short, long)


def test_context_parallel_halves_a_ranks_activations_and_gathers_keys_and_values(tmp_path, capsys):
    """The same micro-batch of 8 sequences of 64 tokens per rank, without and with cp=2
    (all-gather attention): half the tokens, plus the whole sequence's keys and values per block
    kept for backward; FSDP shards over dp_shard x cp; per block and step the keys and the
    values are each gathered once and their gradients reduce-scattered once, in the compute dtype
    (the default precision's fp32)."""
    common = [*LLAMA, "data.seq_len=64", "parallel=fsdp", "parallel.dp_shard=2"]
    common += ["loop.global_batch_size=16", "parallel.cp_attention=allgather"]
    [alone], _ = _plan(tmp_path, capsys, ["world_size=2", *common])
    shared, text = _plan(tmp_path, capsys, ["world_size=4", "ranks=all", *common, "parallel.cp=2"])
    assert "cp 2 (allgather) · float8 off · activation checkpointing none" in text
    for rank in shared:
        assert 0.5 < rank["activations"] / alone["activations"] < 0.6, (rank, alone)
        collectives = _collectives(rank)
        gathered = 8 * 64 * KV_PER_TOKEN * 4  # the micro-batch's whole sequences, fp32
        for kind in ("all_gather (CP keys)", "all_gather (CP values)"):
            assert collectives[kind]["over"] == "cp"
            assert (collectives[kind]["count"], collectives[kind]["bytes_each"]) == (2, gathered)
        for kind in ("reduce_scatter (CP key gradients)", "reduce_scatter (CP value gradients)"):
            assert (collectives[kind]["count"], collectives[kind]["bytes_each"]) == (2, gathered)
        assert collectives["all_gather (Block)"]["over"] == "dp_shard x cp"
    assert not any("CP" in kind for kind in _collectives(alone))


def test_the_ring_attention_is_planned_here_as_the_launchs_gpus_run_it(tmp_path, capsys):
    """``ring`` needs CUDA, which this machine need not have: the dry run checks and builds the
    layout with the all-gather attention (no parameter differs) and counts the ring's traffic,
    as torch's ring attention runs it: the keys and values gathered in forward and again in
    backward, where their gradients pass around the ring once per peer. ``auto`` is the ring on
    the launch's GPUs. DDP's replicas all-reduce with their context-parallel peers."""
    args = ["world_size=4", *LLAMA, "data.seq_len=64", "loop.global_batch_size=8"]
    for attention in ("ring", "auto"):
        [rank], text = _plan(
            tmp_path, capsys, [*args, "parallel.cp=2", f"parallel.cp_attention={attention}"]
        )
        assert "cp 2 (ring)" in text
        collectives = _collectives(rank)
        gathered = 4 * 64 * KV_PER_TOKEN * 2 * 4  # keys and values of 4 sequences, fp32
        ring = collectives["all_gather (ring keys, values)"]
        assert (ring["over"], ring["count"], ring["bytes_each"]) == ("cp", 4, gathered)
        passes = collectives["send/recv (ring key, value gradients)"]
        assert (passes["count"], passes["bytes_each"]) == (4, gathered // 2)  # a rank's half, fp32
        assert collectives["all_reduce (gradients)"]["over"] == "dp_replicate x cp"


def test_1024_ranks_with_all_three_settings_named_and_counted(tmp_path, capsys):
    """Context parallel, float8 and selective checkpointing at 1,024 ranks in one process: the
    report names them, the Linear layers float8 converts (all but the output layer) and the
    activation estimate of a rank, which selective checkpointing and float8 change as measured."""
    layout = ["world_size=1024", *LLAMA, "data.seq_len=64", "loop.global_batch_size=256"]
    layout += ["parallel=fsdp", "parallel.tp=2", "parallel.cp=4", "parallel.cp_attention=allgather"]
    three = [*layout, "parallel.activation_checkpointing=selective", "precision.float8=rowwise"]
    [rank], text = _plan(tmp_path, capsys, three)
    assert "pp 1 x dp_replicate 1 x dp_shard 128 x cp 4 x tp 2 (fsdp)" in text
    assert "cp 4 (allgather) · float8 rowwise (14 of 15 Linear layers) · " in text
    assert "activation checkpointing selective" in text
    assert "activations: an estimate" in text and "(estimate)" in text
    assert (rank["float8_layers"], rank["linear_layers"]) == (14, 15)
    assert rank["activations"] > 0
    collectives = _collectives(rank)
    # Selective checkpointing keeps the gathered keys and values (torch's flex_cp_allgather is
    # among the ops it saves): the gather does not run again in backward.
    assert collectives["all_gather (CP keys)"]["count"] == 2
    assert collectives["all_gather (SelectivelyCheckpointedBlock)"]["over"] == "dp_shard x cp"
    [plain], _ = _plan(tmp_path, capsys, layout)
    assert rank["activations"] < plain["activations"]
    assert (plain["float8_layers"], _collectives(plain)["all_gather (CP keys)"]["count"]) == (0, 2)


def test_float8_keeps_what_the_plain_linear_layers_keep():
    """torchao's Float8Linear saves its high-precision input and weight for backward, as a Linear
    does, and casts them again there: float8 changes the matmuls, not the bytes kept, in each
    mode (measured through the converted layers: the conversion ran on the meta model)."""
    plain = compose([*LLAMA, "data.seq_len=64"])
    float8 = compose([*LLAMA, "data.seq_len=64", "precision.float8=rowwise"])
    for mode in ("none", "selective", "full"):
        assert saved_activations(float8, mode) == saved_activations(plain, mode), mode


@pytest.mark.full  # seconds: a 1.2B model's meta build, parallelized and measured
def test_llama3_1b_at_8192_tokens_on_1024_ranks_prints_sensible_figures(tmp_path, capsys):
    """The command docs/parallel.md shows: per rank a 1,024th of the parameters, and activations
    between what selective checkpointing keeps at least (the matmuls' outputs of a quarter of
    the sequence, an eighth of the heads) and the whole forward's."""
    args = ["world_size=1024", "model=llama3_1b", "data=tokens", "data.seq_len=8192"]
    args += ["data.vocab_size=128256", "parallel=fsdp", "parallel.tp=8", "parallel.cp=4"]
    args += ["parallel.activation_checkpointing=selective", "precision.float8=rowwise"]
    [rank], text = _plan(tmp_path, capsys, [*args, "loop.global_batch_size=64"])
    assert "cp 4 (ring) · float8 rowwise (112 of 113 Linear layers)" in text
    params = 1_235_814_400 * 4  # configs/model/llama3_1b.yaml, fp32
    # FSDP pads each tensor's rows to a multiple of its 128 shards (a TP rank's 64 rows of the
    # key and value projections to 128): a little more than a 1,024th.
    assert params / 1024 <= rank["params"] < 1.05 * params / 1024
    # Per block and token the matmuls alone output 2 x 2048 + 2 x 512 + 2 x 8192 + 2048 elements.
    matmuls = 16 * 2 * 2048 * (2 * 2048 + 2 * 512 + 2 * 8192 + 2048) * 4 / 8
    assert matmuls < rank["activations"] < 2 * matmuls
