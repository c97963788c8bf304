"""python -m sdnet_trainer.export on a checkpoint written by 2 processes."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from sdnet_trainer import Config, Trainer
from sdnet_trainer.data import build_datasets
from sdnet_trainer.export.cli import main as export_main
from tests.support import REPO, TINY, cli_env, last_metric, read_jsonl, run_cli

onnxruntime = pytest.importorskip("onnxruntime", reason="the export extra is not installed")
safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="the export extra is not installed"
)

STEPS = 4


def _export(args: list[str], *, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdnet_trainer.export", *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("export") / "run"
    launch = run_cli(
        TINY
        + [
            f"loop.max_steps={STEPS}",
            "loop.global_batch_size=32",
            "checkpoint.every_n_steps=2",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=run_dir.parent,
        nproc=2,
        timeout=120,
    )
    assert launch.returncode == 0, launch.output
    return run_dir


@pytest.fixture(scope="module")
def exported(run_dir):
    """Every format at once, from the checkpoint directory (its newest checkpoint is step 4)."""
    done = _export(
        [f"checkpoint={run_dir / 'checkpoints'}", "format=all", f"out={run_dir / 'export'}"]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "onnx: outputs match PyTorch" in done.stdout
        and "torch_export: outputs match PyTorch" in done.stdout
    )
    return run_dir / "export"


def _rebuilt_model(out):
    """A fresh model from the exported config.yaml, as a user without the run directory would."""
    cfg = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(out / "config.yaml"))
    )
    return cfg, Trainer(cfg, output_dir=out).build_model().eval()


@torch.no_grad()
def _val_loss(model, cfg) -> float:
    _, val = build_datasets(cfg.data)
    total, count = 0.0, 0
    for inputs, targets in torch.utils.data.DataLoader(val, batch_size=64):
        total += F.cross_entropy(model(inputs), targets, reduction="sum").item()
        count += len(targets)
    return total / count


def test_pt_reproduces_the_runs_final_validation_loss(run_dir, exported):
    assert {p.name for p in exported.iterdir()} == {
        "model.pt",
        "model.safetensors",
        "model.onnx",
        "model.pt2",
        "config.yaml",
        "export_manifest.json",  # the files this export wrote: a later export may replace them
    }  # no staging leftovers
    cfg, model = _rebuilt_model(exported)
    assert cfg.loop.max_steps == STEPS and cfg.model.name == "simple_cnn"
    model.load_state_dict(torch.load(exported / "model.pt", weights_only=True), strict=True)
    logged = last_metric(read_jsonl(run_dir / "metrics.jsonl"), "val/loss")  # evaluated at step 4
    assert _val_loss(model, cfg) == pytest.approx(logged, rel=1e-5)


def test_safetensors_holds_the_same_tensors_as_pt(exported):
    pt = torch.load(exported / "model.pt", weights_only=True)
    st = safetensors_torch.load_file(exported / "model.safetensors")
    assert st.keys() == pt.keys()
    for name, value in pt.items():
        assert torch.equal(st[name], value), name


def test_onnx_runs_in_onnxruntime_with_another_batch_size(exported):
    cfg, model = _rebuilt_model(exported)
    model.load_state_dict(torch.load(exported / "model.pt", weights_only=True))
    images = torch.randn(
        3, cfg.data.channels, cfg.data.image_size, cfg.data.image_size
    )  # exported at 2
    session = onnxruntime.InferenceSession(
        str(exported / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    (logits,) = session.run(None, {session.get_inputs()[0].name: images.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(logits, model(images).numpy(), rtol=1e-4, atol=1e-5)


def test_torch_export_program_runs_and_matches(exported):
    cfg, model = _rebuilt_model(exported)
    model.load_state_dict(torch.load(exported / "model.pt", weights_only=True))
    program = torch.export.load(str(exported / "model.pt2")).module()
    images = torch.randn(5, cfg.data.channels, cfg.data.image_size, cfg.data.image_size)
    with torch.no_grad():
        torch.testing.assert_close(program(images), model(images))


def test_export_from_and_to_s3_writes_the_local_exports_model(
    run_dir, exported, s3_module, monkeypatch, capsys, caplog
):
    """The run's checkpoints copied to a local S3 server: export reads the newest from there and
    writes its files there (the store found through the environment, as docs/checkpoints.md
    shows), the weights those of the local export; an object export did not write is left alone,
    and one it would replace is refused. The command's main runs in this process, with that
    environment."""
    import s3fs

    for name, value in s3_module.env.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # none made before this environment
    store = f"{s3_module.url}/run"
    key = s3_module.key
    s3_module.fs.put(f"{run_dir / 'checkpoints'}/", key(f"{store}/checkpoints/"), recursive=True)
    s3_module.fs.pipe(key(f"{store}/export/notes.txt"), b"not an export's")
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.export"):
        code = export_main([f"checkpoint={store}/checkpoints", "format=pt", f"out={store}/export"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert f"wrote {store}/export/model.pt" in out.out
    assert f"exporting step 4 of {store}/checkpoints/step_00000004" in caplog.text
    objects = sorted(p.rsplit("/", 1)[-1] for p in s3_module.fs.ls(key(f"{store}/export")))
    assert objects == ["config.yaml", "export_manifest.json", "model.pt", "notes.txt"]
    with s3_module.fs.open(key(f"{store}/export/model.pt")) as f:
        uploaded = torch.load(f, weights_only=True)
    local = torch.load(exported / "model.pt", weights_only=True)
    assert uploaded.keys() == local.keys()
    assert all(torch.equal(uploaded[k], local[k]) for k in local)
    # Refused before any work.
    s3_module.fs.pipe(key(f"{store}/other/model.pt"), b"someone else's")
    args = [f"checkpoint={store}/checkpoints", "format=pt", f"out={store}/other"]
    assert export_main(args) == 2
    assert f"out: {store}/other/model.pt exists" in capsys.readouterr().err
    assert s3_module.fs.cat(key(f"{store}/other/model.pt")) == b"someone else's"


def test_missing_checkpoint_exits_2_naming_it(tmp_path):
    done = _export([f"checkpoint={tmp_path / 'nope'}"], timeout=60)
    assert done.returncode == 2
    assert "checkpoint=" in done.stderr and "does not exist" in done.stderr
    assert "Traceback" not in done.stderr
