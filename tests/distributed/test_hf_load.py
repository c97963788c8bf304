"""``model.weights=hf:PATH`` read by DCP's Hugging Face reader on 2 processes (gloo), through the
real Trainer's set-up: a tied Llama under FSDP2, a Llama in 2 pipeline stages (the ranks' state
dicts hold different names), and a Qwen3-MoE with its experts split over ``parallel.ep=2`` (and
the rest under FSDP2), from the hub's per-expert layout and from transformers 5's fused one.

In every case each element of each stored tensor is read exactly once over the two ranks (each
rank reads the blocks of its own shards, or its own stage, and nothing else: the tied output
layer not again, no expert another rank holds), and the weights the ranks then hold are bitwise
those one process loads. Every read is recorded where DCP reads it (``_hf_load_worker.py``); one
launch for all cases."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from sdnet_trainer.config import compose
from sdnet_trainer.models import build_model
from sdnet_trainer.models.registry import model_family
from tests.support import CPU, REPO, run_cli, tiny_llama_config

transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")

WORKER = REPO / "tests" / "distributed" / "_hf_load_worker.py"
DATA = [
    *CPU,
    "data.vocab_size=96",
    "data.seq_len=32",
    "data.train_size=32",
    "data.val_size=16",
    "loop.global_batch_size=8",
    "logging.trackers=[]",
    "model.ema.enabled=false",
]
PIPELINE = [
    "parallel=ddp",
    "parallel.pp=2",
    "parallel.pipeline.schedule=1F1B",
    "parallel.pipeline.microbatches=2",
]
QWEN3 = {
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
}
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _folders(root):
    torch.manual_seed(0)
    llama = tiny_llama_config(vocab_size=96, intermediate_size=48, max_position_embeddings=64)
    tied = tiny_llama_config(
        vocab_size=96, intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=True
    )
    qwen3 = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**QWEN3))
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "llama", max_shard_size="40KB")
    transformers.LlamaForCausalLM(tied).save_pretrained(root / "tied", max_shard_size="40KB")
    qwen3.save_pretrained(root / "qwen3", max_shard_size="40KB")
    qwen3.save_pretrained(root / "qwen3_fused", save_original_format=False)
    llama_run = ["+recipe=llama3_debug", *DATA]
    moe_run = ["+recipe=moe_debug", *DATA, "parallel.ep=2"]
    return {
        "llama_tied_fsdp": (root / "tied", llama_run),
        "llama_pp": (root / "llama", [*llama_run, *PIPELINE]),
        "moe_ep": (root / "qwen3", moe_run),
        "moe_ep_fused": (root / "qwen3_fused", moe_run),
    }


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_load")
    cases = {
        name: (folder, [*overrides, f"model.weights=hf:{folder}"])
        for name, (folder, overrides) in _folders(root).items()
    }
    (root / "cases.json").write_text(json.dumps({k: v for k, (_, v) in cases.items()}))
    launch = run_cli(
        [str(root), str(root / "cases.json")], cwd=root, nproc=2, script=WORKER, timeout=300
    )
    assert launch.returncode == 0, launch.output[-6000:]
    return {
        name: (folder, overrides, torch.load(root / f"{name}.pt", weights_only=False))
        for name, (folder, overrides) in cases.items()
    }


def _stored(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        tensors |= load_file(file)
    return tensors


@pytest.mark.parametrize("case", ["llama_tied_fsdp", "llama_pp", "moe_ep", "moe_ep_fused"])
def test_each_element_is_read_once_and_the_weights_are_one_processs(loads, case):
    folder, overrides, ranks = loads[case]
    stored = _stored(folder)
    times = {name: torch.zeros(value.shape, dtype=torch.int32) for name, value in stored.items()}
    for rank in ranks:
        for name, offsets, lengths in rank["reads"]:
            times[name][tuple(slice(o, o + n) for o, n in zip(offsets, lengths))] += 1
    for name, count in times.items():
        assert bool((count == 1).all()), (name, count.unique().tolist())
    total = sum(value.numel() for value in stored.values())
    for rank in ranks:
        read = sum(math.prod(lengths) for *_, lengths in rank["reads"])
        assert 0 < read < 0.75 * total, (read, total)  # about half: its shards or stage only
    if case.startswith("moe"):
        for held, rank in zip([{0, 1}, {2, 3}], ranks, strict=True):  # ep rank r: 2r, 2r + 1
            experts = {int(m[1]) for name, *_ in rank["reads"] if (m := _EXPERT.search(name))}
            assert experts <= held, experts
    cfg = compose(overrides)
    reference = build_model(cfg.model)
    family = model_family(cfg.model.name)
    assert family is not None and family.hf_weights is not None
    family.hf_weights.load(reference, folder)
    names = {name for name, _ in reference.named_parameters(remove_duplicate=False)}
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:
        for name, value in rank["tensors"].items():
            if name in names:
                assert torch.equal(merged.setdefault(name, value), value), name
    assert merged.keys() == names
    for name, value in reference.state_dict().items():
        if name in names:
            torch.testing.assert_close(merged[name], value, rtol=0, atol=0, msg=name)
