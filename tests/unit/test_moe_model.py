"""The mixture-of-experts family in one process: logits equal transformers' Qwen3-MoE and Mixtral
(folders in both of transformers' layouts: the hub's per-expert tensors and its own fused ones),
export loaded back by transformers, the load balancing (routing bias, auxiliary loss's gradient,
counts once under activation checkpointing), grouped experts against the loop, bad folders and
configs, the meta build, and a rank's slices of expert-parallel and FSDP shards (a fake process
group: the shards are real, nothing is sent). Tiny models built by transformers from configs:
nothing is downloaded."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.checkpoint import checkpoint

from sdnet_trainer import compose
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export import config_yaml
from sdnet_trainer.export.hf import write_hf
from sdnet_trainer.models import build_model
from sdnet_trainer.models.init import build_deferred, materialize
from sdnet_trainer.models.moe import GroupedExperts, MoE, MoEDecoder, experts
from sdnet_trainer.models.moe.hf import QWEN3
from sdnet_trainer.models.moe.weights import load_hf_weights
from sdnet_trainer.models.parallel_spec import pipeline_units
from sdnet_trainer.models.registry import hf_weights_reader, model_family
from sdnet_trainer.preflight import validate
from sdnet_trainer.serve.args import ServeArgs
from sdnet_trainer.serve.decoding import CausalLMDecoder
from sdnet_trainer.serve.model import load_served

transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")

SIZES = {
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
}
# Qwen3-MoE with a head size of its own (4 x 16 > 32) and without renormalised top-k weights (its
# default), tied embeddings; Mixtral with its renormalisation and head size 32 / 4.
VARIANTS = {
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        {"num_experts": 4, "moe_intermediate_size": 16, "intermediate_size": 48, "head_dim": 16},
    ),
    "qwen3_moe_tied": (
        transformers.Qwen3MoeConfig,
        {
            "num_experts": 4,
            "moe_intermediate_size": 16,
            "head_dim": 16,
            "norm_topk_prob": True,
            "tie_word_embeddings": True,
        },
    ),
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "intermediate_size": 16}),
}


def _spread(model: nn.Module) -> nn.Module:
    """Norms away from one and a decisive router, so that a misplaced norm or a routing that
    differs shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.normal_(0.0, 0.5)
    return model


def _hf_model(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    config_class, own = VARIANTS[variant]
    config = config_class(**SIZES, **own)
    return _spread(transformers.AutoModelForCausalLM.from_config(config).eval())


@pytest.fixture(scope="module", params=[(v, f) for v in VARIANTS for f in ("per_expert", "fused")])
def hf_folder(request, tmp_path_factory):
    """A transformers model saved in sharded safetensors: per expert as the hub's checkpoints
    (transformers' default), or its own fused 3-D expert tensors."""
    variant, layout = request.param
    folder = tmp_path_factory.mktemp(f"{variant}_{layout}")
    model = _hf_model(variant)
    model.save_pretrained(
        folder, max_shard_size="20KB", save_original_format=layout == "per_expert"
    )
    return folder, model


def _tokens(vocab: int = 96, length: int = 40) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(1))


def _cfg(folder) -> list[str]:
    return ["model=moe_debug", f"model.weights=hf:{folder}"]


def _load(folder) -> MoEDecoder:
    """The model of ``folder``'s config.json, read as the Trainer reads it (the family's reader:
    the check against the meta build, then the load)."""
    cfg = compose(_cfg(folder))
    reader = hf_weights_reader(cfg.model)
    assert reader is not None
    with torch.device("meta"):
        reader.check(build_model(cfg.model))
    model = build_model(cfg.model)
    reader.load(model)
    return model.eval()


def test_logits_equal_transformers(hf_folder):
    folder, hf = hf_folder
    model = _load(folder)
    assert model.qk_norm == (hf.config.model_type == QWEN3)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=0, atol=1e-5)
    if model.tie_embeddings:
        assert model.head.weight is model.embed.tok.weight


