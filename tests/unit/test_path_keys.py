"""A path key given a folder that cannot be created ends the launch with one line naming the key
and the path, exit code 2, no traceback: the command line's ``main`` in this process, with the
overrides on ``sys.argv``, and export's ``main``."""

from __future__ import annotations

import sys

import pytest

from sdnet_trainer import cli, compose
from sdnet_trainer.checkpoint import CheckpointManager
from sdnet_trainer.config.paths import check_creatable_folder
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export import EXIT_BAD_INPUT
from sdnet_trainer.export.cli import main as export_main
from sdnet_trainer.recipes.custom_model import SpiralTrainer
from tests.support import TINY

SPIRAL_TRAINER = "sdnet_trainer.recipes.custom_model.SpiralTrainer"

# (key, overrides); {bad} is a folder that cannot be created.
CASES = [
    ("checkpoint.dir", ["checkpoint.dir={bad}"]),
    ("run.root", ["run.root={bad}"]),
    ("hydra.run.dir", ["hydra.run.dir={bad}"]),
    ("hydra.sweep.dir", ["--multirun", "hydra.sweep.dir={bad}"]),
    (
        "logging.mlflow.tracking_uri",
        ["logging.trackers=[jsonl,mlflow]", "logging.mlflow.tracking_uri={bad}"],
    ),
    # Input folders: one that must exist, and one that CIFAR-10 is to be downloaded into.
    ("data.root", ["data=imagefolder", "data.root={bad}"]),
    ("data.root", ["data=cifar10", "data.image_size=32", "data.download=true", "data.root={bad}"]),
]


# cli.main sets up this process as its own (logging, the collector): put back after each test
# (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("main_in_this_process")


@pytest.fixture(params=["under_proc", "under_a_file"])
def bad_folder(request, tmp_path) -> str:
    """A folder path that cannot be created: under /proc (which refuses new folders, even to
    root, who ignores permission bits) or under a regular file."""
    if request.param == "under_proc":
        return "/proc/nowhere/folder"
    (tmp_path / "a_file").write_text("not a folder")
    return str(tmp_path / "a_file" / "folder")


def _one_error_line(err: str, key: str, bad: str) -> None:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, err
    assert f"{key}=" in errors[0] and bad in errors[0], err


@pytest.mark.parametrize("key, overrides", CASES, ids=[c[1][-1].split("=")[0] for c in CASES])
def test_an_uncreatable_folder_is_one_config_error(
    key, overrides, bad_folder, tmp_path, monkeypatch, capfd
):
    if key.startswith("logging.mlflow"):
        pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    argv = [*TINY, "loop.max_steps=1", f"run.root={tmp_path / 'outputs'}"]
    argv += [o.format(bad=bad_folder) for o in overrides]
    monkeypatch.setattr(sys, "argv", ["sdnet_trainer", *argv])
    with pytest.raises(SystemExit) as ended:
        cli.main()
    assert ended.value.code == cli.EXIT_CONFIG_ERROR
    _one_error_line(capfd.readouterr().err, key, bad_folder)


def test_export_out_that_cannot_be_created(bad_folder, tmp_path, capsys):
    trainer = SpiralTrainer(
        compose(["+recipe=custom_spirals", "loop.max_steps=1", "loop.eval_at_end=false"]),
        output_dir=tmp_path / "run",
    )
    trainer.fit()
    trainer.close()
    (checkpoint,) = (tmp_path / "run" / "checkpoints").glob("step_*")
    capsys.readouterr()
    args = [f"checkpoint={checkpoint}", f"out={bad_folder}", f"trainer={SPIRAL_TRAINER}"]
    assert export_main(args) == EXIT_BAD_INPUT
    _one_error_line(capsys.readouterr().err, "out", bad_folder)


def test_the_checkpoint_manager_names_checkpoint_dir(bad_folder):
    # Past the check before launch (a folder that became uncreatable since): still a ConfigError.
    with pytest.raises(ConfigError, match=rf"checkpoint\.dir: .*{bad_folder}"):
        CheckpointManager(bad_folder, keep_last=1, async_save=False, rank=0, world_size=1)


def test_usable_folders_pass_and_are_left_as_they_were(tmp_path):
    check_creatable_folder("checkpoint.dir", tmp_path / "new" / "deeper")  # creatable
    assert not (tmp_path / "new").exists()  # nothing is left behind
    (tmp_path / "there").mkdir()
    check_creatable_folder("checkpoint.dir", tmp_path / "there")
    assert list((tmp_path / "there").iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"checkpoint\.dir=.*file.*exists and is not a folder"):
        check_creatable_folder("checkpoint.dir", tmp_path / "file")
