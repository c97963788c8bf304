"""Models built on the meta device and initialised after parallelizing (models/init.py) get exactly
the weights a CPU build with the same seed gives, and the Trainer takes that path for its stock
models only. The families draw each parameter from its counter-based stream
(``models/init_values.py``); torchvision's models and modules with ``init_steps()`` replay their
construction's draws."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.distributed import DistEnv
from sdnet_trainer.models import build_model
from sdnet_trainer.models.init import Draw, build_deferred, draw_seed, init_steps, materialize
from tests.support import TINY

MODELS = [
    ["model=gpt_tiny"],
    ["model=gpt_tiny", "model.gpt.dropout=0.1"],
    ["model=llama3_debug"],
    ["model=llama3_debug", "model.llama.tie_embeddings=true"],
    ["model=moe_debug"],
    ["model=simple_cnn", "model.num_classes=10"],
    ["model=resnet18", "model.num_classes=10"],
    # The stem replaced after construction.
    ["model=resnet18", "model.num_classes=10", "model.cifar_stem=true"],
    ["model=resnet18", "model.num_classes=10", "+model.kwargs.zero_init_residual=true"],
]
DECODERS = ["gpt_tiny", "llama3_debug", "moe_debug"]


def _cpu_build(cfg, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(seed)
    model = build_model(cfg)
    return model.state_dict(), torch.get_rng_state()


def _meta_build(cfg, seed: int) -> tuple[nn.Module, list]:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = build_model(cfg)
    steps = init_steps(model)
    assert steps is not None
    return model, steps


@pytest.mark.parametrize("overrides", MODELS, ids=lambda o: "-".join(o).replace("model=", ""))
def test_meta_build_then_init_equals_the_cpu_build(overrides):
    cfg = compose(overrides).model
    expected, rng_after = _cpu_build(cfg, seed=7)
    model, steps = _meta_build(cfg, seed=7)
    model.to_empty(device="cpu")
    torch.manual_seed(7)  # where the trainer puts the generator back for the replayed steps
    materialize(steps)
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():  # parameters and buffers (BatchNorm statistics) alike
        assert torch.equal(state[name], value), name
    # The generator ends where the CPU build leaves it, so what follows (LoRA's adapters) draws
    # the same numbers.
    assert torch.equal(torch.get_rng_state(), rng_after)


@pytest.mark.parametrize("name", DECODERS)
def test_a_decoder_draws_one_seed_at_construction_and_every_parameter_from_it(name):
    """The families' one draw from the CPU generator is the seed, on the CPU and on the meta
    device alike (the layers' own default draws of a CPU build are undone), and every parameter
    has a Draw."""
    cfg = compose([f"model={name}"]).model
    _, rng_after = _cpu_build(cfg, seed=3)
    model, steps = _meta_build(cfg, seed=3)
    assert torch.equal(torch.get_rng_state(), rng_after)
    torch.manual_seed(3)
    draw_seed()
    assert torch.equal(torch.get_rng_state(), rng_after)
    drawn = {step.fn.key for step in steps if isinstance(step.fn, Draw)}
    assert drawn == {key for key, _ in model.named_parameters()}


@pytest.mark.parametrize("name", DECODERS)
def test_a_different_seed_gives_different_weights(name):
    cfg = compose([f"model={name}"]).model
    one, _ = _cpu_build(cfg, seed=7)
    other, _ = _cpu_build(cfg, seed=8)
    assert not torch.equal(one["head.weight"], other["head.weight"])
    # Tensors of one shape draw different streams: their values differ too.
    assert not torch.equal(one["blocks.0.attn.wq.weight"], one["blocks.1.attn.wq.weight"])


def test_tensors_a_pipeline_split_removed_cost_nothing_and_change_nothing():
    """A stage's units get the values of the whole model's build, the pruned units' parameters
    drawing nothing (each value is a function of its own index, not of the draws before it)."""
    cfg = compose(["model=gpt_tiny"]).model
    expected, _ = _cpu_build(cfg, seed=3)
    model, steps = _meta_build(cfg, seed=3)
    model.blocks[0] = None  # type: ignore[index]  # as split_model prunes another stage's units
    model.embed = None  # type: ignore[assignment]
    model.to_empty(device="cpu")
    materialize(steps)  # type: ignore[arg-type]
    state = model.state_dict()
    assert not any(k.startswith(("embed.", "blocks.0.")) for k in state)
    for name, value in state.items():
        assert torch.equal(value, expected[name]), name


def test_build_deferred_falls_back_to_the_cpu_for_models_without_init_steps():
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

    torch.manual_seed(1)
    model, steps = build_deferred(Plain, on_meta=True)
    assert steps is None and not model.fc.weight.is_meta
    torch.manual_seed(1)
    assert torch.equal(model.fc.weight, Plain().fc.weight)  # the meta attempt drew nothing


def test_a_meta_model_without_init_steps_is_refused():
    def build() -> nn.Module:
        with torch.device("meta"):
            return nn.Linear(4, 3)

    with pytest.raises(TypeError, match="init_steps"):
        build_deferred(build, on_meta=False)


def _setup(trainer: Trainer) -> nn.Module:
    trainer.setup()
    try:
        return trainer.model
    finally:
        trainer.close()


GPT_RUN = [
    "model=gpt_tiny",
    "data=tokens",
    "data.train_size=32",
    "data.val_size=8",
    "loop.global_batch_size=8",
]


def test_trainer_builds_its_stock_model_on_meta_with_the_cpu_builds_weights(tmp_path, monkeypatch):
    cfg = compose([*GPT_RUN, "loop.seed=11"])
    allocated: list[nn.Module] = []
    to_empty = nn.Module.to_empty

    def record(self, *, device, recurse=True):
        allocated.append(self)
        return to_empty(self, device=device, recurse=recurse)

    monkeypatch.setattr(nn.Module, "to_empty", record)
    model = _setup(Trainer(cfg, output_dir=tmp_path, env=DistEnv()))
    assert allocated == [model]  # built on the meta device, allocated once
    expected, _ = _cpu_build(cfg.model, seed=11)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_an_overridden_build_model_keeps_its_cpu_weights(tmp_path):
    """A subclass's build_model may load values (here: fills), so it runs as is, on the CPU."""

    class Loaded(Trainer):
        def build_model(self) -> nn.Module:
            model = super().build_model()
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(0.5)
            return model

    model = _setup(Loaded(compose(TINY), output_dir=tmp_path, env=DistEnv()))
    assert all(bool((p == 0.5).all()) for p in model.parameters())


def test_an_override_may_return_a_meta_model_with_init_steps(tmp_path):
    class OnMeta(Trainer):
        def build_model(self) -> nn.Module:
            with torch.device("meta"):
                return super().build_model()

    cfg = compose([*TINY, "loop.seed=5"])
    model = _setup(OnMeta(cfg, output_dir=tmp_path, env=DistEnv()))  # sets model.num_classes
    expected, _ = _cpu_build(cfg.model, seed=5)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
