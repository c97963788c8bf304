"""sdnet_trainer.export in one process: custom Trainers, tied weights, token models, bad input."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from sdnet_trainer import Config, Trainer, compose
from sdnet_trainer.checkpoint import CheckpointManager, read_checkpoint
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.export import (
    EXIT_BAD_INPUT,
    EXTRA_HINT,
    ExportArgs,
    example_inputs,
    export,
    recorded_trainer,
    trainer_class,
    trainer_hint,
    training_config,
)
from sdnet_trainer.export.cli import main
from sdnet_trainer.recipes.custom_model import SpiralTrainer

pytest.importorskip("onnxruntime", reason="the export extra is not installed")
safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="the export extra is not installed"
)


@pytest.fixture(scope="module")
def spirals(tmp_path_factory):
    """A checkpoint of the custom_spirals recipe: a Trainer subclass with its own model and data."""
    run_dir = tmp_path_factory.mktemp("spirals")
    trainer = SpiralTrainer(
        compose(["+recipe=custom_spirals", "loop.max_steps=2", "loop.eval_at_end=false"]),
        output_dir=run_dir,
    )
    trainer.fit()
    expected = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    (checkpoint,) = (run_dir / "checkpoints").glob("step_*")
    return checkpoint, expected


SPIRAL_TRAINER = "sdnet_trainer.recipes.custom_model.SpiralTrainer"


def test_custom_trainer_exports_its_own_model(spirals, tmp_path):
    checkpoint, expected = spirals
    result = export(
        ExportArgs(
            checkpoint=str(checkpoint), format="pt,onnx", out=str(tmp_path), trainer=SPIRAL_TRAINER
        )
    )
    assert [p.name for p in result.files] == ["config.yaml", "model.onnx", "model.pt"]
    assert result.max_abs_diff["onnx"] < 1e-4  # traced on the spiral points of its validation set
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state[name], value), name


def test_a_custom_model_needs_trainer_naming_the_recorded_class(spirals, tmp_path, capsys):
    checkpoint, _ = spirals
    # sdnet_trainer.Trainer cannot build the spiral MLP; the recorded class is not imported.
    assert main([f"checkpoint={checkpoint}", f"out={tmp_path / 'out'}"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"pass trainer={SPIRAL_TRAINER}" in err
    assert not (tmp_path / "out").exists()


def test_a_script_trainer_is_named_through_the_config(spirals):
    checkpoint, _ = spirals
    ckpt = read_checkpoint(checkpoint)
    cfg = training_config(ckpt)
    assert recorded_trainer(ckpt, cfg) == SPIRAL_TRAINER
    # Never imported: export rebuilds with this package's Trainer unless trainer= names a class.
    assert trainer_class(ckpt, cfg, None) is Trainer
    assert trainer_class(ckpt, cfg, SPIRAL_TRAINER) is SpiralTrainer
    # launch(SpiralTrainer) from `python recipes/custom_model.py` records the class as
    # __main__.SpiralTrainer: the config's trainer._target_ names it.
    ckpt.meta["trainer"] = "__main__.SpiralTrainer"
    assert recorded_trainer(ckpt, cfg) == SPIRAL_TRAINER
    ckpt.meta["trainer"] = "__main__.OtherTrainer"
    assert "trainer=my_package.my_module.OtherTrainer" in trainer_hint(recorded_trainer(ckpt, cfg))


class TiedTokenTrainer(Trainer):
    """A language model whose output layer shares the embedding's weight."""

    def build_model(self) -> nn.Module:
        data = self.cfg.data
        model = nn.Sequential(
            nn.Embedding(data.vocab_size, 8), nn.Linear(8, data.vocab_size, bias=False)
        )
        model[1].weight = model[0].weight
        return model


def test_tied_weights_and_token_inputs(tmp_path):
    cfg = Config(data=DataConfig(name="tokens", seq_len=6, vocab_size=11))
    model = TiedTokenTrainer(cfg, output_dir=tmp_path).build_model()
    manager = CheckpointManager(
        tmp_path / "checkpoints", keep_last=1, async_save=False, rank=0, world_size=1
    )
    # The tied tensor under one name only: loading must fill the other name from it.
    manager.save(
        7,
        {"model": {"0.weight": model[0].weight.detach()}},
        meta={
            "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
            "trainer": f"{__name__}.TiedTokenTrainer",
        },
    )
    manager.close()
    out = tmp_path / "out"
    result = export(
        ExportArgs(
            checkpoint=str(tmp_path / "checkpoints"),
            format="all",
            out=str(out),
            trainer=f"{__name__}.TiedTokenTrainer",
        )
    )
    assert set(result.max_abs_diff) == {"onnx", "torch_export"}
    st = safetensors_torch.load_file(out / "model.safetensors")
    assert set(st) == {"0.weight", "1.weight"}
    assert torch.equal(st["0.weight"], model[0].weight) and torch.equal(
        st["1.weight"], model[0].weight
    )

    (tokens,) = example_inputs(TiedTokenTrainer(cfg, output_dir=tmp_path))
    assert tokens.dtype == torch.int64 and tokens.shape == (2, 6) and int(tokens.max()) < 11


def test_corrupt_checkpoint_exits_2_naming_the_file(spirals, tmp_path, capsys):
    checkpoint, _ = spirals
    broken = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, broken, ignore=shutil.ignore_patterns("export"))
    (shard,) = broken.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])  # a truncated shard
    assert main([f"checkpoint={broken}", f"out={tmp_path / 'out'}"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "is not a usable checkpoint" in err and shard.name in err and "truncated" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["checkpoint=x", "formt=onnx"], "unknown key formt in 'formt=onnx'"),
        (
            ["checkpoint=x", "format=tflite"],
            "format='tflite': choose from pt, safetensors, onnx, torch_export, hf, peft, all",
        ),
        (["checkpoint=x", "opset=high"], "opset"),
        (["format=pt"], "checkpoint=PATH is required"),
        (["some/path"], "is not key=value"),
    ],
)
def test_bad_arguments_exit_2(args, needle, capsys):
    assert main(args) == EXIT_BAD_INPUT
    assert needle in capsys.readouterr().err


def test_a_missing_optional_module_names_the_extra(monkeypatch, spirals, capsys):
    checkpoint, _ = spirals
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` fail
    assert main([f"checkpoint={checkpoint}", "format=onnx"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "format=onnx needs the Python module 'onnxruntime'" in err and EXTRA_HINT in err


def test_gpt_exports_with_token_inputs(tmp_path):
    cfg = compose(
        [
            "model=gpt_tiny",
            "data=tokens",
            "loop.max_steps=1",
            "loop.global_batch_size=8",
            "loop.eval_at_end=false",
            "logging.trackers=[jsonl]",
        ]
    )
    Trainer(cfg, output_dir=tmp_path).fit()
    result = export(
        ExportArgs(
            checkpoint=str(tmp_path / "checkpoints"),
            format="onnx,torch_export",
            out=str(tmp_path / "out"),
        )
    )
    assert result.max_abs_diff["onnx"] < 1e-4 and result.max_abs_diff["torch_export"] < 1e-5
