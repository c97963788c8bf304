"""data.augment.* and data.mixup_alpha / data.cutmix_alpha: each key changes the transforms as
the schema documents, bad values stop before launch naming the key, the uint8 device path still
equals the float path, the batch mixer is torchvision's MixUp / CutMix seeded per batch, and a
run with all four (auto-augment, random erasing, mixup, cutmix) resumes bitwise."""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import InterpolationMode

from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import AugmentConfig, Config, DataConfig
from sdnet_trainer.data import build_datasets, validate_data
from sdnet_trainer.data.augment import (
    BatchMixer,
    crop_sizes,
    resolve_preset,
)
from sdnet_trainer.data.cifar import cifar10_transforms
from sdnet_trainer.data.loader import RunData
from sdnet_trainer.data.normalize import DeviceNormalize, defer_normalization
from sdnet_trainer.data.transforms import build_transforms
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.preflight import validate
from tests.support import TINY, FaultTrainer


def _data(**augment) -> DataConfig:
    image_size = augment.pop("image_size", 32)
    return DataConfig(image_size=image_size, augment=AugmentConfig(**augment))


def _types(transform: v2.Compose) -> list[str]:
    return [type(t).__name__ for t in transform.transforms]


def _image(width: int = 40, height: int = 30, seed: int = 0) -> Image.Image:
    rng = random.Random(seed)
    coarse = Image.frombytes("RGB", (4, 3), bytes(rng.randrange(256) for _ in range(36)))
    return coarse.resize((width, height), Image.Resampling.BICUBIC)


def _seeded(transform, image, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return transform(image)


TAIL = ["PILToTensor", "ToDtype", "Normalize"]


# --------------------------------------------------------------------------------------------
# Presets and keys
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image_size, train_crop, decode, expected",
    [
        (32, None, "cpu", "cifar"),
        (64, None, "cpu", "cifar"),  # at most 64 px
        (65, None, "cpu", "imagenet"),
        (224, 48, "cpu", "cifar"),  # the train crop decides, not image_size
        (32, None, "cuda", "imagenet"),  # the device decoder's only recipe
    ],
)
def test_auto_preset_follows_the_train_crop(image_size, train_crop, decode, expected):
    cfg = DataConfig(image_size=image_size, decode=decode)
    cfg.augment.train_crop_size = train_crop
    assert resolve_preset(cfg) == expected
    assert resolve_preset(_data(preset="none", image_size=image_size)) == "none"


def test_imagenet_preset_is_the_reference_recipe():
    train, val = build_transforms(_data(preset="imagenet", image_size=224))
    assert _types(train) == ["RandomResizedCrop", "RandomHorizontalFlip", *TAIL]
    assert _types(val) == ["Resize", "CenterCrop", *TAIL]
    crop, flip = train.transforms[:2]
    assert crop.size == (224, 224) and crop.scale == (0.08, 1.0) and flip.p == 0.5
    resize, center = val.transforms[:2]
    assert resize.size == [256] and center.size == (224, 224)  # 224 / 0.875
    out = _seeded(train, _image(500, 375))
    assert out.shape == (3, 224, 224) and out.dtype == torch.float32
    assert val(_image(500, 375)).shape == (3, 224, 224)


def test_cifar_preset_pads_by_an_eighth_and_keeps_small_images_whole():
    train, val = build_transforms(_data(image_size=32, hflip=0.0))
    assert _types(train) == ["Resize", "CenterCrop", "RandomCrop", *TAIL]
    assert train.transforms[2].padding == [4, 4, 4, 4]  # 32 / 8
    assert build_transforms(_data(image_size=16))[0].transforms[2].padding == [2, 2, 2, 2]
    # A 32x32 image: val takes it as is; train shifts it by at most 4 px into a zero border.
    white = Image.new("RGB", (32, 32), (255, 255, 255))
    as_is = v2.Compose(val.transforms[2:])(white)  # the tail alone
    assert torch.equal(val(white), as_is)
    shifted = 0
    for seed in range(20):
        padded = (_seeded(train, white, seed) != as_is).any(dim=0)  # the black border
        rows, cols = padded.all(dim=1), padded.all(dim=0)
        assert rows.sum() <= 4 and cols.sum() <= 4
        assert torch.equal(padded, rows[:, None] | cols[None, :])
        shifted += bool(padded.any())
    assert shifted > 10
    # Another size: resized to the crop (short side), then center-cropped.
    assert val(_image(40, 30)).shape == (3, 32, 32)
    assert _seeded(train, _image(40, 30)).shape == (3, 32, 32)


