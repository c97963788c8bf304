"""python -m sdnet_trainer.serve's arguments and its refusals before anything is served."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from sdnet_trainer.config import Config
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export import config_yaml
from sdnet_trainer.serve import cli as serve_main
from sdnet_trainer.serve.args import parse_args


def test_defaults_and_values_parse():
    args = parse_args(["checkpoint=/ckpt", "port=0", "max_batch_size=1", "max_wait_ms=2.5"])
    assert (args.checkpoint, args.port, args.max_batch_size, args.max_wait_ms) == (
        "/ckpt",
        0,
        1,
        2.5,
    )
    assert (args.host, args.backend, args.device, args.workers) == ("127.0.0.1", "torch", "auto", 1)
    assert not args.batching  # max_batch_size=1
    assert parse_args(["checkpoint=x"]).batching
    assert not parse_args(["checkpoint=x", "max_wait_ms=0"]).batching
    assert parse_args(["checkpoint=x", "ema=true"]).ema


@pytest.mark.parametrize(
    "argv, words",
    [
        (["checkpoint=x", "max_batch=4"], "unknown key max_batch in 'max_batch=4'"),
        (["checkpoint=x", "max_batch=4"], "did you mean max_batch_size?"),
        (["checkpoint=x", "backend=tensorrt"], "backend='tensorrt' is not one of torch, onnx"),
        (["checkpoint=x", "device=tpu"], "device='tpu'"),
        (["checkpoint=x", "port=70000"], "port=70000"),
        (["checkpoint=x", "port=eighty"], "port"),
        (["checkpoint=x", "max_batch_size=0"], "max_batch_size=0 must be >= 1"),
        (["checkpoint=x", "max_wait_ms=-1"], "max_wait_ms=-1"),
        (["checkpoint=x", "max_body_mb=0"], "max_body_mb=0"),
        (["checkpoint=x", "workers=0"], "workers=0"),
        (["port=1"], "checkpoint=PATH is required"),
        (["checkpoint"], "is not key=value"),
    ],
)
def test_bad_arguments_are_named(argv, words):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert words in str(err.value)


def test_main_exits_2_naming_the_key_or_the_path(tmp_path, capsys):
    assert serve_main.main(["checkpoint=x", "prot=1"]) == 2
    assert "unknown key prot" in capsys.readouterr().err
    assert serve_main.main([f"checkpoint={tmp_path / 'nope'}"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint=" in err and "does not exist" in err and "Traceback" not in err
    (tmp_path / "step_00000001").mkdir()  # no manifest: not a committed checkpoint
    assert serve_main.main([f"checkpoint={tmp_path / 'step_00000001'}"]) == 2
    assert "not a usable checkpoint" in capsys.readouterr().err


def test_a_missing_serve_extra_names_the_install_command(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a)
    )
    assert serve_main.main(["checkpoint=x"]) == 2
    err = capsys.readouterr().err
    assert "'uvicorn'" in err and "pip install 'sdnet_trainer[serve]'" in err


def test_help_prints_the_arguments(capsys):
    assert serve_main.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "max_batch_size=32" in out and "POST /v1/predict" in out


def unloadable_export_folder(folder: Path) -> Path:
    """An export folder whose config rebuilds a small CNN and whose model.pt does not fit it."""
    cfg = Config()
    cfg.model.name, cfg.model.num_classes, cfg.data.image_size = "simple_cnn", 3, 16
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(config_yaml(cfg))
    torch.save({"not_a_layer": torch.zeros(1)}, folder / "model.pt")
    return folder


def test_workers_exit_2_at_once_on_a_model_that_cannot_load(tmp_path, capsys):
    """The parent loads the model before starting any worker process."""
    folder = unloadable_export_folder(tmp_path / "export")
    assert serve_main.main([f"checkpoint={folder}", "workers=2", "port=0"]) == 2
    err = capsys.readouterr().err
    assert "weights do not fit" in err and "Traceback" not in err


def test_a_worker_that_cannot_load_exits_with_uvicorns_startup_failure(
    tmp_path, monkeypatch, capsys
):
    """Not an exception: uvicorn's supervisor would restart that worker forever. And at once
    (os._exit), without the interpreter's teardown (seconds with torch loaded)."""
    from uvicorn.config import STARTUP_FAILURE

    args = parse_args([f"checkpoint={unloadable_export_folder(tmp_path / 'export')}", "workers=2"])
    monkeypatch.setenv(serve_main.ARGS_ENV, json.dumps(asdict(args)))

    def exit_now(code: int) -> None:
        raise SystemExit(code)  # this test's process goes on

    monkeypatch.setattr(serve_main.os, "_exit", exit_now)
    with pytest.raises(SystemExit) as exited:
        serve_main.app_from_env()
    assert exited.value.code == STARTUP_FAILURE
    err = capsys.readouterr().err
    assert "weights do not fit" in err and len(err.strip().splitlines()) == 1
