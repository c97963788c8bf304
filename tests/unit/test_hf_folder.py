"""What a Hugging Face folder declares, against the model built on the meta device, for both
families that read such folders (the Llama's reader, and transformers' causal LMs through
``check_folder`` and transformers' own loading report); the fields of config.json the run uses
(tied embeddings against the files, the stored dtype); and the per-rank memory check before
allocating (``training/fits.py``). The refusals on 1 and 2 processes:
tests/distributed/test_hf_refusals.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from sdnet_trainer.config import compose
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models import build_model
from sdnet_trainer.models.hf_causal_lm import build_hf_causal_lm, check_folder
from sdnet_trainer.models.llama.hf import check_hf_weights
from sdnet_trainer.training import fits
from tests.support import LYING_FOLDERS, lying_hf_folders, tiny_llama_config

transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return lying_hf_folders(tmp_path_factory.mktemp("hf"))


def _llama_check(folder) -> None:
    cfg = compose(["model=llama3_debug", f"model.weights=hf:{folder}"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    check_hf_weights(model, folder)


def _hf_causal_lm_build(folder):
    cfg = compose(["model=hf_causal_lm", f"model.weights=hf:{folder}"])
    return build_hf_causal_lm(cfg.model)


@pytest.mark.parametrize("name", sorted(LYING_FOLDERS))
def test_each_family_refuses_a_lying_folder_naming_the_tensor_and_file(folders, name):
    with pytest.raises(ConfigError) as llama:
        _llama_check(folders[name])
    with pytest.raises(ConfigError) as hf:
        _hf_causal_lm_build(folders[name])
    for err in (llama, hf):
        for word in LYING_FOLDERS[name]:
            assert word in str(err.value), (name, str(err.value))
    if name == "renamed":
        # The same elements under another name is what transformers' own renaming on load looks
        # like: the headers' check leaves it to transformers' loading report, which refuses it.
        config = transformers.AutoConfig.from_pretrained(str(folders[name]))
        check_folder(transformers, config, folders[name])
        assert "transformers' loading report" in str(hf.value)


def test_the_unedited_folder_passes_both(folders):
    _llama_check(folders["ok"])
    model = _hf_causal_lm_build(folders["ok"])
    assert sum(p.numel() for p in model.parameters()) > 0


def _write(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_the_stored_dtype_field_names_what_the_files_hold(folders, tmp_path):
    import shutil

    folder = shutil.copytree(folders["ok"], tmp_path / "dtype")
    _write(folder, dtype="bfloat16")
    for check in (_llama_check, _hf_causal_lm_build):
        with pytest.raises(ConfigError, match="field 'dtype' is 'bfloat16', but the weight files"):
            check(folder)
    _write(folder, dtype="int8")
    with pytest.raises(ConfigError, match="field 'dtype' is 'int8', expected one of"):
        _llama_check(folder)


def test_tied_embeddings_against_a_stored_output_layer(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=96, intermediate_size=48, tie_word_embeddings=True)
    folder = tmp_path / "tied"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    _llama_check(folder)  # stored once, as the embedding
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in tensors
    # An export that stores both names, with the same values: accepted.
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _llama_check(folder)
    # The config says tied, and the files hold another output layer: refused.
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="field 'tie_word_embeddings' is true, but"):
        _llama_check(folder)
    # Untied in config.json, with no output layer stored: its tensor is missing.
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _write(folder, tie_word_embeddings=False)
    with pytest.raises(ConfigError, match="lacks tensors .* lm_head.weight"):
        _llama_check(folder)


# ---------------------------------------------------------------------- memory before allocating


@pytest.mark.parametrize(
    "optim, per_element",
    [
        (["optim=sgd", "optim.momentum=null"], 0),
        (["optim=sgd", "optim.momentum=0.9"], 4),
        (["optim=adamw"], 8),
    ],
)
def test_the_optimizer_state_is_counted_by_a_step_on_meta(optim, per_element):
    assert fits.optimizer_bytes_per_element(compose(optim)) == per_element


def test_a_layout_that_cannot_fit_is_refused_with_the_figure(monkeypatch):
    with torch.device("meta"):
        part = nn.Linear(1024, 1024, bias=False)  # 4 MiB of fp32 weights
    # AdamW: weights, gradients, two moments; 4 MiB each.
    cfg = compose(["optim=adamw", "parallel.memory_per_rank_gib=0.01"])
    with pytest.raises(ConfigError) as err:
        fits.check_fits([part], cfg, torch.device("cpu"), dp=1)
    message = str(err.value)
    assert "training state needs 16.00 MiB" in message and "optim 8.00 MiB" in message
    assert "more than its 10.24 MiB (parallel.memory_per_rank_gib=0.01)" in message
    assert "parallel=fsdp" in message and "parallel.fsdp.cpu_offload=true" in message
    fits.check_fits(
        [part],
        compose(["optim=adamw", "parallel.memory_per_rank_gib=1"]),
        torch.device("cpu"),
        dp=1,
    )
    # ZeRO-1 keeps a dp-th of the optimizer state on each rank.
    zero = compose(["optim=adamw", "parallel=zero1"])
    assert fits.required_bytes([part], zero, dp=4)["optim"] == 2 << 20
    # Measured on the host: the node's ranks share its available memory.
    monkeypatch.setattr(fits, "_host_available", lambda: 8 << 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert fits.available_bytes(compose([]), torch.device("cpu")) == (
        2 << 30,
        "the host's available memory, shared by the node's 4 ranks",
    )


def test_the_data_against_config_json_names_its_field(folders):
    from sdnet_trainer.preflight import validate

    base = ["+recipe=llama3_debug", f"model.weights=hf:{folders['ok']}", "data.seq_len=32"]
    source = f"({folders['ok'] / 'config.json'})"
    with pytest.raises(ConfigError) as err:
        validate(compose([*base, "data.vocab_size=128"]), world_size=1)
    assert f"data.vocab_size=128 differs from the model's vocab_size=96 {source}" in str(err.value)
    with pytest.raises(ConfigError) as err:
        validate(compose([*base, "data.vocab_size=96", "data.seq_len=128"]), world_size=1)
    assert f"context max_position_embeddings=64 {source}" in str(err.value)


def test_the_trainer_starts_a_transformers_model_from_the_folders_weights(folders, tmp_path):
    """model=hf_causal_lm model.weights=hf:PATH through the Trainer's set-up: transformers loads
    the folder in the family's builder (not on the meta device, where from_pretrained refuses to
    run), and training starts from the stored weights."""
    from safetensors.torch import load_file

    from sdnet_trainer import Trainer
    from sdnet_trainer.distributed import distributed_session

    cfg = compose(
        [
            "+recipe=llama3_debug",
            "model=hf_causal_lm",
            f"model.weights=hf:{folders['ok']}",
            "dist.device=cpu",
            "parallel=ddp",
            "data.vocab_size=96",
            "data.seq_len=32",
            "data.train_size=16",
            "data.val_size=8",
            "loop.global_batch_size=8",
            "logging.trackers=[]",
        ]
    )
    stored = {}
    for file in folders["ok"].glob("*.safetensors"):
        stored.update(load_file(file))
    with distributed_session(cfg.dist) as env:
        trainer = Trainer(cfg, output_dir=tmp_path, env=env)
        try:
            trainer.setup()
            state = trainer.model.state_dict()
            for name, value in stored.items():
                torch.testing.assert_close(state[f"lm.{name}"], value, rtol=0, atol=0)
        finally:
            trainer.close()
