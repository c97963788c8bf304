"""precision.float8 (torchao's float8 training) on the CPU, where torchao runs the float8 casts and
matmuls without float8 hardware: which layers convert, the loss curve against bf16, checkpoints
and exports without float8 in them, FSDP2's float8 all-gather on a one-rank group, the tensor-
parallel styles, and every refusal. FSDP2 on 2 processes against one: tests/distributed/
test_layouts.py (llama_fsdp_float8); on a GPU: tests/cuda/test_float8_cuda.py."""

from __future__ import annotations

import copy
import logging
import sys

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.distributed.float8 import (
    convert_float8,
    float8_eligible,
    validate_float8,
)
from sdnet_trainer.distributed.mesh import ParallelDims
from sdnet_trainer.distributed.parallelize import parallelize
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export.cli import main as export_main
from sdnet_trainer.models import build_model
from sdnet_trainer.models.decoder import tensor_parallel_styles
from sdnet_trainer.preflight import validate
from tests.support import CPU, REPO

float8 = pytest.importorskip("torchao.float8", reason="the float8 extra (torchao) is not installed")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402  (after the skip)
from torchao.float8.float8_tensor_parallel import (  # noqa: E402
    Float8ColwiseParallel,
    Float8RowwiseParallel,
)
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

# llama3_debug: width 64, 4 query heads over 2 key/value heads (16 channels each), MLP 176 wide:
# every projection's sizes are multiples of 16; the output layer (64 -> 256) is left alone.
LLAMA = [
    *CPU,
    "model=llama3_debug",
    "data=tokens",
    "data.seq_len=32",
    "data.vocab_size=256",
    "data.train_size=512",
    "data.val_size=16",
    "optim=adamw",
    "optim.lr=3e-3",
    "sched=constant",
    "loop.global_batch_size=8",
    "loop.eval_at_end=false",
    "loop.eval_at_epoch_end=false",
    "logging.trackers=[]",
    "logging.flops=false",
]
CURVE = [*LLAMA, "precision=bf16", "loop.max_steps=50", "checkpoint.save_on_exit=true"]
STEPS = 50
PROJECTIONS = (
    "attn.wq",
    "attn.wk",
    "attn.wv",
    "attn.wo",
    "mlp.w1",
    "mlp.w3",
    "mlp.w2",
)  # model order


class LossRecorder(Trainer):
    def setup(self) -> None:
        super().setup()
        self.losses: list[float] = []

    def train_step(self):
        out = super().train_step()
        self.losses.append(out.loss.item())
        return out


def _train(run_dir, overrides, env=None) -> LossRecorder:
    trainer = LossRecorder(compose(overrides), output_dir=run_dir, env=env)
    try:
        trainer.fit()
        trainer.built = trainer.model  # close() lets go of the model
    finally:
        trainer.close()
    return trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, LossRecorder]:
    """50 steps of llama3_debug in bf16, and with each float8 recipe (bf16 besides), each saved."""
    out = tmp_path_factory.mktemp("float8_runs")
    recipes = {"bf16": [], "rowwise": ["precision.float8=rowwise"]}
    recipes["tensorwise"] = ["precision.float8=tensorwise"]
    return {name: _train(out / name, [*CURVE, *extra]) for name, extra in recipes.items()}


