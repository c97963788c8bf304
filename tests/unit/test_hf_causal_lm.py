"""model=hf_causal_lm: a transformers causal LM built from a config.json or loaded from a saved
folder (a tiny Llama, no download), its decoder layers as the parallel blocks, and the layouts it
does not take refused before launch with the reason. Training under FSDP2 on 2 processes:
tests/distributed/test_hf_causal_lm.py."""

from __future__ import annotations

import builtins
import importlib.util
from pathlib import Path

import pytest
import torch

from sdnet_trainer.config import compose
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models import build_model
from sdnet_trainer.models.hf_causal_lm import HFCausalLM
from sdnet_trainer.models.parallel_spec import parallel_blocks
from sdnet_trainer.preflight import validate
from tests.support import tiny_llama_config

pytest.importorskip("transformers")  # the tiny model is built by transformers

VOCAB, CONTEXT = 64, 32


def tiny_config(folder: Path):
    """A tiny Llama's config.json in ``folder``, which is returned."""
    tiny_llama_config(
        vocab_size=VOCAB, intermediate_size=64, max_position_embeddings=CONTEXT
    ).save_pretrained(folder)
    return folder


def hf_run(folder: Path) -> list[str]:
    """A 3-step run of the model of ``folder`` on the synthetic token language."""
    return [
        "dist.device=cpu",
        "model=hf_causal_lm",
        f"model.hf_config={folder}",
        "data=tokens",
        f"data.vocab_size={VOCAB}",
        "data.seq_len=16",
        "data.train_size=64",
        "optim=sgd",
        "optim.lr=0.5",
        "sched=constant",
        "loop.max_steps=3",
        "loop.global_batch_size=8",
        "loop.eval_at_end=false",
        "loop.eval_at_epoch_end=false",
        "logging.trackers=[jsonl]",
        "checkpoint.save_on_exit=false",
    ]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_config(tmp_path_factory.mktemp("tiny_llama_config"))


def test_builds_from_a_config_or_saved_weights_and_returns_the_logits(folder, tmp_path):
    cfg = compose(hf_run(folder))
    torch.manual_seed(0)
    model = build_model(cfg.model)
    assert isinstance(model, HFCausalLM) and model.seq_len == CONTEXT
    blocks = parallel_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
    assert blocks[1] is model.lm.model.layers[1]
    tokens = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        logits = model(tokens)
        torch.testing.assert_close(logits, model.lm(input_ids=tokens).logits)
    assert logits.shape == (2, 9, VOCAB)
    # On the meta device too (the dry run, the FLOPs count): shapes only, no values read.
    with torch.device("meta"):
        meta = build_model(cfg.model)
        assert meta(torch.zeros(2, 9, dtype=torch.int64)).shape == (2, 9, VOCAB)
    model.lm.save_pretrained(tmp_path / "saved")
    loaded = build_model(
        compose([*hf_run(folder)[:2], f"model.weights=hf:{tmp_path / 'saved'}"]).model
    )
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, msg=key)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["parallel=fsdp", "parallel.tp=2"], "parallel.tp=2, parallel.pp=1: a transformers model"),
        (
            ["parallel=fsdp", "parallel.pp=2", "parallel.pipeline.microbatches=2"],
            "parallel.tp=1, parallel.pp=2: a transformers model",
        ),
    ],
)
def test_tensor_and_pipeline_parallel_are_refused_before_launch_saying_why(
    folder, overrides, words
):
    with pytest.raises(ConfigError) as err:
        validate(compose([*hf_run(folder), *overrides]), world_size=2)
    message = str(err.value)
    assert words in message
    assert "tensor-parallel plan" in message and "pipeline split" in message
    assert "parallel.tp=1 and parallel.pp=1" in message


def test_sources_that_cannot_serve_are_refused_naming_the_key(folder, tmp_path):
    run = hf_run(folder)
    cases = [
        ([r for r in run if "hf_config" not in r], "needs model.hf_config=PATH"),
        ([*run, f"model.weights=hf:{folder}"], "give one"),
        ([run[0], run[1], f"model.weights={folder}"], "model.weights=hf:PATH"),
        ([run[0], run[1], f"model.hf_config={tmp_path}"], "model.hf_config="),
        ([*run, "data.seq_len=33"], "data.seq_len=33 is longer than the model's context (32"),
        ([*run, "data.vocab_size=65"], "data.vocab_size=65 is larger than the model's vocab"),
    ]
    for overrides, words in cases:
        with pytest.raises(ConfigError) as err:
            cfg = compose(overrides)
            validate(cfg, world_size=1)
            build_model(cfg.model)
        assert words in str(err.value), (overrides, str(err.value))


def test_without_transformers_the_error_names_the_llm_extra(folder, monkeypatch):
    cfg = compose(hf_run(folder))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"sdnet_trainer\[llm\]"):
        validate(cfg, world_size=1)
    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers":
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(ConfigError, match=r"model.name=hf_causal_lm needs .*sdnet_trainer\[llm\]"):
        build_model(cfg.model)