def test_none_preset_only_resizes():
    train, val = build_transforms(_data(preset="none", image_size=24))
    assert _types(train) == _types(val) == ["Resize", *TAIL]
    image = _image(40, 30)
    assert torch.equal(_seeded(train, image, 1), _seeded(train, image, 2))  # nothing random
    assert torch.equal(train(image), val(image)) and val(image).shape == (3, 24, 24)


def test_hflip_is_the_flip_probability():
    image = _image(32, 32)
    never, _ = build_transforms(_data(hflip=0.0))
    always, _ = build_transforms(_data(hflip=1.0))
    assert "RandomHorizontalFlip" not in _types(never)
    for seed in range(3):  # the same crop, mirrored
        assert torch.equal(_seeded(always, image, seed), _seeded(never, image, seed).flip(-1))


@pytest.mark.parametrize(
    "policy, cls, attributes",
    [
        ("ta_wide", v2.TrivialAugmentWide, {}),
        ("ra", v2.RandAugment, {"magnitude": 5}),
        ("augmix", v2.AugMix, {"severity": 7}),
        ("imagenet", v2.AutoAugment, {"policy": v2.AutoAugmentPolicy.IMAGENET}),
    ],
)
def test_auto_augment_adds_the_policy_after_the_crop(policy, cls, attributes):
    # AugMix warps tensors, which torchvision does not do bicubic.
    interpolation = "nearest" if policy == "augmix" else "bicubic"
    cfg = _data(auto_augment=policy, ra_magnitude=5, augmix_severity=7, interpolation=interpolation)
    train, val = build_transforms(cfg)
    names = _types(train)
    assert names.index(cls.__name__) == names.index("RandomHorizontalFlip") + 1
    added = train.transforms[names.index(cls.__name__)]
    assert isinstance(added, cls) and added.interpolation == InterpolationMode(interpolation)
    for name, value in attributes.items():
        assert getattr(added, name) == value
    assert _types(val) == ["Resize", "CenterCrop", *TAIL]  # validation is never augmented
    plain, _ = build_transforms(_data())
    image = _image(32, 32)
    assert any(
        not torch.equal(_seeded(train, image, s), _seeded(plain, image, s)) for s in range(5)
    )


def test_random_erase_follows_normalize_and_fills_with_the_mean():
    train, _ = build_transforms(_data(random_erase=1.0, hflip=0.0))
    assert _types(train)[-2:] == ["Normalize", "RandomErasing"] and train.transforms[-1].p == 1.0
    plain, _ = build_transforms(_data(hflip=0.0))
    image = _image(32, 32)
    erased, kept = _seeded(train, image), _seeded(plain, image)
    changed = erased != kept
    assert changed.any() and (erased[changed] == 0).all()  # 0: the mean colour, normalized
    assert "RandomErasing" not in _types(plain)


def test_interpolation_reaches_every_resize():
    for name, mode in (
        ("nearest", InterpolationMode.NEAREST),
        ("bicubic", InterpolationMode.BICUBIC),
    ):
        train, val = build_transforms(_data(preset="imagenet", interpolation=name))
        assert train.transforms[0].interpolation == mode and val.transforms[0].interpolation == mode
    image = _image(50, 40)
    nearest = build_transforms(_data(interpolation="nearest"))[1](image)
    bilinear = build_transforms(_data(interpolation="bilinear"))[1](image)
    assert not torch.equal(nearest, bilinear)