@pytest.mark.parametrize(
    "overrides",
    [[], ["model.moe.qk_norm=false", "model.moe.head_dim=null"]],
    ids=["qwen3_moe", "mixtral"],
)
def test_export_loads_in_transformers_with_equal_logits(tmp_path, overrides):
    torch.manual_seed(2)
    model = _spread(build_model(compose(["model=moe_debug", *overrides]).model)).eval()
    write_hf(model, tmp_path, family=model_family("moe"), shard_bytes=100_000)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == ("mixtral" if overrides else QWEN3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert any(".experts.7." in name for name in index["weight_map"])  # the hub's layout
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = _tokens(256, 48)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, model(tokens), rtol=0, atol=1e-5)
    # And back through this family's reader.
    again = _load(tmp_path)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["model.moe.num_shared_experts=1"], "model.moe.num_shared_experts=1"),
        (["model.moe.qk_norm=false", "model.moe.norm_topk_prob=false"], "norm_topk_prob=False"),
        (["model.moe.qk_norm=false"], "model.moe.head_dim=32"),
    ],
)
def test_export_refuses_what_neither_type_represents(tmp_path, overrides, named):
    model = build_model(compose(["model=moe_debug", *overrides]).model)
    with pytest.raises(ConfigError, match=named):
        write_hf(model, tmp_path, family=model_family("moe"))
    assert not list(tmp_path.iterdir())  # refused before any file is written
    biased = build_model(compose(["model=moe_debug", "model.moe.load_balance=bias"]).model)
    write_hf(biased, tmp_path, family=model_family("moe"))  # a zero bias routes as none
    biased.blocks[0].mlp.expert_bias[1] = 0.5
    with pytest.raises(ConfigError, match="model.moe.load_balance=bias"):
        write_hf(biased, tmp_path, family=model_family("moe"))


def _export_folder(folder, overrides: list[str]) -> MoEDecoder:
    """An export folder of a MoE (config.yaml + model.pt), as export writes one."""
    cfg = compose(
        ["model=moe_debug", "data=tokens", "data.vocab_size=256", "data.seq_len=32", *overrides]
    )
    torch.manual_seed(3)
    model = _spread(build_model(cfg.model)).eval()
    torch.save(model.state_dict(), folder / "model.pt")
    (folder / "config.yaml").write_text(config_yaml(cfg))
    return model


@pytest.mark.parametrize(
    "overrides",
    [[], ["model.moe.qk_norm=false", "model.moe.head_dim=null"]],
    ids=["qwen3_moe", "mixtral"],
)
def test_a_served_moe_generates_with_the_kv_cache_on_its_own_tensors(tmp_path, overrides):
    """Served through the cached decoder, as the transformers model of its own tensors (held
    once, in the expert layout this transformers builds): its logits, and greedy tokens equal to
    the no-cache path (this project's MoE recomputing the whole sequence at every token)."""
    model = _export_folder(tmp_path, overrides)
    served, _ = load_served(ServeArgs(checkpoint=str(tmp_path), device="cpu"))
    assert isinstance(served.decoder, CausalLMDecoder) and served.info()["kv_cache"]
    twin, ours = served.decoder.lm, served.runner.model
    assert twin.config.model_type == ("mixtral" if overrides else QWEN3)
    storage = {p.untyped_storage().data_ptr() for p in ours.parameters()}
    assert {p.untyped_storage().data_ptr() for p in twin.parameters()} <= storage
    tokens = _tokens(256, 24)
    with torch.no_grad():
        torch.testing.assert_close(twin(tokens).logits, model(tokens), rtol=0, atol=1e-5)
        torch.testing.assert_close(ours(tokens), model(tokens), rtol=0, atol=1e-5)
    jobs = [served.job(p, max_new_tokens=8, temperature=0.0, seed=None) for p in ([5], [1, 2, 3])]
    cached = served.run(jobs)
    served.decoder = None
    assert served.run(jobs) == cached


def test_a_moe_transformers_cannot_hold_serves_without_the_cache(tmp_path, caplog):
    _export_folder(tmp_path, ["model.moe.num_shared_experts=1"])
    with caplog.at_level("WARNING"):
        served, _ = load_served(ServeArgs(checkpoint=str(tmp_path), device="cpu"))
    assert served.decoder is None and "model.moe.num_shared_experts=1" in caplog.text
    assert len(served.run([served.job([5], max_new_tokens=4, temperature=0.0, seed=None)])[0]) == 4


