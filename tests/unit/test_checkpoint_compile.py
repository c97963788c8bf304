"""Activation checkpointing under ``torch.compile`` (per block, as parallelize applies them: the
checkpoint first, then ``Module.compile``): the checkpoint is traced into the block's graph, with
no graph break, and it still keeps activations out of memory.

The composable ``checkpoint`` (forward hooks) broke every block's graph there: dynamo refuses to
trace its hooks, so ``compile.fullgraph=true`` failed and each block compiled around a break.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from sdnet_trainer.config import compose
from sdnet_trainer.distributed.activation_checkpointing import checkpoint_block
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.distributed.mesh import ParallelDims
from sdnet_trainer.distributed.parallelize import parallelize
from sdnet_trainer.models import build_model
from sdnet_trainer.plan import saved_for_backward

# aot_eager: dynamo and AOTAutograd (the partitioner that honours the checkpoint) without
# generating code. fullgraph: a graph break is an error, not a silent split.
GPT = ["model=gpt_tiny", "data=tokens", "compile.backend=aot_eager", "compile.fullgraph=true"]


def _build(overrides: list[str], plain: torch.nn.Module | None = None) -> torch.nn.Module:
    cfg = compose(overrides)
    model = copy.deepcopy(plain) if plain is not None else build_model(cfg.model)
    return parallelize(model, cfg, DistEnv(), None, ParallelDims()).model


def _saved_bytes_and_grads(model: torch.nn.Module, tokens: torch.Tensor):
    """Bytes autograd keeps for backward over one forward, and the gradients."""
    saved, logits = saved_for_backward(lambda: model(tokens[:, :-1]))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return saved, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(600)
def test_checkpointed_blocks_compile_whole_and_keep_activations_out_of_memory():
    torch.manual_seed(0)
    plain = build_model(compose(GPT).model)
    tokens = torch.randint(0, 64, (8, 33))
    torch._dynamo.reset()
    counters.clear()
    checkpointed = _build(
        [*GPT, "compile.enabled=true", "parallel.activation_checkpointing=full"], plain
    )
    saved_ac, loss_ac, grads_ac = _saved_bytes_and_grads(checkpointed, tokens)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert (
        counters["stats"]["unique_graphs"] >= 1
    )  # the blocks did compile (identical blocks share it)

    torch._dynamo.reset()
    compiled = _build([*GPT, "compile.enabled=true"], plain)
    saved, loss, grads = _saved_bytes_and_grads(compiled, tokens)
    # The blocks' activations are recomputed in backward rather than kept: what remains is each
    # block's input, the parameters and what lies outside the blocks.
    assert saved_ac < 0.6 * saved, (saved_ac, saved)

    eager_saved, eager_loss, eager_grads = _saved_bytes_and_grads(copy.deepcopy(plain), tokens)
    assert eager_saved > 0
    for name in eager_grads:
        torch.testing.assert_close(grads_ac[name], eager_grads[name], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss_ac, eager_loss)
    torch.testing.assert_close(loss, eager_loss)
    assert grads_ac.keys() == eager_grads.keys()  # names unchanged: checkpoints interchangeable


def test_a_checkpointed_block_keeps_its_names_and_its_copies_recompute_themselves():
    block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    names = list(block.state_dict())
    checkpoint_block(block)
    checkpoint_block(block)  # twice is once: no checkpoint inside a checkpoint
    assert isinstance(block, torch.nn.Sequential) and list(block.state_dict()) == names
    assert sum(c.__name__.startswith("Checkpointed") for c in type(block).__mro__) == 1
    copied = copy.deepcopy(block)
    calls = {"original": 0, "copy": 0}
    block[0].register_forward_hook(lambda *_: calls.__setitem__("original", calls["original"] + 1))
    copied[0].register_forward_hook(lambda *_: calls.__setitem__("copy", calls["copy"] + 1))
    copied(torch.randn(2, 4, requires_grad=True)).sum().backward()
    # The copy ran its own forward, then recomputed it in backward; the original never ran.
    assert calls == {"original": 0, "copy": 2}
    assert all(p.grad is not None for p in copied.parameters())