def test_crop_and_resize_sizes():
    cfg = _data(preset="imagenet", image_size=224, train_crop_size=176, val_resize_size=232)
    assert crop_sizes(cfg) == (176, 232, 224)
    train, val = build_transforms(cfg)
    image = _image(300, 260)
    assert _seeded(train, image).shape == (3, 176, 176) and val(image).shape == (3, 224, 224)
    assert val.transforms[0].size == [232]
    cfg = _data(preset="imagenet", image_size=224, val_crop_size=160)
    assert crop_sizes(cfg) == (224, 183, 160)  # resize 160 / 0.875
    assert build_transforms(cfg)[1](image).shape == (3, 160, 160)
    assert crop_sizes(_data(image_size=32, val_crop_size=28)) == (32, 28, 28)  # cifar: as is


def test_cifar10_keeps_its_own_statistics():
    train, val = cifar10_transforms()
    assert train.transforms[-1].mean == [0.4914, 0.4822, 0.4465]
    assert val.transforms[-1].std == [0.2470, 0.2435, 0.2616]


def test_quickstart_on_a_folder_reads_small_images_with_the_cifar_preset():
    cfg = compose(["+recipe=quickstart", "data=imagefolder", "data.root=/data/digits"])
    assert cfg.data.image_size == 32 and resolve_preset(cfg.data) == "cifar"


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value",
    [
        ("augment.preset", "cifar10"),
        ("augment.auto_augment", "trivial"),
        ("augment.interpolation", "lanczos"),
        ("augment.ra_magnitude", 31),
        ("augment.ra_magnitude", -1),
        ("augment.augmix_severity", 0),
        ("augment.augmix_severity", 11),
        ("augment.random_erase", 1.5),
        ("augment.random_erase", -0.1),
        ("augment.hflip", 2.0),
        ("augment.train_crop_size", 0),
        ("augment.val_resize_size", -4),
        ("augment.val_crop_size", 0),
        ("mixup_alpha", -0.2),
        ("cutmix_alpha", -1.0),
    ],
)
def test_bad_values_fail_validation_naming_the_key(key, value):
    cfg = Config(data=DataConfig(name="imagefolder"))
    owner = cfg.data.augment if key.startswith("augment.") else cfg.data
    setattr(owner, key.split(".")[-1], value)
    with pytest.raises(ConfigError, match=rf"data\.{re.escape(key)}='?{re.escape(str(value))}"):
        validate_data(cfg)


def test_the_whole_config_check_runs_them():
    cfg = compose([*TINY, "data.augment.preset=imagnet"])
    with pytest.raises(ConfigError, match="data.augment.preset='imagnet'.*did you mean 'imagenet'"):
        validate(cfg, world_size=1)


