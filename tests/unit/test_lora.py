"""model.lora in one process: peft's adapters in the Llama (targets in Hugging Face's names,
all-linear, DoRA) and in a transformers causal LM, the base frozen; the meta build's adapters
equal the CPU build's; the Hugging Face reader sees the base's names; only the adapters train,
are checkpointed and resume bitwise; the exported peft folder loads with
``peft.PeftModel.from_pretrained`` on the transformers base and gives our logits, the merged export
equals base + adapter; bad targets and adapter folders are refused before launch, naming the key or
the file. The 2-process FSDP2 run against one process: tests/distributed/test_layouts.py
(llama_lora_fsdp)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemReader

from sdnet_trainer import Trainer, compose
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export import ExportArgs, export
from sdnet_trainer.export.peft import check_lora_args
from sdnet_trainer.models import build_model
from sdnet_trainer.models.base_fingerprint import base_fingerprint
from sdnet_trainer.models.init import allocate, build_deferred, materialize, without_parameters
from sdnet_trainer.models.llama.hf import load_hf_weights
from sdnet_trainer.models.lora import base_name, base_state, init_adapters, is_adapted
from sdnet_trainer.preflight import validate
from sdnet_trainer.serve.args import ServeArgs
from sdnet_trainer.serve.language import LanguageModel
from sdnet_trainer.serve.model import load_served
from tests.support import tiny_llama_config

transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")
peft = pytest.importorskip("peft", reason="the lora extra is not installed")

VOCAB = 96
PROJECTIONS = ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    """A tiny transformers Llama saved as a Hugging Face folder: the base the runs adapt."""
    folder = tmp_path_factory.mktemp("hf_base")
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=VOCAB, intermediate_size=48, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # transformers starts norms at one: move them, so a missed one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


def _run(base: Path, *extra: str) -> list[str]:
    return [
        "+recipe=llama3_debug",
        f"model.weights=hf:{base}",
        "model.lora.enabled=true",
        "model.lora.r=4",
        f"data.vocab_size={VOCAB}",
        "data.seq_len=16",
        "data.train_size=64",
        "data.val_size=8",
        "optim.lr=0.05",
        "parallel=ddp",
        "loop.global_batch_size=8",
        "loop.eval_at_end=false",
        "logging.trackers=[]",
        "logging.flops=false",
        *extra,
    ]


class GradRecorder(Trainer):
    """Notes which parameters hold a gradient after each backward."""

    def forward_backward(self, batch, *, count, sync):
        loss = super().forward_backward(batch, count=count, sync=sync)
        self.with_grad = {n for n, p in self.model.named_parameters() if p.grad is not None}
        return loss


def _tokens(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))


def _fit(overrides: list[str], run_dir: Path, *, vocab: int = VOCAB) -> dict:
    cfg = compose(overrides)
    validate(cfg, world_size=1)
    trainer = GradRecorder(cfg, output_dir=run_dir)
    trainer.fit()
    model = trainer.model.eval()
    with torch.no_grad():
        logits = model(_tokens(vocab))
    record = {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "trainable": {n for n, p in model.named_parameters() if p.requires_grad},
        "with_grad": trainer.with_grad,
        "optimizer": {id(p) for group in trainer.optimizer.param_groups for p in group["params"]},
        "ids": {id(p): n for n, p in model.named_parameters()},
        "logits": logits,
        "dir": run_dir,
    }
    trainer.close()
    return record


@pytest.fixture(scope="module")
def lora_run(hf_base, tmp_path_factory) -> dict:
    """4 steps of LoRA on every projection (all-linear), checkpointed at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("lora_run")
    return _fit(_run(hf_base, "loop.max_steps=4", "checkpoint.every_n_steps=2"), run_dir)


@pytest.fixture(scope="module")
def dora_run(hf_base, tmp_path_factory) -> dict:
    """2 steps of DoRA on the attention's query and value projections."""
    extra = [
        "loop.max_steps=2",
        "model.lora.use_dora=true",
        "model.lora.target_modules=[q_proj,v_proj]",
    ]
    return _fit(_run(hf_base, *extra), tmp_path_factory.mktemp("dora_run"))


