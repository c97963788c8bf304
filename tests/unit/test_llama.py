"""The Llama family in one process: logits equal transformers' LlamaForCausalLM (GQA, Llama 3
rope scaling, tied embeddings), Hugging Face folders in (model.weights=hf:PATH, model.hf_config)
and out (export format=hf, reloaded by transformers), bad folders, the meta build, compile and
activation checkpointing. Tiny models built by transformers from configs: nothing is downloaded.
The multi-process layouts (FSDP2, TP, PP, FSDP x TP, and the sharded Hugging Face load) are in
tests/distributed/test_layouts.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from sdnet_trainer import Trainer, compose
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export import ExportArgs, export
from sdnet_trainer.export.hf import write_hf
from sdnet_trainer.models import build_model
from sdnet_trainer.models.decoder import Decoder
from sdnet_trainer.models.gpt import GPT
from sdnet_trainer.models.init import build_deferred, materialize
from sdnet_trainer.models.llama import Llama
from sdnet_trainer.models.llama.hf import from_hf_name, load_hf_weights, to_hf_name
from sdnet_trainer.models.parallel_spec import GPT_LAYOUT, LLAMA_LAYOUT, pipeline_units
from sdnet_trainer.models.rotary import inverse_frequencies
from sdnet_trainer.preflight import validate
from tests.support import tiny_llama_config

transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# GQA (4 query heads over 2 key/value heads) with Llama 3 scaling over an original context of 32
# (the tests use 40 tokens); and plain multi-head attention, default rope, tied embeddings.
VARIANTS = {
    "gqa_llama3_untied": {
        "num_key_value_heads": 2,
        "rope_scaling": LLAMA3_SCALING,
        "tie_word_embeddings": False,
    },
    "mha_default_tied": {"num_key_value_heads": 4, "tie_word_embeddings": True},
}


def _hf_model(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    config = tiny_llama_config(  # the variant sets the key/value heads
        vocab_size=96,
        intermediate_size=48,
        max_position_embeddings=64,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        **{k: dict(v) if isinstance(v, dict) else v for k, v in VARIANTS[variant].items()},
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts norms at one: move them, so a missed one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_folder(request, tmp_path_factory):
    """A transformers Llama saved in sharded safetensors (several files and their index)."""
    folder = tmp_path_factory.mktemp(request.param)
    model = _hf_model(request.param)
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").exists()
    return folder, model


def _tokens(vocab: int = 96, length: int = 40) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(1))


def test_logits_equal_transformers_llama(hf_folder):
    folder, hf = hf_folder
    cfg = compose(["model=llama3_debug", f"model.weights=hf:{folder}"])
    model = build_model(cfg.model)  # the architecture from config.json
    load_hf_weights(model, folder)
    tokens = _tokens()
    with torch.no_grad():
        expected, got = hf(tokens).logits, model(tokens)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert model.tie_embeddings == hf.config.tie_word_embeddings
    if model.tie_embeddings:
        assert model.head.weight is model.embed.tok.weight


def test_llama3_rope_scaling_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_SCALING),  # transformers adds rope_theta to the dict it gets
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = inverse_frequencies(32, theta=500000.0, **LLAMA3_SCALING)
    torch.testing.assert_close(got, expected.float(), rtol=0, atol=0)
    # The three bands are all used: slowed by the factor, kept, and blended between.
    plain = inverse_frequencies(32, theta=500000.0)
    ratio = plain / got
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


def test_hf_config_builds_the_architecture_without_weights(hf_folder):
    folder, hf = hf_folder
    cfg = compose(["model=llama3_debug", f"model.hf_config={folder / 'config.json'}"])
    model = build_model(cfg.model)
    hf_shapes = {from_hf_name(n): tuple(p.shape) for n, p in hf.state_dict().items()}
    ours = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    assert ours == hf_shapes or ours == {**hf_shapes, "head.weight": hf_shapes["embed.tok.weight"]}
    assert (model.n_heads, model.n_kv_heads) == (4, hf.config.num_key_value_heads)
    # The same file may not also come as weights.
    with pytest.raises(ConfigError, match="leave model.hf_config"):
        build_model(compose([*_hf_cfg(folder), f"model.hf_config={folder}"]).model)


def _hf_cfg(folder) -> list[str]:
    return ["model=llama3_debug", f"model.weights=hf:{folder}"]


def test_names_map_one_to_one():
    model = Llama(vocab_size=8, seq_len=8, dim=8, n_layers=2, n_heads=2, hidden_dim=8)
    for name in model.state_dict():
        assert from_hf_name(to_hf_name(name)) == name
    assert to_hf_name("blocks.1.attn.wk.weight") == "model.layers.1.self_attn.k_proj.weight"
    assert from_hf_name("model.layers.0.mlp.up_proj.weight") == "blocks.0.mlp.w3.weight"


def test_gpt_and_llama_share_the_decoder_machinery():
    """One implementation of blocks, pipeline units and the tensor-parallel plan, driven by each
    family's declared layout: the same unit names, the MLP's extra column-split projection."""
    llama = build_model(compose(["model=llama3_debug"]).model)
    gpt = build_model(compose(["model=gpt_tiny"]).model)
    assert isinstance(gpt, GPT) and isinstance(llama, Decoder)
    for method in ("apply_tensor_parallel", "parallel_blocks", "pipeline_units"):
        assert getattr(GPT, method) is getattr(Decoder, method)
    for model, layout in ((gpt, GPT_LAYOUT), (llama, LLAMA_LAYOUT)):
        units = [u.name for u in pipeline_units(model, "x")]
        assert units == ["embed", "blocks.0", "blocks.1", "norm", "head"]
        assert model.parallel_blocks() == list(model.blocks)
        for region in layout.regions:
            for name in (*region.colwise, *region.rowwise):
                assert isinstance(
                    model.blocks[0].get_submodule(f"{region.name}.{name}"), torch.nn.Linear
                )
    assert LLAMA_LAYOUT.regions[1].colwise == ("w1", "w3") and not LLAMA_LAYOUT.replicated


def test_meta_build_initialises_like_the_cpu_build():
    cfg = compose(["model=llama3_debug", "model.llama.tie_embeddings=true"])
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
    # The rotary frequencies (a buffer, not saved) are computed too.
    torch.testing.assert_close(
        meta.blocks[0].attn.rotary.inv_freq, cpu.blocks[0].attn.rotary.inv_freq
    )


@pytest.mark.full  # compiles two blocks (aot_eager), about 10 s
def test_compiled_and_checkpointed_blocks_compute_the_same():
    from sdnet_trainer.distributed.activation_checkpointing import checkpoint_block

    torch.manual_seed(0)
    model = build_model(compose(["model=llama3_debug"]).model)
    twin = build_model(compose(["model=llama3_debug"]).model)
    twin.load_state_dict(model.state_dict())
    for block in twin.parallel_blocks():
        checkpoint_block(block)
        block.compile(backend="aot_eager", fullgraph=True)
    tokens = _tokens(256, 64)
    losses = []
    for m in (model, twin):
        loss = m(tokens).logsumexp(-1).mean()
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0])
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def _write_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture
def copy_folder(hf_folder, tmp_path):
    import shutil

    folder, _ = hf_folder
    shutil.copytree(folder, tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"model_type": "mistral"}, "'model_type' is 'mistral'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type' is 'yarn'"),
        ({"hidden_act": "gelu"}, "'hidden_act' is 'gelu'"),
        ({"head_dim": 16}, "'head_dim' is 16"),
        ({"num_attention_heads": "four"}, "'num_attention_heads' is 'four'"),
        ({"hidden_size": None}, "'hidden_size' is missing"),
    ],
)
def test_a_config_the_family_cannot_represent_names_the_field(copy_folder, changes, named):
    _write_config(copy_folder, **changes)
    cfg = compose(_hf_cfg(copy_folder))
    with pytest.raises(ConfigError, match="config.json|model.weights") as err:
        validate(cfg, world_size=1)  # before launch
    assert named in str(err.value)


def test_bad_weight_folders_name_the_file(copy_folder):
    index = json.loads((copy_folder / "model.safetensors.index.json").read_text())
    cfg = compose(_hf_cfg(copy_folder))

    def load_error() -> str:
        model = build_model(cfg.model)
        with pytest.raises(ConfigError) as err:
            load_hf_weights(model, copy_folder)
        return str(err.value)

    shard = sorted(copy_folder.glob("model-*.safetensors"))[0]
    saved = shard.read_bytes()
    # A truncated shard.
    shard.write_bytes(saved[:50])
    assert shard.name in load_error() and "not a safetensors file" in load_error()
    # A shard that is a symbolic link (to a real file elsewhere) is refused, not followed.
    elsewhere = copy_folder.parent / "elsewhere.safetensors"
    elsewhere.write_bytes(saved)
    shard.unlink()
    os.symlink(elsewhere, shard)
    assert "symbolic link" in load_error()
    shard.unlink()
    shard.write_bytes(saved)
    # An index entry pointing outside the folder.
    name = next(iter(index["weight_map"]))
    bad = {**index, "weight_map": {**index["weight_map"], name: "../elsewhere.safetensors"}}
    (copy_folder / "model.safetensors.index.json").write_text(json.dumps(bad))
    assert f"weight_map.{name}" in load_error()
    # A tensor the model has no place for, and one it needs that is missing.
    extra = {**index, "weight_map": {**index["weight_map"], "model.vision.weight": shard.name}}
    (copy_folder / "model.safetensors.index.json").write_text(json.dumps(extra))
    assert "model.vision.weight" in load_error()
    fewer = dict(index["weight_map"])
    del fewer["model.norm.weight"]
    (copy_folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": fewer}))
    assert "lacks tensors" in load_error() and "model.norm.weight" in load_error()
    (copy_folder / "model.safetensors.index.json").write_text("{not json")
    assert "model.safetensors.index.json is not valid JSON" in load_error()
    (copy_folder / "model.safetensors.index.json").write_text(json.dumps(index))
    # A config.json whose sizes disagree with the weights: the tensor and file are named.
    _write_config(copy_folder, intermediate_size=64)
    error = load_error()
    assert "gate_proj.weight has shape [48, 32]" in error and "model-" in error


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A llama3_debug-sized run from a transformers checkpoint (model.weights=hf:), 3 steps with
    the weights' average, checkpointed: the trained weights and the average."""
    hf_dir = tmp_path_factory.mktemp("hf_in")
    _hf_model("gqa_llama3_untied", seed=5).save_pretrained(hf_dir, max_shard_size="20KB")
    run_dir = tmp_path_factory.mktemp("llama_run")
    cfg = compose(
        [
            "+recipe=llama3_debug",
            f"model.weights=hf:{hf_dir}",
            "data.vocab_size=96",
            "data.seq_len=32",
            "data.train_size=64",
            "data.val_size=16",
            "loop.max_steps=3",
            "loop.global_batch_size=8",
            "loop.eval_at_end=false",
            "model.ema.enabled=true",
            "model.ema.decay=0.5",
            "logging.trackers=[]",
        ]
    )
    validate(cfg, world_size=1)
    trainer = Trainer(cfg, output_dir=run_dir)
    trainer.fit()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    ema = {k: v.detach().clone() for k, v in trainer.ema.state_dict().items()}
    trainer.close()
    (checkpoint,) = (run_dir / "checkpoints").glob("step_*")
    return checkpoint, weights, ema, hf_dir