# ---------------------------------------------------------------------- the layer


def _moe(load_balance: str = "aux_loss") -> MoE:
    torch.manual_seed(0)
    layer = MoE(8, 4, 2, 16, load_balance=load_balance, aux_loss_coeff=0.1)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 1.0)
    return layer


def _by_hand(layer: MoE, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each token through ``chosen`` experts (B*T, top_k), weighted by its router probabilities
    renormalised over them: the layer's output computed one token at a time."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(tokens @ layer.router.weight.T, dim=-1)
    e = layer.experts
    rows = []
    for token, token_probs, experts_of in zip(tokens, probs, chosen, strict=True):
        weights = token_probs[experts_of] / token_probs[experts_of].sum()
        rows.append(
            sum(
                w * experts._swiglu(token, e.w1[i], e.w3[i], e.w2[i])
                for w, i in zip(weights, experts_of, strict=True)
            )
        )
    return torch.stack(rows).view_as(x)


def test_the_routing_bias_chooses_but_does_not_weigh():
    layer = _moe("bias").eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        layer.expert_bias[3] = 10.0  # expert 3 for every token, its weight still the router's
        probs = torch.softmax(x.reshape(-1, 8) @ layer.router.weight.T, dim=-1)
        others = probs.clone()
        others[:, 3] = -1
        chosen = torch.stack([torch.full((10,), 3), others.argmax(-1)], dim=1)
        torch.testing.assert_close(layer(x), _by_hand(layer, x, chosen))
        unbiased = torch.topk(probs, 2).indices
        assert not torch.equal(chosen.sort(-1).values, unbiased.sort(-1).values)
    layer.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]), 0.25)  # mean 5
    torch.testing.assert_close(layer.expert_bias, torch.tensor([-0.25, 0.25, 0.0, 10.0]))
    with pytest.raises(RuntimeError, match="load_balance='aux_loss'"):
        _moe().update_bias(torch.ones(4), 0.1)


def _aux_by_hand(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """sum over sequences of coeff * E * sum_i f_i * P_i, written out."""
    batch, length, _ = x.shape
    probs = torch.softmax(x @ layer.router.weight.T, dim=-1)  # (B, T, E)
    chosen = torch.topk(probs, layer.top_k, dim=-1).indices
    share = nn.functional.one_hot(chosen, 4).sum((1, 2)) / (length * layer.top_k)
    return (layer.aux_loss_coeff * 4 * (share * probs.mean(1)).sum(-1)).sum()


def test_the_aux_loss_adds_its_weighted_gradient_to_the_router_only():
    layer = _moe()
    x, upstream = torch.randn(3, 6, 8), torch.randn(3, 6, 8)
    layer.eval()  # no auxiliary loss: the output's own gradient
    (layer(x) * upstream).sum().backward()
    plain = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    layer.train()
    layer.aux_loss_weight = 0.37
    (layer(x) * upstream).sum().backward()
    aux = _aux_by_hand(layer, x)
    (aux_grad,) = torch.autograd.grad(aux, layer.router.weight)
    assert aux_grad.abs().max() > 0
    for name, p in layer.named_parameters():
        extra = 0.37 * aux_grad if name == "router.weight" else 0
        torch.testing.assert_close(p.grad, plain[name] + extra, msg=name)
    torch.testing.assert_close(layer.aux_loss_sum, aux.detach())
    assert layer.sequences.item() == 3
    # Unset, the weight is 1 / B: the mean over the forward's sequences.
    layer.zero_grad()
    layer.aux_loss_weight = None
    (layer(x) * upstream).sum().backward()
    torch.testing.assert_close(layer.router.weight.grad, plain["router.weight"] + aux_grad / 3)


def test_tokens_are_counted_once_per_forward_also_under_checkpointing():
    layer = _moe("none")
    x = torch.randn(2, 5, 8, requires_grad=True)
    layer(x).sum().backward()
    assert layer.tokens_per_expert.sum().item() == 2 * 5 * 2
    once = layer.tokens_per_expert.clone()
    checkpoint(layer, x, use_reentrant=False).sum().backward()  # recomputed in backward
    torch.testing.assert_close(layer.tokens_per_expert, 2 * once)
    assert layer.sequences.item() == 4
    with torch.no_grad():
        layer.eval()(x)  # evaluation does not count
    torch.testing.assert_close(layer.tokens_per_expert, 2 * once)
    layer.reset_counts()
    assert not layer.tokens_per_expert.any() and layer.sequences.item() == 0


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 0, 0]], ids=["one_empty", "none"])
def test_grouped_experts_compute_as_the_loop(monkeypatch, counts):
    torch.manual_seed(0)
    grouped = GroupedExperts(4, 8, 16)
    looped = GroupedExperts(4, 8, 16)
    looped.load_state_dict(grouped.state_dict())
    x = torch.randn(sum(counts), 8)
    counts_t = torch.tensor(counts)
    assert experts.grouped_mm_supported(x, grouped.w1, grouped.w2)
    out_grouped = grouped(x, counts_t)
    monkeypatch.setattr(experts, "_GROUPED_MM", None)  # the loop over experts
    out_looped = looped(x, counts_t)
    torch.testing.assert_close(out_grouped, out_looped)
    (out_grouped**2).sum().backward()
    (out_looped**2).sum().backward()
    for name, p in grouped.named_parameters():
        torch.testing.assert_close(p.grad, looped.get_parameter(name).grad, msg=name)
    assert not grouped.w1.grad[1].any()  # the empty expert


