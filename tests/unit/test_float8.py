"""precision.float8 (torchao's float8 training) on the CPU, where torchao runs the float8 casts and
matmuls without float8 hardware: which layers convert (the MoE's router never), the loss curve
against bf16, checkpoints and exports without float8 in them, FSDP2's float8 all-gather on a
one-rank group, the tensor-parallel styles, and every refusal. FSDP2 on 2 processes against one:
tests/distributed/test_layouts.py (llama_fsdp_float8, and moe_fsdp_float8: tensorwise with the
float8 all-gather, the routers left plain); on a GPU: tests/cuda/test_float8_cuda.py.

What computes in float8 here is the CPU's torch._scaled_mm, which not every torch offers for
both recipes (torch 2.11's takes per-tensor scales only, so rowwise fails there): one tiny
product per recipe, made once (tests/float8_cpu.py), says which; a test that needs the other is
skipped, naming it."""

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
from tests.float8_cpu import scaled_mm_refusal
from tests.support import CPU, REPO

float8 = pytest.importorskip("torchao.float8", reason="the float8 extra (torchao) is not installed")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402  (after the skip)
from torchao.float8.float8_tensor_parallel import (  # noqa: E402
    Float8ColwiseParallel,
    Float8RowwiseParallel,
)
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

SCALED_MM_REFUSALS = {recipe: scaled_mm_refusal(recipe) for recipe in ("rowwise", "tensorwise")}


def needs_scaled_mm(recipe: str) -> pytest.MarkDecorator:
    """Skip where the CPU cannot compute ``recipe``'s float8 matmuls (the reason names why)."""
    refusal = SCALED_MM_REFUSALS[recipe]
    return pytest.mark.skipif(refusal is not None, reason=refusal or "")


def recipes() -> list:
    """rowwise and tensorwise, each skipped where the CPU cannot compute its matmuls."""
    return [pytest.param(r, marks=needs_scaled_mm(r)) for r in ("rowwise", "tensorwise")]


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


class _Runs(dict):
    """50 steps of llama3_debug in bf16 (``runs["bf16"]``) and with each float8 recipe (bf16
    besides), each saved; each trained when a test first asks for it, so a recipe this CPU
    cannot compute is never trained."""

    def __init__(self, out) -> None:
        super().__init__()
        self.out = out

    def __missing__(self, name: str) -> LossRecorder:
        extra = [] if name == "bf16" else [f"precision.float8={name}"]
        self[name] = _train(self.out / name, [*CURVE, *extra])
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("float8_runs"))


# ---------------------------------------------------------------------- training