@pytest.mark.parametrize(
    "data", [["data=tokens"], ["data=text"], ["data=hf", "data.root=/d", "data.text_column=text"]]
)
def test_language_model_data_refuses_image_options_naming_them(data):
    base = [*TINY, "model=gpt_small", *data]
    validate(compose(base), world_size=1)
    cfg = compose([*base, "data.mixup_alpha=0.2", "data.augment.auto_augment=ta_wide"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=1)
    message = str(err.value)
    assert "data.mixup_alpha" in message and "data.augment.auto_augment" in message
    assert "language-model data" in message


def test_generated_images_ignore_augment_with_a_warning(caplog):
    cfg = Config(data=DataConfig(name="synthetic", mixup_alpha=0.2))
    cfg.data.augment.random_erase = 0.25
    with caplog.at_level(logging.WARNING, logger="sdnet_trainer.data"):
        validate_data(cfg)  # mixing applies: synthetic batches are image classifier batches
    assert "data.augment.random_erase" in caplog.text and "ignored" in caplog.text


def test_combinations_that_cannot_work_name_their_keys():
    augmix = _data(auto_augment="augmix", interpolation="bicubic")
    with pytest.raises(ConfigError, match="augmix .* not data.augment.interpolation=bicubic"):
        validate_data(Config(data=augmix))
    with pytest.raises(ConfigError, match="data.augment.val_resize_size=40 .*preset=none"):
        validate_data(Config(data=_data(preset="none", val_resize_size=40)))
    cuda = Config(data=DataConfig(name="imagefolder", decode="cuda", image_size=224))
    validate_data(cuda)
    cuda.data.augment = AugmentConfig(auto_augment="ta_wide", train_crop_size=176)
    with pytest.raises(ConfigError, match="data.decode=cuda") as err:
        validate_data(cuda)
    assert "data.augment.auto_augment=ta_wide" in str(err.value)
    assert "train_crop_size" in str(err.value) and "data.decode=cpu" in str(err.value)


# --------------------------------------------------------------------------------------------
# The uint8 device path
# --------------------------------------------------------------------------------------------


def _folder(root: Path, *, train_per_class: int = 10, val_per_class: int = 2, size=16) -> Path:
    """Two classes of small PNGs told apart by their colour balance."""
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for label in range(2):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                rng = random.Random(1000 * label + 100 * (split == "val") + i)
                base = (200, 60, 60) if label == 0 else (60, 60, 200)
                pixels = bytes(
                    max(0, min(255, c + rng.randrange(-50, 50)))
                    for _ in range(size * size)
                    for c in base
                )
                Image.frombytes("RGB", (size, size), pixels).save(folder / f"{i:02d}.png")
    return root


def _run_data(cfg: DataConfig, *, uint8_inputs: bool, micro_batch_size: int = 4) -> RunData:
    train, val = build_datasets(cfg)
    return RunData(
        train, val, cfg=cfg, device=torch.device("cpu"), micro_batch_size=micro_batch_size,
        grad_accum_steps=1, eval_batch_size=4, dp_size=1, dp_rank=0, seed=3,
        uint8_inputs=uint8_inputs,
    )  # fmt: skip


class _Position:
    epoch = 0
    epoch_sample = 0


def _train_batches(data: RunData) -> list:
    data.start(_Position())
    try:
        return [data.next_batch() for _ in range(data.steps_per_epoch)]
    finally:
        data.close()


def _folder_cfg(root: Path, **data) -> DataConfig:
    augment = data.pop("augment", {})
    return DataConfig(
        name="imagefolder", root=str(root), image_size=16, num_classes=2, num_workers=0,
        persistent_workers=False, augment=AugmentConfig(**augment), **data,
    )  # fmt: skip


def test_auto_augment_and_mixing_keep_the_uint8_path_bitwise(tmp_path):
    cfg = _folder_cfg(
        _folder(tmp_path), augment={"auto_augment": "ta_wide"}, mixup_alpha=0.4, cutmix_alpha=1.0
    )
    floats = _run_data(cfg, uint8_inputs=False)
    uint8 = _run_data(cfg, uint8_inputs=True)
    assert uint8.normalize == DeviceNormalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    raw, _ = next(iter(uint8.train_loader))
    assert raw.dtype == torch.uint8
    for (want_x, want_y), (got_x, got_y) in zip(_train_batches(floats), _train_batches(uint8)):
        assert got_y.shape == (4, 2) and got_y.dtype == torch.float32  # soft targets
        assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y)


def test_a_transform_of_ones_own_with_totensor_is_still_deferred(tmp_path):
    """The older tail, ToTensor -> Normalize, divides by 255 where v2's ToDtype multiplies by
    1 / 255: the device half follows whichever the transform has, bit for bit."""
    from torchvision import transforms

    train, _ = build_datasets(_folder_cfg(_folder(tmp_path, train_per_class=2)))
    train.transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.4, 0.5, 0.6), (0.2, 0.3, 0.25))]
    )
    deferred = defer_normalization(train)
    assert deferred is not None
    uint8_set, normalize = deferred
    assert normalize == DeviceNormalize((0.4, 0.5, 0.6), (0.2, 0.3, 0.25), divide=True)
    for i in range(len(train)):
        assert torch.equal(normalize(uint8_set[i][0][None])[0], train[i][0])


def test_random_erasing_keeps_normalization_in_the_loader(tmp_path, caplog):
    cfg = _folder_cfg(_folder(tmp_path), augment={"random_erase": 0.5})
    train, _ = build_datasets(cfg)
    assert defer_normalization(train) is None  # erasing follows Normalize
    cfg_off = _folder_cfg(tmp_path, augment={"random_erase": 0.0})
    assert defer_normalization(build_datasets(cfg_off)[0]) is not None
    floats = _run_data(cfg, uint8_inputs=False)
    with caplog.at_level(logging.INFO, logger="sdnet_trainer.data.loader"):
        asked = _run_data(cfg, uint8_inputs=True)
    assert asked.normalize is None and "data.augment.random_erase" in caplog.text
    for (want_x, _), (got_x, _) in zip(_train_batches(floats), _train_batches(asked)):
        assert torch.equal(got_x, want_x)


