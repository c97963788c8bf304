"""Compute options applied by parallelize(): activation checkpointing, compile, channels_last.

Each is checked against the plain model: the same loss and the same gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sdnet_trainer.config import compose
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.distributed.mesh import ParallelDims
from sdnet_trainer.distributed.parallelize import parallelize
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models import build_model

RESNET = ["model=resnet18", "model.cifar_stem=true", "model.num_classes=10"]
GPT = ["model=gpt_tiny", "data=tokens"]


def _loss_and_grads(model, batch):
    inputs, targets = batch
    logits = model(inputs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _pair(overrides):
    torch.manual_seed(0)
    cfg = compose(overrides)
    plain = build_model(cfg.model)
    changed = parallelize(copy.deepcopy(plain), cfg, DistEnv(), None, ParallelDims()).model
    return plain, changed


def _batch(overrides):
    torch.manual_seed(1)
    if "data=tokens" in overrides:
        tokens = torch.randint(0, 64, (4, 33))
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))


CHECKPOINTING = {
    "full": ["parallel.activation_checkpointing=full"],
    "every_2nd": [
        "parallel.activation_checkpointing=full",
        "parallel.activation_checkpointing_every=2",
    ],
    "selective": ["parallel.activation_checkpointing=selective"],
}


@pytest.mark.parametrize(
    "family, mode",
    [
        (RESNET, "full"),
        (RESNET, "selective"),
        (GPT, "full"),
        (GPT, "every_2nd"),
        (GPT, "selective"),
    ],
)
def test_activation_checkpointing_gives_the_same_gradients(family, mode):
    overrides = family + CHECKPOINTING[mode]
    plain, checkpointed = _pair(overrides)
    batch = _batch(overrides)
    loss, grads = _loss_and_grads(plain, batch)
    loss_ac, grads_ac = _loss_and_grads(checkpointed, batch)
    torch.testing.assert_close(loss_ac, loss)
    assert grads_ac.keys() == grads.keys()  # names unchanged: checkpoints stay interchangeable
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ac[name], grad, msg=name)


def test_activation_checkpointing_recomputes_in_backward():
    _, checkpointed = _pair(RESNET + ["parallel.activation_checkpointing=full"])
    block = checkpointed.layer1[0]
    calls = []
    block.conv1.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    _loss_and_grads(checkpointed, _batch(RESNET))
    assert len(calls) == 2  # forward, then the recomputation during backward


def test_channels_last_keeps_the_math():
    overrides = RESNET + ["model.channels_last=true"]
    plain, nhwc = _pair(overrides)
    assert nhwc.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    batch = _batch(overrides)
    inputs = batch[0].to(memory_format=torch.channels_last)
    loss, grads = _loss_and_grads(plain, batch)
    loss_cl, grads_cl = _loss_and_grads(nhwc, (inputs, batch[1]))
    torch.testing.assert_close(loss_cl, loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads_cl["fc.weight"], grads["fc.weight"], rtol=1e-4, atol=1e-5)


def test_compile_per_block_gives_the_eager_loss():
    # aot_eager runs dynamo and AOTAutograd without generating C++ (fast, no compiler needed).
    overrides = GPT + ["compile.enabled=true", "compile.backend=aot_eager"]
    plain, compiled = _pair(overrides)
    batch = _batch(overrides)
    loss, grads = _loss_and_grads(plain, batch)
    loss_c, grads_c = _loss_and_grads(compiled, batch)
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_activation_checkpointing_needs_blocks():
    with pytest.raises(ConfigError, match="has no blocks to checkpoint"):
        _pair(
            ["model=simple_cnn", "model.num_classes=10", "parallel.activation_checkpointing=full"]
        )