# ---------------------------------------------------------------------- bad input


def _edit(folder, file: str, **changes) -> None:
    data = json.loads((folder / file).read_text())
    data.update(changes)
    (folder / file).write_text(json.dumps(data))


@pytest.fixture(scope="module")
def qwen3_saved(tmp_path_factory):
    """A Qwen3-MoE folder in the hub's per-expert layout, in several files."""
    folder = tmp_path_factory.mktemp("qwen3_saved")
    _hf_model("qwen3_moe").save_pretrained(folder, max_shard_size="20KB")
    return folder


@pytest.fixture
def qwen3_copy(qwen3_saved, tmp_path):
    shutil.copytree(qwen3_saved, tmp_path / "hf")
    return tmp_path / "hf"


def _load_error(folder) -> str:
    with pytest.raises(ConfigError) as err:
        _load(folder)
    return str(err.value)


@pytest.mark.parametrize("experts_in_config", [2, 5])
def test_an_expert_count_other_than_the_configs_names_the_file(qwen3_copy, experts_in_config):
    _edit(qwen3_copy, "config.json", num_local_experts=experts_in_config)
    error = _load_error(qwen3_copy)
    assert "stores 4 experts" in error and f"num_local_experts={experts_in_config}" in error
    assert "model-0000" in error and "experts.3." in error


def test_a_missing_expert_or_a_wrong_shape_names_the_tensor(qwen3_copy):
    index_file = qwen3_copy / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    missing = "model.layers.1.mlp.experts.2.up_proj.weight"
    fewer = {k: v for k, v in index["weight_map"].items() if k != missing}
    index_file.write_text(json.dumps({"weight_map": fewer}))
    error = _load_error(qwen3_copy)
    assert "lacks tensors" in error and missing in error
    index_file.write_text(json.dumps(index))
    _edit(qwen3_copy, "config.json", moe_intermediate_size=8)
    error = _load_error(qwen3_copy)
    assert "gate_proj.weight has shape [16, 32]" in error and "model-0000" in error


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"mlp_only_layers": [1]}, "'mlp_only_layers' is [1]"),
        ({"decoder_sparse_step": 2}, "'decoder_sparse_step' is 2"),
        ({"use_sliding_window": True, "sliding_window": 16}, "'sliding_window' is 16"),
        ({"attention_bias": True}, "'attention_bias' is True"),
        ({"model_type": "qwen2_moe"}, "'model_type' is 'qwen2_moe'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type' is 'yarn'"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
    ],
)
def test_a_config_the_family_cannot_represent_names_the_field(qwen3_copy, changes, named):
    _edit(qwen3_copy, "config.json", **changes)
    with pytest.raises(ConfigError, match="config.json") as err:
        validate(compose(_cfg(qwen3_copy)), world_size=1)  # before launch
    assert named in str(err.value)


