"""The data decides the class count: null ``model.num_classes`` / ``data.num_classes`` take it
from the training set, explicit values are checked against it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from PIL import Image

from sdnet_trainer import Trainer, compose
from sdnet_trainer.data import data_num_classes, resolve_num_classes
from sdnet_trainer.data.synthetic import SyntheticImages
from sdnet_trainer.errors import ConfigError
from tests.support import TINY


def _folder(root: Path, classes: int) -> Path:
    """An ImageFolder-layout tree with ``classes`` class folders of two 8x8 PNGs per split."""
    for split in ("train", "val"):
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (8, 8), (40 * c, 20 * i, 0)).save(folder / f"{i}.png")
    return root


def _folder_config(root: Path, *overrides: str):
    return compose(
        [
            *TINY,
            "data=imagefolder",
            f"data.root={root}",
            "data.image_size=16",
            "data.num_workers=0",
            "loop.global_batch_size=2",
            *overrides,
        ]
    )


def test_an_image_folder_sets_the_model_head(tmp_path, caplog):
    cfg = _folder_config(_folder(tmp_path / "data", 3))
    assert cfg.model.num_classes is None and cfg.data.num_classes is None
    trainer = Trainer(cfg, output_dir=tmp_path / "run")
    with caplog.at_level(logging.INFO):
        trainer.setup()
    assert cfg.model.num_classes == cfg.data.num_classes == 3
    assert trainer.model.fc.out_features == 3
    assert "num_classes=3 (from the data)" in caplog.text


@pytest.mark.parametrize("key", ["model.num_classes", "data.num_classes"])
def test_an_explicit_count_that_disagrees_with_the_data_names_the_key(tmp_path, key):
    cfg = _folder_config(_folder(tmp_path / "data", 3), f"{key}=5")
    with pytest.raises(ConfigError, match=rf"{key}=5, but .* has 3 class"):
        Trainer(cfg, output_dir=tmp_path / "run").setup()


def test_synthetic_data_states_its_count_and_wrappers_are_followed():
    data = SyntheticImages(8, num_classes=4, channels=3, image_size=8, seed=0)

    class Wrapper:
        dataset = data

    assert data_num_classes(data) == data_num_classes(Wrapper()) == 4


def test_data_that_states_nothing_needs_the_key():
    cfg = compose(TINY)
    cfg.data.num_classes = cfg.model.num_classes = None
    with pytest.raises(ConfigError, match="set model.num_classes"):
        resolve_num_classes(cfg, object())  # type: ignore[arg-type]
    cfg.model.num_classes = 7
    resolve_num_classes(cfg, object())  # type: ignore[arg-type]
    assert cfg.data.num_classes == 7


def test_a_model_built_by_hand_without_a_class_count_says_how_to_pass_it():
    from sdnet_trainer.models import build_model

    with pytest.raises(ConfigError) as err:
        build_model(compose(["+recipe=quickstart"]).model)
    message = str(err.value)
    assert "model.num_classes is not set" in message
    assert "'model.num_classes=10'" in message and "build_model(cfg.model)" in message
    # The docs' example, as written there, builds the quickstart's model.
    model = build_model(compose(["+recipe=quickstart", "model.num_classes=10"]).model)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
