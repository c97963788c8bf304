"""GPT tensor parallelism: a 2-rank TP model computes what the single-process model computes.

One 2-process launch of tests/distributed/_gpt_tp_worker.py (gloo, CPU) runs every combination of
loss_parallel and sequence_parallel and writes, for each rank, how far each is from the
reference; the tests below hold the tolerances, one combination each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed import _gpt_tp_worker as worker
from tests.support import run_cli

WORKER = Path(worker.__file__)
COMBINATIONS = [(lp, sp) for lp in (False, True) for sp in (False, True)]

# Launching two processes that import torch is most of the time; a loaded machine needs slack.
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> list[dict]:
    directory = tmp_path_factory.mktemp("gpt_tp")
    out = directory / "results.json"
    launch = run_cli([str(out)], cwd=directory, nproc=2, script=WORKER, timeout=200)
    assert launch.returncode == 0, launch.output
    results = json.loads(out.read_text())
    assert len(results) == 2
    return results


@pytest.mark.parametrize("loss_parallel,sequence_parallel", COMBINATIONS)
def test_tensor_parallel_matches_single_process(tp_results, loss_parallel, sequence_parallel):
    for rank, ranks_results in enumerate(tp_results):
        result = ranks_results[
            f"loss_parallel={loss_parallel},sequence_parallel={sequence_parallel}"
        ]
        assert result["logits"] < 1e-5, (rank, result)
        assert result["loss"] < 1e-5, (rank, result)
        assert result["grads"] < 1e-6, (rank, result)
        assert result["params_after_step"] < 1e-5, (rank, result)
        # Every parameter is a DTensor (clipping and foreach optimizers refuse a mix) and the big
        # matrices are really split, not replicated.
        assert result["plain_params"] == []
        assert {
            "embed.tok.weight",
            "head.weight",
            "blocks.0.attn.wq.weight",
            "blocks.1.mlp.w2.weight",
        } <= set(result["sharded_params"])
        # Sequence parallel splits the residual stream: each rank's blocks see half of the tokens.
        assert result["block_input_length"] == (
            worker.LENGTH // 2 if sequence_parallel else worker.LENGTH
        )
        # Logits: a plain full tensor, or a DTensor sharded over the vocabulary for loss_parallel.
        assert result["logits_layout"] == ("(Shard(dim=2),)" if loss_parallel else None)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_on_a_pruned_pipeline_stage(tp_results, sequence_parallel):
    # Units a pipeline split set to None are skipped; the rest still computes the reference logits.
    for ranks_results in tp_results:
        assert ranks_results[f"pipeline_stage,sequence_parallel={sequence_parallel}"] < 1e-5


def test_dropout_runs_under_sequence_parallel(tp_results):
    # Dropout changes the loss but not its scale; mostly: the dropout ops accept the sharded stream.
    for ranks_results in tp_results:
        loss, reference = (
            ranks_results["dropout_sequence_parallel_loss"],
            ranks_results["reference_loss"],
        )
        assert loss != reference and loss == pytest.approx(reference, rel=0.2)


@pytest.mark.parametrize("loss_parallel", [False, True])
def test_ignored_targets_on_vocabulary_shards(tp_results, loss_parallel):
    """The Trainer's LM loss (token_cross_entropy) with -100 targets: on 2 TP ranks, with full or
    vocabulary-sharded logits, the loss and gradients of one process, which are those of the
    targets that count (prompt positions add nothing)."""
    for ranks_results in tp_results:
        result = ranks_results[f"ignore_index,loss_parallel={loss_parallel}"]
        assert result["loss"] < 1e-5 and result["grads"] < 1e-6, result
        assert result["differs_from_unmasked"] > 1e-3, result  # the -100 targets were left out
        assert ranks_results["ignore_index_reference"] < 1e-6