def test_a_sequence_longer_than_the_context_names_the_moe_key():
    model = build_model(compose(["model=moe_debug"]).model)
    with pytest.raises(ConfigError, match=r"model\.moe\.seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_preflight_checks_the_sizes_against_data_and_layout():
    base = ["+recipe=moe_debug"]
    validate(compose(base), world_size=1)
    # Tensor parallel would compute every expert on every tensor-parallel rank: refused before
    # launch, as is the model's own sharding, and the planner never proposes it.
    with pytest.raises(ConfigError, match="parallel.tp=2 with a mixture of experts.*parallel.ep"):
        validate(compose([*base, "parallel.tp=2"]), world_size=2)
    with pytest.raises(ConfigError, match="parallel.tp=2 with a mixture of experts"):
        build_model(compose(base).model).check_tensor_parallel(2, sequence_parallel=False)
    with pytest.raises(ConfigError, match="model.moe.top_k=9 experts per token"):
        validate(compose([*base, "model.moe.top_k=9"]), world_size=1)
    with pytest.raises(ConfigError, match="model.moe.load_balance='best' is not one of"):
        validate(compose([*base, "model.moe.load_balance=best"]), world_size=1)
    with pytest.raises(ConfigError, match="model.kwargs.num_experts=0 must be >= 1"):
        validate(compose([*base, "+model.kwargs.num_experts=0"]), world_size=1)


# ---------------------------------------------------------------------- building, sharding


def test_meta_build_initialises_like_the_cpu_build():
    cfg = compose(
        [
            "model=moe_debug",
            "model.moe.tie_embeddings=true",
            "model.moe.load_balance=bias",
            "model.moe.num_shared_experts=1",
        ]
    )
    torch.manual_seed(3)
    cpu = build_model(cfg.model)
    torch.manual_seed(3)
    meta, steps = build_deferred(lambda: build_model(cfg.model), on_meta=True)
    assert steps is not None and all(t.is_meta for t in meta.state_dict().values())
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    materialize(steps)
    for name, value in cpu.state_dict().items():
        torch.testing.assert_close(meta.state_dict()[name], value, rtol=0, atol=0, msg=name)
    assert not meta.blocks[1].mlp.tokens_per_expert.any()  # a counter, not saved: set too
    # The residual stream's projections start smaller (std 0.02 / sqrt(2 n_layers) = 0.01).
    experts_of = cpu.blocks[0].mlp.experts
    assert experts_of.w2.std() < 0.012 < 0.018 < experts_of.w1.std()
    # The planner's forward on the meta device (shapes only) runs through the experts too.
    with torch.device("meta"):
        shapes_only = build_model(compose(["model=moe_debug"]).model).train()
    assert shapes_only(torch.zeros(2, 64, dtype=torch.long, device="meta")).shape == (2, 64, 256)
    units = [u.name for u in pipeline_units(shapes_only, "x")]
    assert units == ["embed", "blocks.0", "blocks.1", "norm", "head"]


@pytest.fixture
def rank_1_of_4():
    """Rank 1 of a fake group of 4 on a (dp, ep) = (2, 2) mesh: coordinates (0, 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    finally:
        dist.destroy_process_group()


# FSDP over expert parallel's shards by expert (what fully_shard makes of them on the dp mesh),
# and a 2-D split of a projection's rows and columns.
STRIDED = (_StridedShard(0, split_factor=2), Shard(0))


def _shard(model: nn.Module, mesh) -> None:
    def place(module: nn.Module, name: str, placements) -> None:
        p = module.get_parameter(name)
        shard = distribute_tensor(p.detach(), mesh, list(placements), src_data_rank=None)
        module.register_parameter(name, nn.Parameter(shard))

    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name in ("w1", "w2", "w3"):
                place(module, name, STRIDED)
    place(model.blocks[0].attn.wq, "weight", (Shard(0), Shard(1)))


def _assert_rank_holds(model: nn.Module, reference: nn.Module) -> None:
    for name, value in model.state_dict().items():
        full = reference.state_dict()[name]
        if isinstance(value, DTensor):
            cut = distribute_tensor(full, value.device_mesh, value.placements, src_data_rank=None)
            full, value = cut.to_local(), value.to_local()
        torch.testing.assert_close(value, full, rtol=0, atol=0, msg=name)


def test_a_rank_loads_and_initialises_only_its_shards(rank_1_of_4, qwen3_saved):
    reference = _load(qwen3_saved)
    model = build_model(compose(_cfg(qwen3_saved)).model)
    _shard(model, rank_1_of_4)
    assert model.blocks[0].mlp.experts.w1.to_local().shape == (1, 16, 32)  # expert 2 of 4
    load_hf_weights(model, qwen3_saved)
    _assert_rank_holds(model, reference)
    # Built on the meta device, sharded, allocated, initialised: the CPU build's slices.
    cfg = compose(["model=moe_debug"])
    torch.manual_seed(3)
    cpu = build_model(cfg.model)
    torch.manual_seed(3)
    meta, steps = build_deferred(lambda: build_model(cfg.model), on_meta=True)
    assert steps is not None
    _shard(meta, rank_1_of_4)
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    materialize(steps)
    _assert_rank_holds(meta, cpu)


@pytest.fixture(scope="module")
def qwen3_fused(tmp_path_factory):
    """The same Qwen3-MoE in transformers 5's fused layout (saved outside any process group:
    transformers writes config.json on the main process only)."""
    folder = tmp_path_factory.mktemp("qwen3_fused")
    _hf_model("qwen3_moe").save_pretrained(folder, save_original_format=False)
    return folder


def test_a_rank_reads_only_its_experts_rows_and_columns(qwen3_saved, qwen3_fused, rank_1_of_4):
    """Experts split by expert over ep and by row over dp (rank 1 of 4 holds experts 2 and 3,
    rows 0..8 of each): the rank's blocks are read from both layouts, and nothing else: in the
    per-expert layout only the tensors of its experts, in the fused one only its rows."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reference = _load(qwen3_saved)
    placements = (Shard(1), Shard(0))  # (dp, ep)
    for folder in (qwen3_saved, qwen3_fused):
        model = build_model(compose(_cfg(folder)).model)
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                for name in ("w1", "w2", "w3"):
                    full = module.get_parameter(name).detach()
                    shard = distribute_tensor(full, rank_1_of_4, placements, src_data_rank=None)
                    module.register_parameter(name, nn.Parameter(shard))
        w3 = model.blocks[1].mlp.experts.w3
        assert w3.to_local().shape == (2, 8, 32)
        reads: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        stock = HuggingFaceStorageReader._process_read_request

        def record(self, f, req, planner, stock=stock, reads=reads):
            reads.append((req.storage_index.fqn, tuple(req.storage_offsets), tuple(req.lengths)))
            return stock(self, f, req, planner)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(HuggingFaceStorageReader, "_process_read_request", record)
            load_hf_weights(model, folder)
        _assert_rank_holds(model, reference)
        held = sum(p.to_local().numel() for p in model.parameters() if isinstance(p, DTensor))
        held += sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))
        assert sum(math.prod(lengths) for *_, lengths in reads) == held  # each element once
        up = [r for r in reads if r[0].startswith("model.layers.1.mlp.experts.")]
        if folder == qwen3_saved:
            assert {r[0] for r in up if ".up_proj." in r[0]} == {
                f"model.layers.1.mlp.experts.{e}.up_proj.weight" for e in (2, 3)
            }
            assert all(r[1:] == ((0, 0), (8, 32)) for r in up if ".up_proj." in r[0])
        else:  # the gate's rows 0..16, then the up projection's 16..32: rows 16..24 of 2, 3
            assert ("model.layers.1.mlp.experts.gate_up_proj", (2, 16, 0), (2, 8, 32)) in up
