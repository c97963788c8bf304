"""data=cifar10 from the command line, on a tiny CIFAR-10 written by the test in the real file
format: root/cifar-10-batches-py/data_batch_1..5, test_batch and batches.meta, pickled dicts as
the "python version" archive holds them (Python 2 cPickle, protocol 2: str keys and values as
Python 2 byte strings, ``data`` a uint8 array N x 3072 of planar rows, R then G then B, each
32 x 32 row-major; ``labels`` a list of ints; ``label_names`` in the meta file).

Nothing is downloaded: the loader reads any files of this format (with a restricted unpickler,
field by field), not only the official archive's.
"""

from __future__ import annotations

import io
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.errors import ConfigError
from tests.support import CPU, read_jsonl, run_cli

LABEL_NAMES = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
]
PER_BATCH, TEST_IMAGES = 8, 20  # 5 training batches: 40 images


# The pure-Python pickler, whose opcode writers can be replaced (the C one's cannot).
_PurePickler: Any = pickle._Pickler


class _Python2Pickler(_PurePickler):
    """Protocol 2 as Python 2's cPickle wrote the CIFAR-10 files: every str and bytes object as
    a Python 2 byte string (SHORT_BINSTRING / BINSTRING, read back as str under
    ``encoding="latin1"``), numpy's globals under their Python 2 module ``numpy.core``."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=2)

    def save_python2_str(self, obj: str | bytes) -> None:
        data = obj.encode("latin1") if isinstance(obj, str) else bytes(obj)
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch = dict(_PurePickler.dispatch)
    dispatch[str] = save_python2_str
    dispatch[bytes] = save_python2_str

    def save_global(self, obj: Any, name: str | None = None) -> None:
        module = getattr(obj, "__module__", "") or ""
        if module.startswith("numpy._core"):  # numpy 2's home of what was numpy.core
            self.write(f"cnumpy.core{module[len('numpy._core') :]}\n{obj.__name__}\n".encode())
            self.memoize(obj)
        else:
            super().save_global(obj, name)


def _python2_pickle(value: dict) -> bytes:
    out = io.BytesIO()
    _Python2Pickler(out).dump(value)
    return out.getvalue()


def _images(count: int, seed: int) -> tuple[np.ndarray, list[int]]:
    """``count`` images as CIFAR-10 rows (uint8 [count, 3072]) and their labels; each image is
    its class's colour plus noise, so the labels are learnable."""
    rng = np.random.default_rng(seed)
    labels = [int(label) for label in rng.integers(0, 10, count)]
    colours = np.random.default_rng(0).integers(40, 216, (10, 3, 1))
    planes = colours[labels] + rng.integers(-30, 31, (count, 3, 1024))
    return np.clip(planes, 0, 255).astype(np.uint8).reshape(count, 3072), labels


def write_cifar10(root: Path) -> dict[str, tuple[np.ndarray, list[int]]]:
    """The tiny data set under ``root``; returns each file's (rows, labels)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    written = {}
    files = [(f"data_batch_{n}", PER_BATCH, f"training batch {n} of 5") for n in range(1, 6)]
    for number, (name, count, batch_label) in enumerate(
        [
            *files,
            ("test_batch", TEST_IMAGES, "testing batch 1 of 1"),
        ]
    ):
        rows, labels = _images(count, seed=number + 1)
        entry = {
            "batch_label": batch_label,
            "labels": labels,
            "data": rows,
            "filenames": [f"image_{number}_{i:05d}.png" for i in range(count)],
        }
        (folder / name).write_bytes(_python2_pickle(entry))
        written[name] = (rows, labels)
    meta = {"num_cases_per_batch": PER_BATCH, "label_names": LABEL_NAMES, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(_python2_pickle(meta))
    return written


def test_the_loader_reads_the_written_pixels_and_labels(tmp_path):
    from sdnet_trainer.data.cifar import build_cifar10

    written = write_cifar10(tmp_path / "cifar")
    cfg = DataConfig(name="cifar10", root=str(tmp_path / "cifar"))
    train, val = build_cifar10(cfg)
    assert (len(train), len(val)) == (5 * PER_BATCH, TEST_IMAGES)
    assert train.classes == LABEL_NAMES
    rows, labels = written["test_batch"]
    for index in (0, 7, TEST_IMAGES - 1):
        # Planar R, G, B rows of 32 x 32 -> the HWC image the transforms receive.
        expected = Image.fromarray(rows[index].reshape(3, 32, 32).transpose(1, 2, 0))
        image, label = val[index]
        assert label == labels[index]
        assert torch.equal(image, val.transform(expected))
    rows, labels = written["data_batch_3"]
    assert train.targets[2 * PER_BATCH : 3 * PER_BATCH] == labels


def test_trains_through_the_cli(tmp_path):
    write_cifar10(tmp_path / "cifar")
    run_dir = tmp_path / "run"
    launch = run_cli(
        [
            *CPU,
            "model=simple_cnn",
            "data=cifar10",
            f"data.root={tmp_path / 'cifar'}",
            "data.num_workers=1",
            "loop.global_batch_size=8",
            "loop.max_steps=10",  # two epochs of 5 steps
            "loop.eval_at_epoch_end=false",
            "logging.log_every_n_steps=1",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        nproc=2,
    )
    assert launch.returncode == 0, launch.output
    log = (run_dir / "train.log").read_text()
    assert f"{5 * PER_BATCH} train / {TEST_IMAGES} val images" in log
    assert "done: 10 steps" in log
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len([row for row in rows if "train/loss" in row]) == 10
    # The final evaluation ran over the test batch (top-1 is a multiple of 1/20).
    top1 = [row["val/top1"] for row in rows if "val/top1" in row]
    assert len(top1) == 1 and round(top1[0] * TEST_IMAGES / 100, 6).is_integer()


class _Hostile:
    """Unpickles as a call of os.system: what a file planted in data.root could hold."""

    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_a_file_that_names_code_is_refused_without_running_it(tmp_path, monkeypatch):
    from sdnet_trainer.data.cifar import build_cifar10

    write_cifar10(tmp_path / "cifar")
    (tmp_path / "cifar" / "cifar-10-batches-py" / "data_batch_2").write_bytes(
        pickle.dumps({"data": _Hostile(), "labels": []}, protocol=2)
    )
    monkeypatch.chdir(tmp_path)
    refused = r"data_batch_2 is not a CIFAR-10 file \(UnpicklingError: it names (os|posix)\.system"
    with pytest.raises(ConfigError, match=refused):
        build_cifar10(DataConfig(name="cifar10", root=str(tmp_path / "cifar")))
    assert not (tmp_path / "pwned").exists()