# ---------------------------------------------------------------------- training


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_trains_a_llama_within_2_percent_of_bf16(runs, recipe):
    """Through the Trainer: built on the meta device, converted, then initialised (a float8 layer
    left out of the init steps would start from uninitialised memory, NaN at the first step)."""
    run, bf16 = runs[recipe], runs["bf16"]
    converted = {n for n, m in run.built.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {f"blocks.{i}.{p}" for i in range(2) for p in PROJECTIONS}
    assert len(run.losses) == len(bf16.losses) == STEPS
    assert run.losses[-1] < 0.5 * run.losses[0]  # it learned (5.55 -> about 2.2)
    gaps = [abs(f8 - ref) / ref for f8, ref in zip(run.losses, bf16.losses, strict=True)]
    assert max(gaps) < 0.02, gaps
    assert run.losses != bf16.losses  # float8 matmuls ran: not the bf16 curve itself


def test_a_float8_checkpoint_holds_the_plain_models_weights(runs, tmp_path):
    """The same names and fp32 tensors as a run without float8 (the checkpoint's metadata), and
    the export is the plain model's state dict, which a Llama without float8 loads."""

    def saved(name: str) -> dict:
        step = runs[name].output_dir / "checkpoints" / f"step_{STEPS:08d}"
        return FileSystemReader(str(step)).read_metadata().state_dict_metadata

    plain, with_float8 = saved("bf16"), saved("rowwise")
    assert plain.keys() == with_float8.keys()
    weights = [k for k in plain if k.startswith("model.") and k.endswith(".weight")]
    assert "model.blocks.0.attn.wq.weight" in weights
    for key in weights:
        assert with_float8[key].properties.dtype == torch.float32, key
        assert with_float8[key].size == plain[key].size, key

    step = runs["rowwise"].output_dir / "checkpoints" / f"step_{STEPS:08d}"
    assert export_main([f"checkpoint={step}", "format=pt", f"out={tmp_path}"]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    bare = build_model(compose(CURVE).model)
    assert exported.keys() == bare.state_dict().keys()
    assert {v.dtype for v in exported.values()} == {torch.float32}
    bare.load_state_dict(exported)
    trained = runs["rowwise"].built.state_dict()
    torch.testing.assert_close(
        exported["blocks.1.mlp.w2.weight"], trained["blocks.1.mlp.w2.weight"]
    )


# ---------------------------------------------------------------------- which layers


class _Mixed(nn.Module):
    """Two eligible layers, one of odd sizes (40 -> 24) and the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 48), nn.GELU())
        self.odd = nn.Linear(40, 24)
        self.head = nn.Linear(48, 32)


class _WithOutputEmbeddings(nn.Module):
    """A transformers-style model: the output layer is whatever get_output_embeddings says."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.logits = nn.Linear(32, 64)

    def get_output_embeddings(self) -> nn.Module:
        return self.logits


class _Wrapper(nn.Module):  # as HFCausalLM holds its transformers model in ``lm``
    def __init__(self) -> None:
        super().__init__()
        self.lm = _WithOutputEmbeddings()


def test_the_filter_leaves_the_head_and_odd_sizes_alone_and_says_so(caplog):
    cfg = compose(["precision.float8=rowwise"])
    with torch.device("meta"):  # as the Trainer builds it
        model = _Mixed()
    assert float8_eligible(model) == ["proj", "mlp.0"]
    assert float8_eligible(_Wrapper()) == ["lm.body"]
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.distributed.float8"):
        convert_float8(model, cfg, fsdp=False)
    assert {n for n, m in model.named_modules() if isinstance(m, Float8Linear)} == {"proj", "mlp.0"}
    # The same module objects (the Trainer's init steps name them) and parameters, by name.
    assert dict(model.named_modules()) == modules
    assert dict(model.named_parameters()) == params
    assert model.proj.weight.is_meta
    message = caplog.records[-1].getMessage()
    assert "2 Linear layers compute in float8" in message
    assert "odd (40 -> 24: not multiples of 16)" in message
    assert "head (the output layer)" in message


def test_llama_converts_every_projection_and_keeps_its_weights(tmp_path):
    """Through parallelize() on a one-process run: the model computes as before up to float8
    rounding, under the same parameter names."""
    cfg = compose([*LLAMA, "precision.float8=tensorwise"])
    torch.manual_seed(0)
    plain = build_model(cfg.model)
    converted = parallelize(copy.deepcopy(plain), cfg, DistEnv(), None, ParallelDims()).model
    assert float8_eligible(plain) == [f"blocks.{i}.{p}" for i in range(2) for p in PROJECTIONS]
    assert type(converted.head) is nn.Linear
    assert converted.state_dict().keys() == plain.state_dict().keys()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = plain(tokens), converted(tokens)
    assert not torch.equal(got, expected)
    torch.testing.assert_close(got, expected, rtol=0, atol=0.05 * expected.abs().max().item())
    # Float8 matmuls, as the profiler records them: 3 per projection (output, input and weight
    # gradients), 2 x 7 projections.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        converted(tokens).square().mean().backward()
    assert [e.name for e in profile.events()].count("aten::_scaled_mm") == 3 * 14


# ---------------------------------------------------------------------- refused


def test_float8_without_torchao_names_the_key_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    cfg = compose([*LLAMA, "precision.float8=rowwise"])
    with pytest.raises(ConfigError, match=r"precision\.float8=rowwise .*sdnet_trainer\[float8\]"):
        validate(cfg, world_size=1)


def test_an_unknown_recipe_is_refused():
    cfg = compose([*LLAMA, "precision.float8=blockwise"])
    with pytest.raises(ConfigError, match="precision.float8='blockwise' is not one of rowwise"):
        validate(cfg, world_size=1)


def test_float8_with_fp16_is_refused():
    cfg = compose([*LLAMA, "precision=fp16", "precision.float8=tensorwise"])
    with pytest.raises(
        ConfigError, match=r"precision\.float8=tensorwise with precision\.dtype=fp16"
    ):
        validate(cfg, world_size=1)


@pytest.mark.parametrize(
    "model",
    [
        ["model=simple_cnn", "model.num_classes=10"],  # one Linear: its output layer
        # Odd sizes: width 40 (heads of 20 channels), MLP 72.
        ["model=llama3_debug", "model.llama.dim=40", "model.llama.hidden_dim=72"],
    ],
)
def test_a_model_without_an_eligible_layer_is_refused(model):
    """Before launch, from a build on the meta device, and by the conversion itself (a model a
    Trainer subclass builds is seen only then)."""
    cfg = compose([*model, "precision.float8=rowwise"])
    message = rf"precision\.float8=rowwise: model\.name='{cfg.model.name}' has no Linear"
    with pytest.raises(ConfigError, match=message):
        validate_float8(cfg)
    with pytest.raises(ConfigError, match=message):
        parallelize(build_model(cfg.model), cfg, DistEnv(), None, ParallelDims())


def _gpu(monkeypatch, name: str, capability: tuple[int, int]) -> None:
    """This process sees one GPU of ``capability`` (the CPU tests hide the real ones)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_a_gpu_without_float8_tensor_cores_is_refused_before_launch(monkeypatch):
    _gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    cfg = compose([*LLAMA, "dist.device=cuda", "precision=bf16", "precision.float8=rowwise"])
    with pytest.raises(ConfigError, match=r"NVIDIA A100-SXM4-80GB has compute capability 8\.0"):
        validate_float8(cfg)
    _gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    validate_float8(cfg)
    # The float8 kernels take a micro-batch's tokens in multiples of 16 (the CPU does not care).
    odd = compose([*LLAMA, "dist.device=cuda", "data.seq_len=33", "precision.float8=rowwise"])
    with pytest.raises(ConfigError, match=r"data\.seq_len=33 / parallel\.cp=1 = 33 tokens"):
        validate_float8(odd)
    validate_float8(odd, device="cpu")


def test_tensorwise_tp_with_sequence_parallel_is_refused_on_gloo():
    """torchao's float8 TP styles gather float8 output gradients along the sequence, which gloo
    cannot send (measured: "Invalid scalar type"); rowwise, or tensorwise without sequence
    parallel, trains under TP on gloo."""
    sp = ["parallel.tp=2", "parallel.tensor_parallel.sequence_parallel=true"]
    cfg = compose([*LLAMA, *sp, "precision.float8=tensorwise"])
    with pytest.raises(ConfigError, match="sequence_parallel=true gathers float8 tensors"):
        validate(cfg, world_size=2)
    validate(compose([*LLAMA, *sp, "precision.float8=rowwise"]), world_size=2)
    validate(compose([*LLAMA, "parallel.tp=2", "precision.float8=tensorwise"]), world_size=2)


# ---------------------------------------------------------------------- FSDP2 and TP styles


def test_tensorwise_fsdp_gathers_float8_weights_and_refreshes_their_scales(tmp_path, one_rank):
    """FSDP2 on a one-rank group: the weights are torchao's float8-casting tensors, whose scales
    are computed after every optimizer step; the run trains as the bare float8 model does. With
    model.ema the all-gather stays in the run's precision."""
    run = [*LLAMA, "precision=fp32", "precision.float8=tensorwise", "loop.max_steps=4"]
    bare = _train(tmp_path / "bare", run)
    sharded = _train(tmp_path / "fsdp", [*run, "parallel=fsdp"], env=one_rank)
    assert isinstance(sharded.built, FSDPModule)
    wq = sharded.built.blocks[0].attn.wq
    assert isinstance(wq, Float8Linear) and isinstance(wq.weight, DTensor)
    local = wq.weight._local_tensor  # to_local() would give a fresh alias, without the scale
    assert isinstance(local, WeightWithDynamicFloat8CastTensor)
    assert local._precomputed_scale is not None  # refresh_float8_scales after the last step
    torch.testing.assert_close(sharded.losses, bare.losses, rtol=1e-5, atol=1e-6)

    ema = _train(tmp_path / "ema", [*run, "parallel=fsdp", "model.ema.enabled=true"], env=one_rank)
    weight = ema.built.blocks[0].attn.wq.weight
    assert not isinstance(weight.to_local(), WeightWithDynamicFloat8CastTensor)
    torch.testing.assert_close(ema.losses, bare.losses, rtol=1e-5, atol=1e-6)


def test_tp_styles_follow_the_recipe(one_rank):
    """Tensorwise layers take torchao's float8 styles, rowwise and plain ones torch's; a
    tensorwise Llama under its TP plan (a one-rank mesh) computes what it computes unsharded."""
    assert tensor_parallel_styles(nn.Linear(16, 16)) == (ColwiseParallel, RowwiseParallel)
    picked = {}
    for recipe in ("rowwise", "tensorwise"):
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
        float8.convert_to_float8_training(model, config=config)
        picked[recipe] = tensor_parallel_styles(model[0])
    assert picked == {
        "rowwise": (ColwiseParallel, RowwiseParallel),
        "tensorwise": (Float8ColwiseParallel, Float8RowwiseParallel),
    }

    cfg = compose([*LLAMA, "precision.float8=tensorwise"])
    torch.manual_seed(0)
    model = parallelize(build_model(cfg.model), cfg, DistEnv(), None, ParallelDims()).model
    sharded = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    sharded.apply_tensor_parallel(mesh, loss_parallel=False, sequence_parallel=False)
    assert isinstance(sharded.blocks[0].attn.wq.weight, DTensor)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    for m in (model, sharded):
        m(tokens).float().square().mean().backward()
    torch.testing.assert_close(sharded(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    grad = sharded.blocks[1].mlp.w2.weight.grad
    torch.testing.assert_close(grad.full_tensor(), model.blocks[1].mlp.w2.weight.grad)


# ---------------------------------------------------------------------- imports


# ---------------------------------------------------------------------- the GPU check's row


def test_the_gpu_checks_float8_launch_passes_preflight_and_makes_its_row(monkeypatch, tmp_path):
    """scripts/bench/bench_gpu.py's llama3_1b section launches again with precision.float8=
    rowwise: a config the preflight accepts on an H100 and refuses on an A100; the GPU check's
    table gives its tokens/s beside the bf16 launch's."""
    import argparse
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "scripts" / "bench"))
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "ci"))
    bench_gpu = importlib.import_module("bench_gpu")
    summary = importlib.import_module("gpu_check_summary")
    llama = next(dec for dec in bench_gpu.DECODERS if dec.float8 is not None)
    args = argparse.Namespace(llama_batch=8, llama_micro=4, llama_steps=10, llama_compile=False)
    run = bench_gpu.DecoderRun.from_args(args, llama)
    keys = bench_gpu.decoder_keys(run, tmp_path, float8=llama.float8)
    cfg = compose([key for key in keys if not key.startswith("hydra.")])
    assert (cfg.model.name, cfg.precision.dtype, cfg.precision.float8) == (
        "llama",
        "bf16",
        "rowwise",
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    _gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    validate(cfg, world_size=1)
    _gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    with pytest.raises(ConfigError, match="compute capability 8.0"):
        validate(cfg, world_size=1)

    bf16 = {"tokens_per_s": 30000.0, "mfu": 0.4, "tflops_per_s": 396.0, "compiled": True}
    float8_cell = {"recipe": "rowwise", "name": "llama3_1b float8 rowwise", "tokens_per_s": 36000.0}
    figures = {
        "decoders": ["llama3_1b"],
        "llama3_1b": {**bf16, "float8": {**float8_cell, "speedup": 1.2}},
    }
    rows = dict(summary.bench_rows(figures))
    assert rows["llama3_1b float8 rowwise tokens/s"] == "36,000 (1.20x bf16)"
    figures["llama3_1b"]["float8"] = {**float8_cell, "failed": "not run: torchao is not installed"}
    rows = dict(summary.bench_rows(figures))
    assert rows["llama3_1b float8 rowwise tokens/s"] == "not run: torchao is not installed"
