"""The GPU input pipeline, proven on the CPU where it can be: uint8 batches normalized on the
device give the float path's tensors bit for bit; validation workers do not persist; worker
defaults; data.decode=cuda's loader half, its checks, and its device half run through
torchvision's CPU JPEG decoder. tests/cuda/test_loader_cuda.py covers the GPU itself."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import default_collate
from torchvision import transforms

from sdnet_trainer.config.schema import AugmentConfig, DataConfig
from sdnet_trainer.data import BadSampleError, SyntheticImages, build_datasets
from sdnet_trainer.data.folders import EncodedJpegFolder
from sdnet_trainer.data.jpeg import EncodedImages, JpegCrop, collate_encoded
from sdnet_trainer.data.loader import (
    RunData,
    check_loader_options,
    eval_loader,
    resolve_num_workers,
    train_loader,
)
from sdnet_trainer.data.normalize import DeviceNormalize, defer_normalization
from sdnet_trainer.errors import ConfigError


def _jpeg(path: Path, size: tuple[int, int], seed: int, fmt: str = "JPEG") -> None:
    rng = random.Random(seed)
    width, height = size
    # Smooth colours plus noise: real JPEG content, every pixel value range exercised.
    coarse = Image.frombytes("RGB", (4, 3), bytes(rng.randrange(256) for _ in range(36)))
    image = coarse.resize((width, height), Image.Resampling.BICUBIC)
    noise = Image.effect_noise((width, height), 30).convert("RGB")
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.blend(image, noise, 0.2).save(path, format=fmt, quality=90)


SIZES = [(40, 30), (30, 44), (52, 52), (37, 29)]


def _tree(root: Path, *, per_class: int = 4, suffix: str = "jpg") -> Path:
    for split in ("train", "val"):
        for c, name in enumerate(("a", "b")):
            for i in range(per_class):
                size = SIZES[(i + c) % len(SIZES)]
                _jpeg(root / split / name / f"{i:02d}.{suffix}", size, seed=100 * c + i)
    return root


def _cfg(root: Path, **overrides) -> DataConfig:
    kwargs = dict(
        name="imagefolder",
        root=str(root),
        image_size=16,
        num_classes=2,
        num_workers=0,
        persistent_workers=False,
    )
    kwargs.update(overrides)
    return DataConfig(**kwargs)


def _run_data(cfg: DataConfig, *, uint8_inputs: bool, channels_last: bool = False) -> RunData:
    train, val = build_datasets(cfg)
    return RunData(
        train,
        val,
        cfg=cfg,
        device=torch.device("cpu"),
        micro_batch_size=4,
        grad_accum_steps=1,
        eval_batch_size=3,
        dp_size=1,
        dp_rank=0,
        seed=5,
        channels_last=channels_last,
        uint8_inputs=uint8_inputs,
    )


class _Position:
    epoch = 0
    epoch_sample = 0


def _batches(data: RunData) -> tuple[list, list]:
    data.start(_Position())
    try:
        train = [data.next_batch() for _ in range(data.steps_per_epoch)]
        assert data.val_loader is not None
        val = [data.to_device(batch) for batch in data.val_loader]
    finally:
        data.close()
    return train, val


@pytest.mark.parametrize("channels_last", [False, True])
def test_uint8_batches_normalized_on_the_device_equal_the_float_path(tmp_path, channels_last):
    cfg = _cfg(_tree(tmp_path))
    float_data = _run_data(cfg, uint8_inputs=False, channels_last=channels_last)
    uint8_data = _run_data(cfg, uint8_inputs=True, channels_last=channels_last)
    assert float_data.normalize is None
    assert uint8_data.normalize == DeviceNormalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    # What the loader hands over: uint8 pixels, a quarter of the float path's bytes.
    raw_images, _ = next(iter(uint8_data.train_loader))
    assert raw_images.dtype == torch.uint8 and raw_images.shape == (4, 3, 16, 16)
    expected_train, expected_val = _batches(float_data)
    got_train, got_val = _batches(uint8_data)
    assert len(got_train) == 2 and len(got_val) == 3  # 8 val images in batches of 3
    for (want_x, want_y), (got_x, got_y) in zip(expected_train + expected_val, got_train + got_val):
        assert got_x.dtype == torch.float32
        assert torch.equal(got_x, want_x), "the uint8 path must give the float path's tensors"
        assert torch.equal(got_y, want_y)
        if channels_last:
            assert got_x.is_contiguous(memory_format=torch.channels_last)
    # Random crops did happen (the batches are not all the same resize of the files).
    assert not torch.equal(expected_train[0][0], expected_train[1][0])


def test_deferring_normalization_leaves_the_original_data_set_alone(tmp_path):
    train, _ = build_datasets(_cfg(_tree(tmp_path), on_bad_sample="skip"))
    deferred = defer_normalization(train)
    assert deferred is not None
    uint8_set, normalize = deferred
    torch.manual_seed(0)
    as_float = train[1][0]
    torch.manual_seed(0)
    as_uint8 = uint8_set[1][0]
    assert train[1][0].dtype == torch.float32 and as_uint8.dtype == torch.uint8
    assert torch.equal(normalize(as_uint8[None])[0], as_float)
    # The copy shares the files and the skip counter (data/skipped_samples follows it).
    assert uint8_set.samples is train.samples and uint8_set.skipped is train.skipped
    # Data sets not built here, or transforms that do not end in ToTensor + Normalize, stay.
    assert (
        defer_normalization(SyntheticImages(4, image_size=4, channels=3, num_classes=2, seed=0))
        is None
    )
    train.transform = transforms.Compose([transforms.ToTensor()])
    assert defer_normalization(train) is None


def test_validation_workers_do_not_persist():
    cfg = DataConfig(num_workers=2, persistent_workers=True)
    dataset = SyntheticImages(8, image_size=4, channels=3, num_classes=2, seed=0)
    train, _ = train_loader(
        dataset, cfg=cfg, device_type="cpu", micro_batch_size=2, grad_accum_steps=1,
        dp_size=1, dp_rank=0, seed=0,
    )  # fmt: skip
    val = eval_loader(dataset, cfg=cfg, device_type="cpu", batch_size=2, dp_size=1, dp_rank=0)
    assert train.persistent_workers is True and train.num_workers == 2
    assert val.persistent_workers is False and val.num_workers == 2


def test_default_workers_share_the_cores_among_local_ranks(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_num_workers(None, device_type="cuda") == 7  # 8 cores each, one for the rank
    assert resolve_num_workers(None, device_type="cpu") == 0  # workers would take its cores
    assert resolve_num_workers(3, device_type="cuda") == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert resolve_num_workers(None, device_type="cuda") == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert resolve_num_workers(None, device_type="cuda") == 31


# --------------------------------------------------------------------------------------------
# data.decode=cuda
# --------------------------------------------------------------------------------------------


def test_decode_option_is_checked():
    with pytest.raises(ConfigError, match="data.decode"):
        check_loader_options(DataConfig(decode="gpu"))
    with pytest.raises(ConfigError, match="data.decode=cuda .*imagefolder") as err:
        check_loader_options(DataConfig(name="synthetic", decode="cuda"))
    assert "synthetic" in str(err.value)
    check_loader_options(DataConfig(name="imagefolder", decode="cuda"))


def test_decode_cuda_on_a_cpu_device_is_a_config_error(tmp_path):
    cfg = _cfg(_tree(tmp_path), decode="cuda")
    with pytest.raises(ConfigError, match="data.decode=cuda") as err:
        _run_data(cfg, uint8_inputs=True)
    assert "cpu" in str(err.value)


def test_decode_cuda_rejects_files_that_are_not_jpeg(tmp_path):
    root = _tree(tmp_path)
    _jpeg(root / "train" / "b" / "odd.png", (20, 20), seed=9, fmt="PNG")
    with pytest.raises(ConfigError, match="data.decode=cuda") as err:
        build_datasets(_cfg(root, decode="cuda"))
    assert "odd.png" in str(err.value) and "data.decode=cpu" in str(err.value)
    build_datasets(_cfg(root))  # the CPU path reads PNG


@pytest.mark.parametrize("train", [True, False])
def test_jpeg_crop_draws_the_pil_paths_box_and_flip(train):
    size = 24
    crop = JpegCrop(size, train=train)
    for seed, (width, height) in enumerate([(500, 375), (375, 500), (64, 64)]):
        torch.manual_seed(seed)
        box, flip = crop.box(width, height)
        if train:
            torch.manual_seed(seed)
            image = Image.new("RGB", (width, height))
            rrc = transforms.RandomResizedCrop(size)
            assert box == tuple(rrc.get_params(image, rrc.scale, rrc.ratio))
            assert flip == bool(torch.rand(1) < 0.5)
        else:
            # Resize(short side -> 27) + CenterCrop(24): the middle 24/27 of the short side.
            top, left, h, w = box
            assert not flip and h == w == round(min(width, height) * size / 27)
            assert abs(top - (height - h) / 2) <= 0.5 and abs(left - (width - w) / 2) <= 0.5


def test_decode_cuda_pipeline_matches_the_pil_path_on_the_cpu_decoder(tmp_path):
    """The loader half and the device half of data.decode=cuda, with torchvision's CPU JPEG
    decoder standing in for nvjpeg: the validation images agree with the PIL path's up to the
    resampling difference (same center crop, float vs PIL antialiasing)."""
    root = _tree(tmp_path)
    # data.decode=cuda is the imagenet preset; the PIL path at 24 px would pick cifar's (auto).
    cfg = _cfg(root, image_size=24, augment=AugmentConfig(preset="imagenet"))
    encoded_train, encoded_val = build_datasets(_cfg(root, image_size=24, decode="cuda"))
    assert isinstance(encoded_val, EncodedJpegFolder)
    _, pil_val = build_datasets(cfg)
    decoder = encoded_val.device_decoder
    assert decoder == encoded_train.device_decoder  # one decoder serves both loaders
    batch, labels = collate_encoded([encoded_val[i] for i in range(len(encoded_val))])
    assert isinstance(batch, EncodedImages) and labels.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    decoded = decoder(batch, torch.device("cpu"))
    expected = default_collate([pil_val[i] for i in range(len(pil_val))])[0]
    assert decoded.shape == expected.shape == (8, 3, 24, 24) and decoded.dtype == torch.float32
    # Normalized units (std ~0.22, so 0.1 is about 6 of 255 levels): resampling, not a shift.
    assert (decoded - expected).abs().mean() < 0.1
    assert (decoded - expected).abs().mean() < 0.2 * (expected - expected.mean()).abs().mean()
    # Training samples: seeded draws give the same crops on every load.
    torch.manual_seed(3)
    first = encoded_train[2][0]
    torch.manual_seed(3)
    again = encoded_train[2][0]
    assert (first.box, first.flip) == (again.box, again.flip)
    cl = decoder(
        collate_encoded([encoded_train[i] for i in range(4)])[0],
        torch.device("cpu"),
        memory_format=torch.channels_last,
    )
    assert cl.is_contiguous(memory_format=torch.channels_last) and cl.shape == (4, 3, 24, 24)


def test_decode_cuda_files_that_are_not_jpeg_inside_follow_on_bad_sample(tmp_path):
    root = _tree(tmp_path)
    bad = root / "train" / "a" / "01.jpg"
    bad.write_bytes(random.Random(0).randbytes(300))
    train, _ = build_datasets(_cfg(root, decode="cuda"))
    with pytest.raises(BadSampleError, match="01.jpg"):
        train[1]
    skipping, _ = build_datasets(_cfg(root, decode="cuda", on_bad_sample="skip"))
    image, label = skipping[1]
    assert image.path.endswith("02.jpg") and label == 0 and skipping.skipped() == 1


def test_device_decoder_names_a_file_the_decoder_cannot_decode(tmp_path):
    root = _tree(tmp_path)
    train, _ = build_datasets(_cfg(root, decode="cuda"))
    samples = [train[i][0] for i in range(3)]
    broken = samples[1]
    # A JPEG header followed by garbage: the loader's header check passes, decoding fails.
    broken.data = torch.cat([broken.data[:200], torch.zeros(50, dtype=torch.uint8)])
    batch, _ = collate_encoded([(s, 0) for s in samples])
    with pytest.raises(BadSampleError, match=broken.path.replace("\\", "\\\\")):
        train.device_decoder(batch, torch.device("cpu"))


def test_device_normalize_pickles_without_its_device_tensors():
    import pickle

    normalize = DeviceNormalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    images = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    assert torch.equal(normalize(images), torch.full((1, 3, 2, 2), 2.0))
    assert normalize._stats  # cached on the device it ran on
    copy = pickle.loads(pickle.dumps(normalize))  # as spawned loader workers receive it
    assert copy == normalize and copy._stats == {}
    assert torch.equal(copy(images), normalize(images))