@pytest.mark.full  # trains 3 steps and exports twice, about 6 s
@pytest.mark.parametrize("ema", [False, True])
def test_export_hf_round_trips_through_transformers(llama_run, tmp_path, ema):
    checkpoint, weights, average, hf_dir = llama_run
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    (tokenizer / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "out"
    result = export(
        ExportArgs(
            checkpoint=str(checkpoint),
            format="hf",
            out=str(out),
            ema=ema,
            tokenizer=str(tokenizer),
        )
    )
    names = {p.name for p in result.files}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= names
    # The source folder's special token ids and generation config are passed on.
    source = json.loads((hf_dir / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    assert exported["eos_token_id"] == source["eos_token_id"] is not None
    assert "generation_config.json" in names
    assert "tokenizer_config.json" in names and any(n.startswith("model-000") for n in names)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    expected = average if ema else weights
    mine = Llama(**build_kwargs(out))
    mine.load_state_dict(expected, strict=False)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, mine(tokens), rtol=0, atol=1e-5)
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, expected[from_hf_name(name)], rtol=0, atol=0)
    if ema:  # the average, not the weights
        assert not torch.equal(average["norm.weight"], weights["norm.weight"])


def build_kwargs(folder) -> dict:
    from sdnet_trainer.models.hf_folder import read_hf_config
    from sdnet_trainer.models.llama.hf import llama_sizes_from_hf

    return llama_sizes_from_hf(read_hf_config(folder, key="out"), source="out")


@pytest.mark.full  # the 3-step run of llama_run
def test_the_trainer_starts_from_the_hf_weights(llama_run):
    """model.weights=hf: reaches the Trainer's meta build: step 1 trained from the file's
    weights (the trained ones differ from them by the three SGD steps only)."""
    _, weights, _, hf_dir = llama_run
    loaded = Llama(**build_kwargs(hf_dir))
    load_hf_weights(loaded, hf_dir)
    for name, value in loaded.state_dict().items():
        assert (weights[name] - value).abs().max() < 0.05, name


def test_export_hf_refuses_other_models_and_mixed_formats(tmp_path):
    from sdnet_trainer.export import formats
    from sdnet_trainer.export.writers import ExportError
    from sdnet_trainer.models.registry import model_family

    gpt = build_model(compose(["model=gpt_tiny"]).model)
    cnn = build_model(compose(["model=simple_cnn", "model.num_classes=10"]).model)
    adapters = r"Hugging Face adapter \(model.name=gpt or llama or moe\)"
    with pytest.raises(ExportError, match=adapters):
        write_hf(cnn, tmp_path, family=None)
    # A model the Llama's names do not fit, under model.name=llama: refused by name, not a crash.
    with pytest.raises(ConfigError, match="Hugging Face names are a Llama's; this model is a GPT"):
        write_hf(gpt, tmp_path, family=model_family("llama"))
    with pytest.raises(ConfigError, match="two weight files"):
        formats("hf,safetensors")
    assert "hf" not in formats("all")


def test_preflight_checks_llama_against_data_and_layout():
    base = ["+recipe=llama3_debug"]
    validate(compose(base), world_size=1)
    with pytest.raises(ConfigError, match="data.vocab_size=96 differs"):
        validate(compose([*base, "data.vocab_size=96"]), world_size=1)
    with pytest.raises(ConfigError, match="model.llama.n_kv_heads=2 must be divisible"):
        validate(compose([*base, "parallel.tp=4"]), world_size=4)
    with pytest.raises(ConfigError, match="tie_embeddings=true with parallel.pp=2"):
        validate(compose([*base, "model.llama.tie_embeddings=true", "parallel.pp=2"]), world_size=2)
    with pytest.raises(ConfigError, match="model.llama.rope_scaling.rope_type='yarn'"):
        build_model(compose([*base, "model.llama.rope_scaling.rope_type=yarn"]).model)
