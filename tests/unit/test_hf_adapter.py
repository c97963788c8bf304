"""The families' state-dict adapters with DCP's Hugging Face reader and writer, in one process:
``format=hf`` as DCP's writer lays it out (the files and index transformers reads, the shard
limit), an export loaded back by the family's reader bitwise (Llama with tied embeddings, the
MoE's experts per expert), a tied output layer read once, a folder's dtype converted as it is
read, and the reader's metadata taken from the checked index (a stray ``*.safetensors`` in the
folder is never opened). Each rank's reads under FSDP, expert and pipeline parallelism:
tests/distributed/test_hf_load.py; a rank's blocks on a fake process group:
tests/unit/test_moe_model.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from sdnet_trainer.config import compose
from sdnet_trainer.export.hf import write_hf
from sdnet_trainer.models import build_model
from sdnet_trainer.models.hf_folder import INDEX_FILE, read_folder, stored_tensors
from sdnet_trainer.models.llama.state_dict_adapter import to_hf
from sdnet_trainer.models.lora import base_state
from sdnet_trainer.models.registry import hf_weights_reader, model_family
from tests.support import tiny_llama_config

transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")

LLAMA_TIED = ["model=llama3_debug", "model.llama.tie_embeddings=true"]
MOE = ["model=moe_debug"]


def _model(overrides: list[str], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = build_model(compose(overrides).model)
    with torch.no_grad():  # norms away from one, so a norm left at its init shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _read(overrides: list[str], folder) -> nn.Module:
    """The model of ``folder``, read as the Trainer reads it: checked on the meta build, then
    loaded into a build of another seed."""
    cfg = compose([*overrides, f"model.weights=hf:{folder}"])
    reader = hf_weights_reader(cfg.model)
    assert reader is not None
    with torch.device("meta"):
        reader.check(build_model(cfg.model))
    torch.manual_seed(123)
    model = build_model(cfg.model)
    reader.load(model)
    return model


@pytest.mark.parametrize("family, overrides", [("llama", LLAMA_TIED), ("moe", MOE)])
def test_an_export_reads_back_bitwise(tmp_path, family, overrides):
    model = _model(overrides, seed=0)
    write_hf(model, tmp_path, family=model_family(family), shard_bytes=40_000)
    loaded = _read(overrides, tmp_path)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_the_writer_lays_out_what_transformers_reads(tmp_path):
    from safetensors import safe_open

    model = _model(LLAMA_TIED, seed=0).eval()
    limit = 40_000
    written = write_hf(model, tmp_path, family=model_family("llama"), shard_bytes=limit)
    shards = sorted(name for name in written if name.endswith(".safetensors"))
    assert len(shards) > 2
    last = len(shards)
    assert shards == [f"model-{i:05d}-of-{last:05d}.safetensors" for i in range(1, last + 1)]
    # The folder holds the shards, their index and config.json: no DCP metadata of its own.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*shards, INDEX_FILE, "config.json"]
    )
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    tensors = to_hf(model.state_dict(), tied=True).tensors
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as the embedding
    assert index["weight_map"].keys() == tensors.keys()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for shard in shards:
        with safe_open(str(tmp_path / shard), framework="pt") as f:
            assert f.metadata()["format"] == "pt"  # transformers refuses a file without it
            names = set(f.keys())  # noqa: SIM118 (not iterable)
            size = sum(math.prod(f.get_slice(n).get_shape()) * 4 for n in names)
        assert names == {n for n, file in index["weight_map"].items() if file == shard}
        assert size <= limit or len(names) == 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=0, atol=1e-5)


def _tied_folder(folder, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    config = tiny_llama_config(
        vocab_size=96, intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=True
    )
    hf = transformers.LlamaForCausalLM(config).to(dtype)
    hf.save_pretrained(folder, max_shard_size="20KB")
    return hf


def test_a_tied_output_layer_is_read_once_and_a_stray_file_never(tmp_path):
    _tied_folder(tmp_path)
    stored = stored_tensors(tmp_path)
    assert "lm_head.weight" not in stored
    # Not named by the index: the stock reader would open every *.safetensors in the folder.
    (tmp_path / "model-00009-of-00009.safetensors").write_bytes(b"not a safetensors file")
    cfg = compose(["model=llama3_debug", f"model.weights=hf:{tmp_path}"])
    model = build_model(cfg.model)
    assert model.head.weight is model.embed.tok.weight
    read = read_folder(to_hf(base_state(model), tied=True), tmp_path, stored)
    assert read == sum(math.prod(entry.shape) * 4 for entry in stored.values())  # each once


def test_a_bf16_folder_is_converted_to_the_models_dtype_as_it_is_read(tmp_path):
    hf = _tied_folder(tmp_path, torch.bfloat16)
    loaded = _read(["model=llama3_debug"], tmp_path)
    assert loaded.embed.tok.weight.dtype == torch.float32
    torch.testing.assert_close(
        loaded.embed.tok.weight, hf.model.embed_tokens.weight.float(), rtol=0, atol=0
    )
