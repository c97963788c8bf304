"""Image files that cannot be decoded: data.on_bad_sample=error names the file, skip replaces it
deterministically, logs it once and counts it (data/skipped_samples)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch
from torchvision import transforms

from sdnet_trainer import Trainer, compose
from sdnet_trainer.config.observability import LoggingConfig
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data import (
    BadSampleError,
    CheckedImageFolder,
    build_datasets,
    skipped_samples,
    validate_data,
)
from sdnet_trainer.data.loader import stop_workers, train_loader
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.observability import MetricsWriter, StepMeter
from sdnet_trainer.observability.figures import RunFigures
from sdnet_trainer.training.hooks import MetricsHook
from sdnet_trainer.training.state import RunState, StepResult
from tests.support import TINY, FaultTrainer, read_jsonl, run_cli

PER_CLASS = 16  # train/a: indices 0-15, train/b: indices 16-31 (ImageFolder sorts the files)
# Which training files are broken, by ImageFolder index, and how.
TRUNCATED, GARBAGE = 3, 23


def _jpeg(path: Path, seed: int) -> None:
    from PIL import Image

    rng = random.Random(seed)
    pixels = bytes(rng.randrange(256) for _ in range(24 * 20 * 3))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.frombytes("RGB", (24, 20), pixels).save(path, format="JPEG", quality=90)


def _path(root: Path, index: int) -> Path:
    name = "a" if index < PER_CLASS else "b"
    return root / "train" / name / f"img{index % PER_CLASS:02d}.jpg"


def _break(path: Path, kind: str) -> None:
    if kind == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(random.Random(0).randbytes(700))


def _tree(root: Path, bad: dict[int, str]) -> Path:
    """train/{a,b}/ with PER_CLASS JPEGs each, val/{a,b}/ with 2; the ``bad`` indices broken."""
    for index in range(2 * PER_CLASS):
        _jpeg(_path(root, index), seed=index)
    for split_index, name in enumerate(("a", "b")):
        for i in range(2):
            _jpeg(root / "val" / name / f"img{i:02d}.jpg", seed=1000 + 2 * split_index + i)
    for index, kind in bad.items():
        _break(_path(root, index), kind)
    return root


BOTH = {TRUNCATED: "truncated", GARBAGE: "garbage"}


def _cfg(root: Path, **overrides) -> DataConfig:
    kwargs = dict(
        name="imagefolder",
        root=str(root),
        image_size=16,
        num_classes=2,
        persistent_workers=False,
    )
    kwargs.update(overrides)
    return DataConfig(**kwargs)


def _epoch(cfg: DataConfig) -> tuple[list, CheckedImageFolder]:
    """One epoch of the training loader (batches of 8, one rank)."""
    train, _ = build_datasets(cfg)
    loader, _ = train_loader(
        train,
        cfg=cfg,
        device_type="cpu",
        micro_batch_size=8,
        grad_accum_steps=1,
        dp_size=1,
        dp_rank=0,
        seed=0,
    )
    batches = iter(loader)
    try:
        return list(batches), train
    finally:
        stop_workers(batches)  # also after a bad sample raised (see stop_workers)


# --------------------------------------------------------------------------------------------
# error
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("index", [TRUNCATED, GARBAGE])
def test_error_names_the_file_in_one_line(tmp_path, index, num_workers):
    root = _tree(tmp_path, {index: BOTH[index]})
    with pytest.raises(ConfigError) as err:
        _epoch(_cfg(root, num_workers=num_workers))
    assert isinstance(err.value, BadSampleError)
    message = str(err.value)
    assert message.startswith(f"data: cannot decode {_path(root, index)} (")
    assert message.endswith("; fix or remove the file, or set data.on_bad_sample=skip")
    assert "\n" not in message and "Traceback" not in message
    if index == TRUNCATED:
        assert "(OSError: " in message


@pytest.mark.full  # seconds: out of the quick tier
def test_cli_reports_a_bad_file_without_a_traceback(tmp_path):
    root = _tree(tmp_path / "data", {GARBAGE: "garbage"})
    launch = run_cli(
        TINY
        + [
            "data=imagefolder",
            f"data.root={root}",
            "data.num_classes=2",
            "model.num_classes=2",
            "data.num_workers=2",
            "loop.global_batch_size=8",
            "loop.max_steps=4",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
    )
    assert launch.returncode == 2, launch.output
    assert f"config error: data: cannot decode {_path(root, GARBAGE)} (" in launch.output
    assert "Traceback" not in launch.output, launch.output


@pytest.mark.full  # seconds: out of the quick tier
def test_on_bad_sample_is_validated():
    validate_data(compose(["data.on_bad_sample=skip"]))
    with pytest.raises(ConfigError, match=r"data.on_bad_sample='skp'.*did you mean 'skip'"):
        validate_data(compose(["data.on_bad_sample=skp"]))
    assert DataConfig().on_bad_sample == "error"


# --------------------------------------------------------------------------------------------
# skip
# --------------------------------------------------------------------------------------------


def test_skip_loads_the_next_file_that_decodes(tmp_path, caplog):
    last = 2 * PER_CLASS - 1
    root = _tree(tmp_path, {**BOTH, 22: "garbage", last: "truncated"})
    ds = CheckedImageFolder(
        str(root / "train"), transform=transforms.ToTensor(), on_bad_sample="skip"
    )
    assert ds.skipped is not None and ds.skipped() == 0
    caplog.set_level(logging.WARNING, logger="sdnet_trainer.data.folders")
    for _ in range(2):  # the same replacement every time, logged once
        for bad, replacement in [(TRUNCATED, 4), (22, 24), (GARBAGE, 24), (last, 0)]:
            image, label = ds[bad]
            good_image, good_label = ds[replacement]
            assert torch.equal(image, good_image) and label == good_label
    assert ds.skipped() == 8
    warned = [r.getMessage() for r in caplog.records if r.name == "sdnet_trainer.data.folders"]
    assert len(warned) == 4
    for index in (TRUNCATED, 22, GARBAGE, last):
        assert sum(str(_path(root, index)) in line for line in warned) == 1
    assert any("(OSError: " in line for line in warned)
    with pytest.raises(IndexError):
        ds[2 * PER_CLASS]


def test_skip_with_every_file_bad_stops(tmp_path):
    root = _tree(tmp_path, {i: "garbage" for i in range(2 * PER_CLASS)})
    ds = CheckedImageFolder(
        str(root / "train"), transform=transforms.ToTensor(), on_bad_sample="skip"
    )
    with pytest.raises(ConfigError, match="none of the 32 files"):
        ds[0]


def test_skip_counter_is_shared_with_workers(tmp_path):
    root = _tree(tmp_path, BOTH)
    serial, serial_set = _epoch(_cfg(root, on_bad_sample="skip", num_workers=0))
    parallel, parallel_set = _epoch(_cfg(root, on_bad_sample="skip", num_workers=2))
    assert len(serial) == len(parallel) == 4
    for (xa, ya), (xb, yb) in zip(serial, parallel):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # One epoch visits each bad index once; the workers' counts reach the main process.
    assert serial_set.skipped is not None and serial_set.skipped() == 2
    assert parallel_set.skipped is not None and parallel_set.skipped() == 2


def test_skipped_samples_finds_the_counter_through_wrappers(tmp_path):
    root = _tree(tmp_path, {})
    train, _ = build_datasets(_cfg(root, on_bad_sample="skip"))
    loader, _ = train_loader(
        torch.utils.data.Subset(train, range(16)),
        cfg=_cfg(root),
        device_type="cpu",
        micro_batch_size=8,
        grad_accum_steps=1,
        dp_size=1,
        dp_rank=0,
        seed=0,
    )
    counter = skipped_samples(loader.dataset)
    assert counter is not None and counter() == 0
    assert skipped_samples(build_datasets(_cfg(root))[0]) is None  # on_bad_sample=error
    assert skipped_samples(build_datasets(DataConfig(train_size=8, val_size=8))[0]) is None
    assert skipped_samples(None) is None


def test_metrics_hook_logs_skipped_samples(tmp_path):
    def hook(directory: Path, bad_samples) -> list[dict]:
        writer = MetricsWriter(
            directory, LoggingConfig(trackers=["jsonl"]), enabled=True, run_name="test", config={}
        )
        figures = RunFigures(total_steps=2, samples_per_epoch=8, metric_weight=1.0, world_size=1)
        metrics = MetricsHook(
            LoggingConfig(log_every_n_steps=1, progress_bar="off", flops=False),
            figures,
            writer=writer,
            meter=StepMeter(),
            device=torch.device("cpu"),
            lr=lambda: 0.1,
            comm_bytes=None,
            loss_scale=None,
            rank=0,
            bad_samples=bad_samples,
        )
        result = StepResult(
            loss=torch.tensor(0.5),
            grad_norm=torch.tensor(1.0),
            data_wait_s=0.0,
            seconds=0.1,
            nonfinite=False,
            stop_requested=False,
            save_due=False,
        )
        metrics.before_train(RunState())
        metrics.after_step(RunState(step=1), result)
        metrics.close()
        writer.close()
        return read_jsonl(directory / "metrics.jsonl")

    counted = hook(tmp_path / "counted", lambda: 5)
    assert counted[0]["data/skipped_samples"] == 5.0 and counted[0]["train/loss"] == 0.5
    assert "data/skipped_samples" not in hook(tmp_path / "none", None)[0]


# --------------------------------------------------------------------------------------------
# skip, through the Trainer
# --------------------------------------------------------------------------------------------


def _train_overrides(root: Path, *extra: str) -> list[str]:
    # 32 images / global batch 8 = 4 steps per epoch: two epochs. With loop.seed 0 the bad
    # samples come at steps 2 and 3 (epoch 0), 5 and 7 (epoch 1).
    return TINY + [
        "data=imagefolder",
        f"data.root={root}",
        "data.image_size=16",
        "data.num_classes=2",
        "model.num_classes=2",
        "data.num_workers=0",
        "data.on_bad_sample=skip",
        "loop.global_batch_size=8",
        "loop.max_steps=8",
        "loop.eval_at_end=false",
        *extra,
    ]


def test_trainer_skips_bad_files_and_logs_each_once(tmp_path, caplog):
    root = _tree(tmp_path / "data", BOTH)
    caplog.set_level(logging.WARNING, logger="sdnet_trainer.data.folders")
    trainer = Trainer(compose(_train_overrides(root)), output_dir=tmp_path / "run")
    trainer.fit()
    assert trainer.state.step == 8
    warned = [r.getMessage() for r in caplog.records if r.name == "sdnet_trainer.data.folders"]
    for index in BOTH:
        assert sum(str(_path(root, index)) in line for line in warned) == 1, warned


def test_trainer_logs_skipped_samples_metric(tmp_path):
    """Needs ``Trainer.build_hooks`` to pass ``bad_samples=skipped_samples(...)`` to MetricsHook."""
    root = _tree(tmp_path / "data", BOTH)
    Trainer(compose(_train_overrides(root)), output_dir=tmp_path / "run").fit()
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    counts = [r["data/skipped_samples"] for r in rows]
    assert len(counts) == 4 and counts == sorted(counts)
    assert counts[1] >= 2 and counts[-1] >= 4  # each epoch loads both bad files once


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bad_reference")
    root = _tree(directory / "data", BOTH)
    trainer = FaultTrainer(compose(_train_overrides(root)), output_dir=directory / "run")
    trainer.fit()
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return root, params, trainer.losses, trainer.seen


@pytest.mark.parametrize(("stop_at", "num_workers"), [(2, 0), (3, 2), (5, 0)])
def test_stop_and_resume_around_a_bad_sample_is_bitwise_equal(
    tmp_path, monkeypatch, reference, stop_at, num_workers
):
    root, params, losses, seen = reference
    # A bad sample comes before the stop and another after it.
    assert set(BOTH) & set(seen[: 8 * stop_at]) and set(BOTH) & set(seen[8 * stop_at :])
    cfg = compose(_train_overrides(root, f"data.num_workers={num_workers}"))
    # Signalled one step earlier: the stop is agreed during the next step (verdicts read late).
    monkeypatch.setenv("SDNET_TEST_SIGTERM", f"0:{stop_at - 1}")
    first = FaultTrainer(cfg, output_dir=tmp_path)
    with pytest.raises(SystemExit) as stopped:
        first.fit()
    assert stopped.value.code == 143 and first.state.step == stop_at
    monkeypatch.delenv("SDNET_TEST_SIGTERM")
    second = FaultTrainer(cfg, output_dir=tmp_path)
    second.fit()
    assert second.state.step == 8
    assert first.seen + second.seen == seen
    assert first.losses + second.losses == losses  # bitwise, step by step
    final = second.model.state_dict()
    for name, value in params.items():
        assert torch.equal(final[name], value), name