@pytest.mark.parametrize("recipe", recipes())
def test_float8_trains_a_llama_within_2_percent_of_bf16(runs, recipe):
    """Through the Trainer: built on the meta device, converted, then initialised (a float8 layer
    left out of the init steps would start from uninitialised memory, NaN at the first step)."""
    bf16, run = runs["bf16"], runs[recipe]
    converted = {n for n, m in run.built.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {f"blocks.{i}.{p}" for i in range(2) for p in PROJECTIONS}
    assert len(run.losses) == len(bf16.losses) == STEPS
    assert run.losses[-1] < 0.5 * run.losses[0]  # it learned (5.55 -> about 2.2)
    gaps = [abs(f8 - ref) / ref for f8, ref in zip(run.losses, bf16.losses, strict=True)]
    assert max(gaps) < 0.02, gaps
    assert run.losses != bf16.losses  # float8 matmuls ran: not the bf16 curve itself


@pytest.mark.parametrize("recipe", recipes())
def test_a_float8_checkpoint_holds_the_plain_models_weights(runs, recipe, tmp_path):
    """The same names and fp32 tensors as a run without float8 (the checkpoint's metadata), and
    the export is the plain model's state dict, which a Llama without float8 loads."""

    def saved(name: str) -> dict:
        step = runs[name].output_dir / "checkpoints" / f"step_{STEPS:08d}"
        return FileSystemReader(str(step)).read_metadata().state_dict_metadata

    plain, with_float8 = saved("bf16"), saved(recipe)
    assert plain.keys() == with_float8.keys()
    weights = [k for k in plain if k.startswith("model.") and k.endswith(".weight")]
    assert "model.blocks.0.attn.wq.weight" in weights
    for key in weights:
        assert with_float8[key].properties.dtype == torch.float32, key
        assert with_float8[key].size == plain[key].size, key

    step = runs[recipe].output_dir / "checkpoints" / f"step_{STEPS:08d}"
    assert export_main([f"checkpoint={step}", "format=pt", f"out={tmp_path}"]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    bare = build_model(compose(CURVE).model)
    assert exported.keys() == bare.state_dict().keys()
    assert {v.dtype for v in exported.values()} == {torch.float32}
    bare.load_state_dict(exported)
    trained = runs[recipe].built.state_dict()
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
    assert "2 of 4 Linear layers compute in float8 (torchao Float8Linear): proj, mlp.0;" in message
    assert "odd (40 -> 24: not multiples of 16)" in message
    assert "head (the output layer)" in message


@needs_scaled_mm("tensorwise")
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


# moe_debug with 16 experts: each router (64 -> 16) has float8's sizes, as the attention does; its
# experts are stacked 3-D parameters, not Linear layers.
MOE16 = ["model=moe_debug", "model.moe.num_experts=16"]
ATTENTION = ("attn.wq", "attn.wk", "attn.wv", "attn.wo")


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_the_moe_router_stays_in_high_precision_and_the_log_says_so(caplog, recipe):
    """The MoE layer keeps its router out of float8 (it routes in float32 from the weight itself);
    under FSDP's float8 all-gather (tensorwise) the attention's weights become float8-casting
    tensors and the routers' stay plain parameters. Nothing here computes: a meta build."""
    cfg = compose([*MOE16, f"precision.float8={recipe}"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    attention = [f"blocks.{i}.{p}" for i in range(2) for p in ATTENTION]
    assert float8_eligible(model) == attention
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.distributed.float8"):
        convert_float8(model, cfg, fsdp=True)
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == set(attention)
    for block in model.blocks:
        assert type(block.mlp.router) is nn.Linear
        assert type(block.mlp.router.weight) is nn.Parameter
        wrapped = isinstance(block.attn.wq.weight, WeightWithDynamicFloat8CastTensor)
        assert wrapped == (recipe == "tensorwise")
    message = caplog.records[-1].getMessage()
    assert f"precision.float8={recipe}: 8 of 11 Linear layers compute in float8" in message
    assert "blocks.*.attn.wq x2, blocks.*.attn.wk x2" in message
    assert "blocks.*.mlp.router x2 (kept in high precision by MoE), head (the output layer)" in (
        message
    )


class _Gated(nn.Module):
    """A family's own module that keeps a whole child (two Linear layers) in high precision."""

    high_precision_children = "gate"  # one name, as a string

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
        self.up = nn.Linear(32, 32)


def test_a_module_keeps_every_linear_inside_the_children_it_names():
    model = nn.Sequential(_Gated(), nn.Sequential(_Gated()))
    assert float8_eligible(model) == ["0.up", "1.0.up"]


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


@needs_scaled_mm("tensorwise")
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


@needs_scaled_mm("tensorwise")
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


# ---------------------------------------------------------------------- the GPU check's rows


def test_the_gpu_checks_float8_variants_pass_preflight_and_make_their_rows(monkeypatch):
    """scripts/bench/bench_gpu.py's llama3_1b_variants section (the GPU check's second command)
    runs llama3_1b with each float8 recipe, eager and compiled: configs the preflight accepts on
    an H100 and refuses on an A100; the GPU check's table gives each one's tokens/s against
    bf16's, or why float8 did not run."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "scripts" / "bench"))
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "ci"))
    bench_gpu = importlib.import_module("bench_gpu")
    summary = importlib.import_module("gpu_check_summary")
    args = bench_gpu.parse_args(["--second"])
    launches = bench_gpu.section_launches(args, "llama3_1b_variants", float8=True)
    variants = [v for launch in launches for v in launch.variants]
    float8_variants = {v.name: v for v in variants if any("precision.float8=" in k for k in v.keys)}
    assert sorted(float8_variants) == sorted(
        f"float8_{recipe}_{mode}"
        for recipe in ("rowwise", "tensorwise")
        for mode in ("eager", "compiled")
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    for name, variant in float8_variants.items():
        cfg = compose([key for key in variant.keys if not key.startswith("hydra.")])
        recipe = name.split("_")[1]
        assert (cfg.model.name, cfg.precision.dtype, cfg.precision.float8) == (
            "llama",
            "bf16",
            recipe,
        )
        _gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
        validate(cfg, world_size=1)
        _gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
        with pytest.raises(ConfigError, match="compute capability 8.0"):
            validate(cfg, world_size=1)

    bf16 = {"label": "bf16 eager", "versus": None, "failed": None, "tokens_per_s": 30000.0}
    rowwise = {
        "label": "float8 rowwise eager",
        "versus": "bf16_eager",
        "failed": None,
        "tokens_per_s": 36000.0,
        "ratio": 1.2,
        "loss_gap": 0.01,
    }
    section = {"rows": {"bf16_eager": bf16, "float8_rowwise_eager": rowwise}}
    figures = {"variant_sections": ["llama3_1b_variants"], "llama3_1b_variants": section}
    rows = dict(summary.bench_rows(figures))
    assert rows["llama3_1b_variants: float8 rowwise eager"] == (
        "36,000 tokens/s (1.20x bf16 eager; losses within 1.0e-02)"
    )
    section = {"rows": {"bf16_eager": bf16}, "float8_not_run": "torchao is not installed"}
    figures["llama3_1b_variants"] = section
    rows = dict(summary.bench_rows(figures))
    assert rows["llama3_1b_variants: float8"] == "not run: torchao is not installed"