# --------------------------------------------------------------------------------------------
# The batch mixer
# --------------------------------------------------------------------------------------------

PLACE = dict(epoch=1, step_sample=64, micro_step=0, dp_rank=0)


def _batch(n: int = 6, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 8, 8, generator=g), torch.arange(n) % classes


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_mixer_is_torchvisions_transform_seeded_by_the_batch(kind):
    alphas = {"mixup_alpha": 0.4 if kind == "mixup" else 0.0}
    alphas["cutmix_alpha"] = 1.0 if kind == "cutmix" else 0.0
    mixer = BatchMixer(**alphas, num_classes=3, seed=7)
    images, labels = _batch()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    mixed, targets = mixer((images, labels), **PLACE)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's stream is untouched
    # The reference: torchvision's transform, drawing from a generator seeded the same way.
    reference = v2.MixUp(alpha=0.4, num_classes=3) if kind == "mixup" else v2.CutMix(num_classes=3)
    torch.manual_seed(mixer.batch_seed(**PLACE))
    want_images, want_targets = reference(images, labels)
    assert torch.equal(mixed, want_images) and torch.equal(targets, want_targets)
    assert targets.shape == (6, 3) and torch.allclose(targets.sum(1), torch.ones(6))
    assert not torch.equal(mixed, images)
    # The same batch mixes the same way whatever the global state; another place differently.
    torch.manual_seed(999)
    assert torch.equal(mixer((images, labels), **PLACE)[1], targets)
    moved = {**PLACE, "micro_step": 1}
    assert not torch.equal(mixer((images, labels), **moved)[1], targets)


def test_both_alphas_draw_one_of_the_two_per_batch_and_pass_extra_items():
    mixer = BatchMixer(mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=3, seed=0)
    assert isinstance(mixer.transform, v2.RandomChoice)
    images, labels = _batch()
    kinds = set()
    for step in range(12):
        mixed, targets, index = mixer((images, labels, "kept"), **{**PLACE, "step_sample": step})
        assert index == "kept"
        # CutMix copies whole pixels from the rolled batch; MixUp blends every pixel.
        copied = (mixed == images) | (mixed == images.roll(1, 0))
        kinds.add("cutmix" if copied.all() else "mixup")
    assert kinds == {"mixup", "cutmix"}


def test_mixer_refuses_batches_that_are_not_image_classification():
    mixer = BatchMixer(mixup_alpha=0.2, cutmix_alpha=0.0, num_classes=4, seed=0)
    tokens = (torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"data.mixup_alpha / data.cutmix_alpha .*\(2, 16\)"):
        mixer(tokens, **PLACE)
    assert BatchMixer.from_config(DataConfig(), seed=0) is None
    with pytest.raises(ConfigError, match="data.num_classes is null"):
        BatchMixer.from_config(DataConfig(mixup_alpha=0.2), seed=0)


def test_soft_targets_train_through_the_trainers_loss(tmp_path):
    """Synthetic images with both mixers: the loss takes (B, C) targets, label smoothing too,
    and evaluation still counts top-1 / top-5 against the true labels."""
    cfg = compose(
        [*TINY, "loop.max_steps=4", "loop.global_batch_size=16", "data.mixup_alpha=0.2",
         "data.cutmix_alpha=1.0", "loss.label_smoothing=0.1", "logging.trackers=[]"]
    )  # fmt: skip
    seen: list[tuple[int, ...]] = []

    class Recording(FaultTrainer):
        def compute_loss(self, batch):
            seen.append(tuple(batch[1].shape))
            return super().compute_loss(batch)

    metrics = Recording(cfg, output_dir=tmp_path).fit()
    assert seen == [(16, 10)] * 4
    assert 0 <= metrics["val/top1"] <= 100 and metrics["val/top5"] >= metrics["val/top1"]


# --------------------------------------------------------------------------------------------
# Stop and resume
# --------------------------------------------------------------------------------------------


