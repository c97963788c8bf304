"""The GPT decoder: shapes, pipeline units, causality, sizes, the registry path, and that it learns.

Tensor parallelism is checked against this single-process model in
tests/distributed/test_gpt_tp.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sdnet_trainer.config import ModelConfig, compose
from sdnet_trainer.config.schema import GPTConfig
from sdnet_trainer.data import build_datasets
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models import GPT, available_models, build_model

TINY = dict(vocab_size=50, seq_len=16, dim=32, n_layers=3, n_heads=4)


def _tiny(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(**{**TINY, **overrides}).eval()


def _tokens(batch: int, length: int, *, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed)
    )


def test_logits_shape_for_full_and_shorter_sequences():
    model = _tiny()
    for length in (TINY["seq_len"], 5, 1):
        logits = model(_tokens(3, length))
        assert logits.shape == (3, length, TINY["vocab_size"]) and logits.dtype == torch.float32


def test_children_and_pipeline_units_compose_to_forward_exactly():
    model = _tiny()
    assert [name for name, _ in model.named_children()] == ["embed", "blocks", "norm", "head"]
    assert model.pipeline_units() == ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
    assert model.parallel_blocks() == list(model.blocks)
    tokens = _tokens(2, 11)
    x = tokens
    for name in model.pipeline_units():
        x = model.get_submodule(name)(x)
    assert torch.equal(x, model(tokens))


def test_changing_a_later_token_never_changes_earlier_logits():
    model = _tiny()
    tokens = _tokens(2, TINY["seq_len"])
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % TINY["vocab_size"]
    before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :9], after[:, :9])
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def test_same_seed_same_model_and_head_is_not_tied():
    a, b, c = _tiny(0), _tiny(0), _tiny(1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.head.weight, c.head.weight)
    assert a.head.weight.data_ptr() != a.embed.tok.weight.data_ptr()
    assert a.head.bias is None and a.head.weight.shape == (TINY["vocab_size"], TINY["dim"])
    # Residual projections start smaller than the rest (GPT-2's depth scaling).
    assert a.blocks[0].attn.wo.weight.std() < 0.6 * a.blocks[0].attn.wq.weight.std()


def test_bad_sizes_name_the_keys_and_numbers():
    with pytest.raises(ConfigError, match=r"model\.gpt\.dim=30 .*model\.gpt\.n_heads=4"):
        GPT(vocab_size=10, seq_len=8, dim=30, n_layers=1, n_heads=4)
    with pytest.raises(ConfigError, match=r"model\.gpt\.n_layers=0"):
        GPT(vocab_size=10, seq_len=8, dim=32, n_layers=0, n_heads=4)


def test_sequence_longer_than_the_context_or_uneven_for_sequence_parallel_is_a_config_error():
    model = _tiny()
    with pytest.raises(ConfigError, match=r"17 tokens.*model\.gpt\.seq_len=16"):
        model(_tokens(1, 17))
    model.embed.sequence_shards = (
        2  # as tensor parallelism with sequence parallel over 2 ranks sets it
    )
    with pytest.raises(ConfigError, match=r"parallel\.tp=2 .*7 tokens"):
        model(_tokens(1, 7))


class _Mesh:
    """Just enough of a DeviceMesh for the checks that run before any sharding."""

    def size(self) -> int:
        return 2


def test_tensor_parallel_checks_heads_mlp_sequence_and_dropout():
    model = GPT(vocab_size=10, seq_len=8, dim=24, n_layers=1, n_heads=3)
    with pytest.raises(ConfigError, match=r"model\.gpt\.n_heads=3 .*parallel\.tp=2"):
        model.apply_tensor_parallel(_Mesh(), loss_parallel=False, sequence_parallel=False)
    model = GPT(vocab_size=10, seq_len=8, dim=24, n_layers=1, n_heads=4, mlp_ratio=1.5 + 1 / 24)
    with pytest.raises(
        ConfigError, match=r"model\.gpt\.mlp_ratio=1\.54.* = 37 MLP channels .*parallel\.tp=2"
    ):
        model.apply_tensor_parallel(_Mesh(), loss_parallel=False, sequence_parallel=False)
    model = GPT(vocab_size=10, seq_len=9, dim=24, n_layers=1, n_heads=4)
    with pytest.raises(ConfigError, match=r"model\.gpt\.seq_len=9 .*parallel\.tp=2"):
        model.apply_tensor_parallel(_Mesh(), loss_parallel=False, sequence_parallel=True)
    # Dropout on the replicated residual stream would differ between ranks; under sequence
    # parallel each rank drops only in its own slice.
    model = GPT(vocab_size=10, seq_len=8, dim=24, n_layers=1, n_heads=4, dropout=0.1)
    with pytest.raises(
        ConfigError, match=r"model\.gpt\.dropout=0\.1 with parallel\.tp=2 .*sequence_parallel"
    ):
        model.apply_tensor_parallel(_Mesh(), loss_parallel=False, sequence_parallel=False)


def test_gpt_1b_config_has_about_a_billion_parameters():
    cfg = compose(["model=gpt_1b"]).model
    with torch.device("meta"):
        model = build_model(cfg)
    count = sum(p.numel() for p in model.parameters())
    assert 0.9e9 <= count <= 1.3e9, count


def test_registry_builds_gpt_from_model_gpt_with_kwargs_overrides():
    assert "gpt" in available_models()
    cfg = ModelConfig(name="gpt", gpt=GPTConfig(**TINY), kwargs={"n_layers": 1, "dropout": 0.1})
    model = build_model(cfg)
    assert isinstance(model, GPT) and len(model.blocks) == 1 and model.embed.drop.p == 0.1
    assert model.head.out_features == TINY["vocab_size"]
    with pytest.raises(ConfigError, match=r"model\.kwargs.*'width'"):
        build_model(ModelConfig(name="gpt", kwargs={"width": 8}))
    with pytest.raises(ConfigError, match=r"model\.weights"):
        build_model(ModelConfig(name="gpt", weights="IMAGENET1K_V1"))


def test_gpt_tiny_learns_the_synthetic_token_language():
    cfg = compose(["model=gpt_tiny", "data=tokens", "data.train_size=1024", "data.val_size=128"])
    vocab = cfg.model.gpt.vocab_size
    torch.manual_seed(0)
    model = build_model(cfg.model)
    train, val = build_datasets(cfg.data)
    train_x, train_y = (torch.stack(t) for t in zip(*(train[i] for i in range(len(train)))))
    val_x, val_y = (torch.stack(t) for t in zip(*(val[i] for i in range(len(val)))))

    def val_loss() -> float:
        with torch.no_grad():
            return F.cross_entropy(model(val_x).flatten(0, 1), val_y.flatten()).item()

    assert val_loss() == pytest.approx(math.log(vocab), rel=0.05)  # a fresh model guesses uniformly
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = torch.Generator().manual_seed(0)
    for _ in range(80):
        index = torch.randint(len(train_x), (16,), generator=batches)
        loss = F.cross_entropy(model(train_x[index]).flatten(0, 1), train_y[index].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # The chain's entropy is ~1.2 nats; uniform guessing costs log(64) = 4.16.
    assert val_loss() < 0.5 * math.log(vocab)
