"""Selective activation checkpointing (``parallel.activation_checkpointing=selective``): what a
block keeps for backward between ``none`` and ``full``, the same gradients, one graph under
``torch.compile``, and the layouts it is refused with.

What a block keeps is measured, not computed from the policy, by the dry run's measure
(``plan.model_stats.kept_bytes``, here on real CPU tensors): every storage an op produces during
the block's forward is tracked by a weak reference, and those still alive once the forward has
returned (and garbage has been collected) are the ones autograd and the checkpoint hold for
backward. Saved-tensor hooks cannot see them all: selective checkpointing caches the outputs it
saves in its own storage.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from sdnet_trainer.config import compose
from sdnet_trainer.distributed.activation_checkpointing import apply_activation_checkpointing
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.llama.model import Llama
from sdnet_trainer.plan.model_stats import kept_bytes
from sdnet_trainer.preflight import validate


def _llama(mode: str) -> Llama:
    torch.manual_seed(0)
    model = Llama(vocab_size=256, seq_len=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    apply_activation_checkpointing(list(model.blocks), mode)
    return model


def test_selective_keeps_less_than_none_and_more_than_full_with_the_same_gradients():
    torch.manual_seed(1)
    x0 = torch.randn(4, 128, 64)
    kept, grads = {}, {}
    for mode in ("none", "full", "selective"):
        block = _llama(mode).blocks[0]
        kept[mode], _ = kept_bytes(block, x0.clone().requires_grad_())
        x = x0.clone().requires_grad_()
        block(x).square().sum().backward()
        grads[mode] = [x.grad, *(p.grad for p in block.parameters())]
    # full keeps nothing but the block's input; selective the matmuls' and attention's outputs.
    assert kept["full"] == 0
    assert 0 < kept["selective"] < 0.7 * kept["none"], kept
    for mode in ("full", "selective"):
        for got, expected in zip(grads[mode], grads["none"], strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.timeout(600)
def test_selective_checkpointing_compiles_into_one_graph_per_block():
    model = _llama("selective")
    plain = _llama("none")
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    tokens = torch.randint(0, 256, (2, 33))
    torch._dynamo.reset()
    counters.clear()
    losses = []
    for m in (model, plain):
        logits = m(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.detach())
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(losses[0], losses[1])
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_every_nth_block_is_checkpointed_and_names_stay():
    four = Llama(vocab_size=256, seq_len=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2)
    names = list(four.state_dict())
    apply_activation_checkpointing(list(four.blocks), "full", every=2)
    kinds = [type(b).__name__ for b in four.blocks]
    assert kinds == ["CheckpointedBlock", "Block", "CheckpointedBlock", "Block"]
    assert list(four.state_dict()) == names
    selective = _llama("selective")
    assert {type(b).__name__ for b in selective.blocks} == {"SelectivelyCheckpointedBlock"}


LLAMA = ["model=llama3_debug", "data=tokens", "data.seq_len=32", "data.vocab_size=256"]


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["parallel.activation_checkpointing=some"], 1, "parallel.activation_checkpointing="),
        (
            [
                "parallel.activation_checkpointing=selective",
                "parallel.activation_checkpointing_every=2",
            ],
            1,
            "parallel.activation_checkpointing_every=2",
        ),
        (
            [
                "parallel.activation_checkpointing=selective",
                "parallel.pp=2",
                "parallel.pipeline.schedule=ZBVZeroBubble",
                "parallel.pipeline.stages_per_rank=2",
            ],
            2,
            "schedule=ZBVZeroBubble",
        ),
    ],
)
def test_bad_checkpointing_is_refused_before_launch(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose([*LLAMA, *overrides]), world_size=world_size)