class _MixingTrainer(FaultTrainer):
    """Also records the shape of each micro-batch's targets (FaultTrainer records the losses and
    the samples)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.target_shapes: list[tuple[int, ...]] = []

    def compute_loss(self, batch):
        self.target_shapes.append(tuple(batch[1].shape))
        return super().compute_loss(batch)


def test_all_four_under_a_stop_and_resume_are_bitwise(tmp_path, monkeypatch):
    """ta_wide, random erasing, mixup and cutmix, loader workers: a run stopped after step 3 and
    resumed equals the uninterrupted one (20 images, 8 a step: an epoch boundary every 2)."""
    root = _folder(tmp_path / "images")
    cfg = compose(
        [
            *TINY,
            "data=imagefolder",
            f"data.root={root}",
            "data.image_size=16",
            "data.num_classes=null",
            "data.num_workers=2",
            "data.augment.auto_augment=ta_wide",
            "data.augment.random_erase=0.5",
            "data.mixup_alpha=0.4",
            "data.cutmix_alpha=1.0",
            "loop.max_steps=6",
            "loop.global_batch_size=8",
            "loop.grad_accum_steps=2",
            "loop.eval_at_end=false",
            "logging.trackers=[]",
        ]
    )
    reference = _MixingTrainer(cfg, output_dir=tmp_path / "ref")
    reference.fit()
    assert reference.target_shapes == [(4, 2)] * 12  # 6 steps x 2 micro-batches, mixed
    monkeypatch.setenv("SDNET_TEST_SIGTERM", "0:2")  # agreed, and saved, at step 3
    with pytest.raises(SystemExit):
        _MixingTrainer(cfg, output_dir=tmp_path / "run").fit()
    monkeypatch.delenv("SDNET_TEST_SIGTERM")
    resumed = _MixingTrainer(cfg, output_dir=tmp_path / "run")
    resumed.fit()
    assert resumed.state.step == 6
    assert resumed.losses == reference.losses[3:]  # bitwise, step by step
    assert resumed.seen == reference.seen[3 * 8 :]
    for name, value in reference.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


# --------------------------------------------------------------------------------------------
# The resnet50 recipe
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 8])
def test_resnet50_recipe_composes_validates_and_maps_torchvisions_command(world_size):
    cfg = compose(["+recipe=resnet50"])
    validate(cfg, world_size=world_size)
    data, aug = cfg.data, cfg.data.augment
    assert (cfg.model.name, data.name, cfg.loop.global_batch_size) == (
        "resnet50",
        "imagefolder",
        1024,
    )
    assert (aug.auto_augment, aug.random_erase, data.mixup_alpha, data.cutmix_alpha) == (
        "ta_wide", 0.1, 0.2, 1.0,
    )  # fmt: skip
    assert crop_sizes(data) == (176, 232, 224) and resolve_preset(data) == "imagenet"
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.momentum) == ("SGD", 0.5, 0.9)
    assert (cfg.optim.weight_decay, cfg.optim.no_decay_norm_and_bias) == (2e-5, True)
    assert (cfg.loss.label_smoothing, cfg.sched.name, cfg.loop.max_epochs) == (0.1, "cosine", 600)
    steps_per_epoch = 1_281_167 // 1024  # ImageNet-1k's training images, whole batches
    assert cfg.sched.warmup_steps == 5 * steps_per_epoch == cfg.model.ema.warmup_steps
    assert cfg.sched.warmup_start_factor == 0.01
    # torchvision's EMA: decay 0.99998 every 32 steps, adjusted by 8 x 128 x 32 / 600 epochs.
    ema = cfg.model.ema
    assert ema.enabled and ema.every_n_steps == 32
    assert ema.decay == pytest.approx(1 - 0.00002 * 8 * 128 * 32 / 600, abs=1e-8)


def test_resnet50_transforms_on_an_imagenet_sized_image():
    train, val = build_transforms(compose(["+recipe=resnet50"]).data)
    assert _types(train) == [
        "RandomResizedCrop", "RandomHorizontalFlip", "TrivialAugmentWide", *TAIL, "RandomErasing",
    ]  # fmt: skip
    image = _image(500, 375)
    assert _seeded(train, image).shape == (3, 176, 176) and val(image).shape == (3, 224, 224)