def _checkpoint(run: dict, step: int) -> Path:
    return run["dir"] / "checkpoints" / f"step_{step:08d}"


# ---------------------------------------------------------------------- the adapters in the model


def test_adapters_wrap_the_mapped_layers_and_freeze_the_base():
    cfg = compose(["model=llama3_debug", "model.lora.enabled=true", "model.lora.r=4"])
    cfg.model.lora.target_modules = ["q_proj", "down_proj"]
    with torch.device("meta"):  # what the dry run sees: trainable and frozen by requires_grad
        model = build_model(cfg.model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"blocks.{i}.{layer}.lora_{ab}.default.weight"
        for i in range(2)
        for layer in ("attn.wq", "mlp.w2")
        for ab in "AB"
    }
    assert "blocks.0.attn.wq.base_layer.weight" in dict(model.named_parameters())
    assert model.get_parameter("blocks.0.attn.wq.lora_A.default.weight").shape == (4, 64)
    assert is_adapted(model) and not is_adapted(build_model(compose(["model=llama3_debug"]).model))
    # all-linear: the seven projections of every block, not the embedding or the output layer;
    # DoRA adds a magnitude per output channel.
    cfg.model.lora.target_modules, cfg.model.lora.use_dora = ["all-linear"], True
    with torch.device("meta"):
        model = build_model(cfg.model)
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert wrapped == {f"blocks.{i}.{m}" for i in range(2) for m in _layers()}
    assert model.get_parameter("blocks.1.mlp.w1.lora_magnitude_vector.default.weight").shape == (
        176,
    )
    assert not model.head.weight.requires_grad and not model.embed.tok.weight.requires_grad


def _layers() -> list[str]:
    return [f"{'attn' if p in ('wq', 'wk', 'wv', 'wo') else 'mlp'}.{p}" for p in PROJECTIONS]


@pytest.mark.parametrize("dora", [False, True])
def test_a_meta_build_initialises_the_adapters_like_the_cpu_build(dora):
    """Base and adapters (peft's draws: nn.Linear's construction, then A kaiming-uniform and B
    zero; DoRA's magnitudes from the base rows) bitwise those of a CPU build of the same seed."""
    cfg = compose(["model=llama3_debug", "model.lora.enabled=true", f"model.lora.use_dora={dora}"])
    torch.manual_seed(3)
    cpu = build_model(cfg.model).state_dict()
    torch.manual_seed(3)
    model, steps = build_deferred(lambda: build_model(cfg.model), on_meta=True)
    assert steps is not None
    allocate(model, torch.device("cpu"))
    torch.manual_seed(3)
    materialize(steps)
    init_adapters(model)
    assert model.state_dict().keys() == cpu.keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, cpu[name]), name
    assert cpu["blocks.0.attn.wq.lora_B.default.weight"].abs().sum() == 0  # B starts at zero


def test_the_hugging_face_reader_reads_the_base_under_its_own_names(hf_base):
    assert base_name("blocks.0.attn.wq.base_layer.weight") == "blocks.0.attn.wq.weight"
    assert base_name("blocks.0.attn.wq.lora_A.default.weight") is None
    assert base_name("blocks.0.attn.wq.lora_magnitude_vector.default.weight") is None
    assert base_name("norm.weight") == "norm.weight"
    cfg = compose(_run(hf_base))
    plain = build_model(compose(_run(hf_base, "model.lora.enabled=false")).model)
    load_hf_weights(plain, hf_base)
    # Sharded-style: meta build, allocated, the folder's check and load, then the adapters.
    model, steps = build_deferred(lambda: build_model(cfg.model), on_meta=True)
    allocate(model, torch.device("cpu"))
    materialize(without_parameters(steps))
    load_hf_weights(model, hf_base)
    init_adapters(model)
    assert base_state(model).keys() == plain.state_dict().keys()
    for name, value in plain.state_dict().items():
        assert torch.equal(base_state(model)[name], value), name
    with torch.no_grad():  # B = 0: the adapted model computes the base model's logits
        torch.testing.assert_close(model(_tokens()), plain(_tokens()), rtol=0, atol=0)


