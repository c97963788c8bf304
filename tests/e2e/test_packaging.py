"""Configs and recipes travel inside the package: a non-editable install works from anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from tests.support import REPO


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)


def test_wheel_ships_configs_and_recipes_and_runs_from_another_directory(tmp_path):
    built = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheel"),
            str(REPO),
        ]
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("sdnet_trainer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "sdnet_trainer/configs/config.yaml",
        "sdnet_trainer/configs/model/resnet152.yaml",
        "sdnet_trainer/configs/precision/bf16.yaml",
        "sdnet_trainer/recipes/quickstart.yaml",
        "sdnet_trainer/recipes/resnet152.yaml",
        "sdnet_trainer/recipes/custom_model.py",
    ):
        assert expected in names

    target = tmp_path / "site"
    installed = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-compile",
            "--target",
            str(target),
            str(wheel),
        ]
    )
    assert installed.returncode == 0, installed.stderr
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    workdir = tmp_path / "somewhere_else"
    workdir.mkdir()
    # Where `import sdnet_trainer` finds the package (the file it would run as __file__), without
    # running it: the import itself (torch, seconds of CPU) is the command line's, below.
    shown = _run(
        [
            sys.executable,
            "-c",
            "import importlib.util; print(importlib.util.find_spec('sdnet_trainer').origin)",
        ],
        cwd=workdir,
        env=env,
    )
    assert shown.stdout.startswith(str(target)), (
        shown.stdout + shown.stderr
    )  # the wheel, not the repo
    cfg = _run(
        [sys.executable, "-m", "sdnet_trainer", "+recipe=resnet152", "--cfg", "job"],
        cwd=workdir,
        env=env,
    )
    assert cfg.returncode == 0, cfg.stderr
    assert "name: resnet152" in cfg.stdout and "label_smoothing: 0.1" in cfg.stdout