# ---------------------------------------------------------------------- training and checkpoints


@pytest.mark.full  # trains 4 steps (lora_run), about 3 s
def test_only_the_adapters_train_and_are_checkpointed(lora_run, hf_base):
    adapters = {n for n in lora_run["params"] if base_name(n) is None}
    assert len(adapters) == 2 * 7 * 2  # A and B of 7 projections in each of the 2 blocks
    assert lora_run["trainable"] == adapters
    # The frozen base had no gradient in any backward, and the optimizer holds only adapters.
    assert lora_run["with_grad"] == adapters
    assert {lora_run["ids"][i] for i in lora_run["optimizer"]} == adapters
    plain = build_model(compose(_run(hf_base, "model.lora.enabled=false")).model)
    load_hf_weights(plain, hf_base)
    base = base_state_of(lora_run["params"])
    for name, value in plain.state_dict().items():
        assert torch.equal(base[name], value), name  # the base is the folder's, untouched
    # The checkpoint: the adapters and their optimizer state, no copy of the frozen base.
    keys = set(FileSystemReader(str(_checkpoint(lora_run, 4))).read_metadata().state_dict_metadata)
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert model_keys == adapters
    state = {k.split(".", 2)[2] for k in keys if k.startswith("optim.state.")}
    assert {s.rsplit(".", 1)[0] for s in state} == adapters  # exp_avg, exp_avg_sq, step of each
    manifest = json.loads((_checkpoint(lora_run, 4) / "manifest.json").read_text())
    assert manifest["meta"]["lora"] == {
        "model_entry": "adapters",
        "base": f"hf:{hf_base}",
        "base_fingerprint": base_fingerprint(hf_base),
    }


def base_state_of(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {base_name(n): v for n, v in params.items() if base_name(n) is not None}


@pytest.mark.full  # the 4-step run and 2 steps resumed
def test_a_resumed_lora_run_continues_bitwise(lora_run, hf_base, tmp_path):
    """From step 2's checkpoint (adapters and their AdamW state; the base from the folder again)
    to step 4: the uninterrupted run's adapters, bit for bit."""
    resumed = _fit(
        _run(hf_base, "loop.max_steps=4", f"checkpoint.resume={_checkpoint(lora_run, 2)}"),
        tmp_path,
    )
    for name, value in lora_run["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    assert torch.equal(resumed["logits"], lora_run["logits"])


@pytest.mark.full  # trains 2 steps, about 2 s
def test_adapters_are_refused_by_a_changed_base_on_resume_and_export(hf_base, tmp_path):
    """The base folder replaced in place by another model of the same architecture (the same
    names, shapes and sizes, other values: a newer release, another fine-tune): resuming and
    exporting the LoRA checkpoint trained on it refuse, naming the checkpoint and the folder."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    base = Path(shutil.copytree(hf_base, tmp_path / "base"))
    run = _fit(_run(base, "loop.max_steps=2", "checkpoint.save_on_exit=true"), tmp_path / "run")
    checkpoint = _checkpoint(run, 2)
    (file,) = base.glob("*.safetensors")
    with safe_open(str(file), framework="pt") as f:
        tensors = {name: f.get_tensor(name) * 1.01 for name in f.keys()}  # noqa: SIM118
        metadata = f.metadata()
    save_file(tensors, file, metadata=metadata)
    what = rf"its LoRA adapters were trained on model\.weights=hf:{base}, and the folder of "
    what += rf"model\.weights=hf:{base} is no longer that base: {file.name}: the same tensors"
    resume = _run(base, "loop.max_steps=4", f"checkpoint.resume={checkpoint}")
    with pytest.raises(ConfigError, match=rf"^checkpoint\.resume={checkpoint}: {what}"):
        _fit(resume, tmp_path / "resumed")
    with pytest.raises(ConfigError, match=rf"^checkpoint='{checkpoint}': {what}"):
        export(ExportArgs(checkpoint=str(checkpoint), format="peft", out=str(tmp_path / "a")))


# ---------------------------------------------------------------------- export


@pytest.mark.full  # the runs, each exported twice
@pytest.mark.parametrize("run", ["lora_run", "dora_run"])
def test_the_peft_folder_loads_on_the_transformers_base(request, hf_base, tmp_path, run):
    """format=peft: peft.PeftModel.from_pretrained on the transformers base gives our logits;
    format=hf merge_lora=true: a transformers folder equal to that base + adapter."""
    record = request.getfixturevalue(run)
    checkpoint = max((record["dir"] / "checkpoints").glob("step_*"))
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    export(ExportArgs(checkpoint=str(checkpoint), format="peft", out=str(adapter)))
    export(ExportArgs(checkpoint=str(checkpoint), format="hf", merge_lora=True, out=str(merged)))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in adapter.iterdir()
    }
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_base) and config["r"] == 4
    base = transformers.LlamaForCausalLM.from_pretrained(hf_base)
    tuned = peft.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        theirs = tuned(_tokens()).logits
        torch.testing.assert_close(theirs, record["logits"], rtol=0, atol=1e-5)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
        torch.testing.assert_close(reloaded(_tokens()).logits, theirs, rtol=0, atol=1e-5)
    # The merged folder's config.yaml builds the plain model its weights fit.
    written = OmegaConf.load(merged / "config.yaml")
    assert written.model.lora.enabled is False


def test_serving_a_lora_checkpoint_serves_the_merged_model(lora_run):
    """The server merges a LoRA run's adapters into its base: the run's logits, no peft layer
    left, and the Llama's cached decoder (the transformers model of its weights) generates what
    a step-by-step greedy decode of the trained model does."""
    served, _ = load_served(ServeArgs(checkpoint=str(_checkpoint(lora_run, 4)), device="cpu"))
    assert isinstance(served, LanguageModel) and served.decoder is not None
    model = served.runner.model
    assert not is_adapted(model)
    assert not any(isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) for m in model.modules())
    torch.testing.assert_close(served.runner(_tokens()), lora_run["logits"], rtol=0, atol=1e-5)
    prompt = _tokens()[0, :5].tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():  # greedy, one token at a time, on the full sequence (no cache)
        for _ in range(6):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    job = served.job(prompt, max_new_tokens=6, temperature=0.0, seed=None)
    assert served.run([job]) == [ids[0, 5:].tolist()]


def test_export_refuses_formats_that_do_not_fit_the_checkpoint():
    with pytest.raises(ConfigError, match="merge_lora=true .*format=peft"):
        check_lora_args(["hf"], lora=True, merge_lora=False, checkpoint="ck")
    with pytest.raises(ConfigError, match="format=peft writes a LoRA run's adapters"):
        check_lora_args(["peft"], lora=False, merge_lora=False, checkpoint="ck")
    with pytest.raises(ConfigError, match="holds no adapters"):
        check_lora_args(["pt"], lora=False, merge_lora=True, checkpoint="ck")


@pytest.mark.full  # the 4-step run, exported
def test_a_peft_folder_starts_the_adapters(lora_run, hf_base, tmp_path):
    """model.lora.adapter: an exported folder's values, in a CPU build and in the meta build's
    sharded path (init_adapters after the base's load); its shape comes from the folder."""
    checkpoint = _checkpoint(lora_run, 4)
    export(ExportArgs(checkpoint=str(checkpoint), format="peft", out=str(tmp_path / "a")))
    overrides = _run(hf_base, f"model.lora.adapter={tmp_path / 'a'}", "model.lora.r=16")
    validate(compose(overrides), world_size=1)
    cfg = compose(overrides)
    cpu = build_model(cfg.model)
    model, steps = build_deferred(lambda: build_model(cfg.model), on_meta=True)
    allocate(model, torch.device("cpu"))
    materialize(without_parameters(steps))
    load_hf_weights(model, hf_base)
    init_adapters(model)
    for name, value in lora_run["params"].items():
        if base_name(name) is None:
            assert torch.equal(model.state_dict()[name], value), name
            assert torch.equal(cpu.state_dict()[name], value), name


# ---------------------------------------------------------------------- a transformers model


@pytest.mark.full  # trains 2 steps and exports
def test_a_transformers_causal_lm_trains_its_adapters(tmp_path):
    """model=hf_causal_lm: peft's adapters in the transformers model under its own names; the
    base stays the seeded init, and the exported folder loads on that base with our logits."""
    folder = tmp_path / "config"
    tiny_llama_config(
        vocab_size=64, intermediate_size=48, max_position_embeddings=32
    ).save_pretrained(folder)
    overrides = [
        "model=hf_causal_lm",
        f"model.hf_config={folder}",
        "model.lora.enabled=true",
        "model.lora.r=2",
        "model.lora.target_modules=[q_proj,v_proj]",
        "data=tokens",
        "data.vocab_size=64",
        "data.seq_len=16",
        "data.train_size=32",
        "optim=sgd",
        "optim.lr=0.5",
        "loop.max_steps=2",
        "loop.global_batch_size=8",
        "loop.eval_at_end=false",
        "loop.eval_at_epoch_end=false",
        "logging.trackers=[]",
        "logging.flops=false",
    ]
    record = _fit(overrides, tmp_path / "run", vocab=64)
    assert record["with_grad"] == record["trainable"]
    assert record["trainable"] == {
        f"lm.model.layers.{i}.self_attn.{p}.lora_{ab}.default.weight"
        for i in range(2)
        for p in ("q_proj", "v_proj")
        for ab in "AB"
    }
    checkpoint = max((tmp_path / "run" / "checkpoints").glob("step_*"))
    export(ExportArgs(checkpoint=str(checkpoint), format="peft", out=str(tmp_path / "a")))
    torch.manual_seed(0)  # loop.seed: the run's random base
    base = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(folder)
    )
    tuned = peft.PeftModel.from_pretrained(base, tmp_path / "a").eval()
    with torch.no_grad():
        theirs = tuned(_tokens(64)).logits
    torch.testing.assert_close(theirs, record["logits"], rtol=0, atol=1e-5)
    # Served: the transformers model with the adapters merged in, generating with its cache.
    served, _ = load_served(ServeArgs(checkpoint=str(checkpoint), device="cpu"))
    assert isinstance(served, LanguageModel) and served.decoder is not None
    assert not is_adapted(served.runner.model)
    torch.testing.assert_close(served.runner(_tokens(64)), record["logits"], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- refused before launch


def test_targets_that_match_nothing_are_refused_naming_the_key(tmp_path):
    cfg = compose(
        ["model=llama3_debug", "model.lora.enabled=true", "model.lora.target_modules=[gate]"]
    )
    with pytest.raises(ConfigError, match=r"model.lora.target_modules.*'gate'.*q_proj"):
        validate(cfg, world_size=1)
    folder = tmp_path / "config"
    tiny_llama_config(vocab_size=64).save_pretrained(folder)
    cfg = compose(
        [
            "model=hf_causal_lm",
            f"model.hf_config={folder}",
            "data=tokens",
            "data.vocab_size=64",
            "data.seq_len=16",
            "model.lora.enabled=true",
            "model.lora.target_modules=[qkv_proj]",
        ]
    )
    with pytest.raises(ConfigError, match=r"model.lora.target_modules=\[qkv_proj\].*not found"):
        validate(cfg, world_size=1)


def test_an_adapter_folder_for_another_base_is_refused_naming_the_file(tmp_path):
    """A peft folder saved by peft itself for a transformers Llama of width 32, given to
    llama3_debug (width 64): refused before launch, naming adapter_model.safetensors, the tensor
    and both shapes."""
    config = tiny_llama_config(vocab_size=256, intermediate_size=48, max_position_embeddings=64)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft.get_peft_model(transformers.LlamaForCausalLM(config), lora).save_pretrained(tmp_path)
    overrides = ["model=llama3_debug", "model.lora.enabled=true", f"model.lora.adapter={tmp_path}"]
    with pytest.raises(
        ConfigError,
        match=r"adapter_model.safetensors: tensor .*lora_A.weight has shape \[4, 32\].*\[4, 64\]",
    ):
        validate(compose(overrides), world_size=1)


@pytest.mark.parametrize(
    "change, named",
    [
        ("{not json", "adapter_config.json is not valid JSON"),
        ({"peft_type": "IA3"}, "field 'peft_type' is 'IA3'"),
        ({"r": "four"}, "field 'r' is 'four'"),
        ({"modules_to_save": ["lm_head"]}, "field 'modules_to_save'"),
        ({"target_modules": ["qkv"]}, "adapter_config.json: field 'target_modules' names 'qkv'"),
    ],
)
def test_a_malformed_adapter_folder_is_refused_naming_the_file(tmp_path, change, named):
    folder = tmp_path / "adapter"
    folder.mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    text = change if isinstance(change, str) else json.dumps({**config, **change})
    (folder / "adapter_config.json").write_text(text)
    cfg = compose(["model=llama3_debug", "model.lora.enabled=true", f"model.lora.adapter={folder}"])
    with pytest.raises(ConfigError, match=named.replace("[", r"\[")):
        validate(cfg, world_size=1)


def test_unsupported_combinations_are_refused_naming_both_keys(tmp_path):
    lora = ["model=llama3_debug", "model.lora.enabled=true"]
    with pytest.raises(ConfigError, match="model.lora.enabled=true with parallel.tp=2"):
        validate(compose([*lora, "parallel.tp=2"]), world_size=2)
    with pytest.raises(ConfigError, match="model.lora.enabled=true with model.ema.enabled"):
        validate(compose([*lora, "model.ema.enabled=true"]), world_size=1)
    with pytest.raises(ConfigError, match="model.name=gpt takes no adapters"):
        validate(compose(["model=gpt_tiny", "model.lora.enabled=true"]), world_size=1)
    with pytest.raises(ConfigError, match="model.lora.adapter=.* needs model.lora.enabled=true"):
        validate(compose(["model=llama3_debug", f"model.lora.adapter={tmp_path}"]), world_size=1)


@pytest.mark.full  # trains 2 steps and exports twice
def test_adapters_on_a_mixture_of_experts_load_on_the_transformers_qwen3_moe(tmp_path):
    """model.name=moe from a transformers Qwen3-MoE folder, adapters on its attention: the peft
    folder loads on that base with our logits, the merged folder equals base + adapter."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    base = tmp_path / "qwen3_moe"
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(base)
    overrides = [
        "model=moe_debug", f"model.weights=hf:{base}", "model.lora.enabled=true",
        "model.lora.r=4", "data=tokens", f"data.vocab_size={VOCAB}", "data.seq_len=16",
        "data.train_size=64", "data.val_size=8", "optim=adamw", "optim.lr=0.05",
        "loop.global_batch_size=8", "loop.max_steps=2", "loop.eval_at_end=false",
        "logging.trackers=[]", "logging.flops=false", "checkpoint.save_on_exit=true",
    ]  # fmt: skip
    record = _fit(overrides, tmp_path / "run")
    assert {n.split(".lora_")[0] for n in record["trainable"]} == {
        f"blocks.{i}.attn.{p}" for i in range(2) for p in ("wq", "wk", "wv", "wo")
    }
    checkpoint = max((tmp_path / "run" / "checkpoints").glob("step_*"))
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    export(ExportArgs(checkpoint=str(checkpoint), format="peft", out=str(adapter)))
    export(ExportArgs(checkpoint=str(checkpoint), format="hf", merge_lora=True, out=str(merged)))
    tuned = peft.PeftModel.from_pretrained(
        transformers.Qwen3MoeForCausalLM.from_pretrained(base), adapter
    ).eval()
    with torch.no_grad():
        theirs = tuned(_tokens()).logits
        torch.testing.assert_close(theirs, record["logits"], rtol=0, atol=1e-5)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
        torch.testing.assert_close(reloaded(_tokens()).logits, theirs, rtol=0, atol=1e-5)
