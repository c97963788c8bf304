"""Unit tests for sdnet_trainer.data: datasets, samplers and the loader policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data import (
    CheckedImageFolder,
    GlobalBatchSampler,
    ShardedEvalSampler,
    SyntheticImages,
    build_datasets,
    build_loader,
    skipped_samples,
)
from sdnet_trainer.data.loader import train_loader
from sdnet_trainer.data.seeding import draws_random
from sdnet_trainer.errors import ConfigError

# --------------------------------------------------------------------------------------------
# Synthetic images
# --------------------------------------------------------------------------------------------


def _synthetic(
    size: int = 200, *, split: str = "train", seed: int = 7, **overrides
) -> SyntheticImages:
    kwargs = dict(image_size=16, channels=3, num_classes=5, seed=seed, signal=1.0, noise=1.0)
    kwargs.update(overrides)
    return SyntheticImages(size, split=split, **kwargs)


def _stack(ds: SyntheticImages) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*(ds[i] for i in range(len(ds))))
    return torch.stack(images), torch.tensor(labels)


def _class_means(images: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    return torch.stack([images[labels == c].mean(0) for c in range(num_classes)])


def _nearest_mean_accuracy(train: SyntheticImages, val: SyntheticImages) -> float:
    x_tr, y_tr = _stack(train)
    x_va, y_va = _stack(val)
    means = _class_means(x_tr, y_tr, train.num_classes).flatten(1)
    pred = torch.cdist(x_va.flatten(1), means).argmin(1)
    return (pred == y_va).float().mean().item()


def test_synthetic_item_is_pure_function_of_index():
    ds = _synthetic()
    for i in (0, 17, 199):
        a, la = ds[i]
        b, lb = ds[i]
        assert torch.equal(a, b) and la == lb
    # A second instance with the same arguments is the same dataset.
    again = _synthetic()
    assert torch.equal(ds[5][0], again[5][0]) and ds[5][1] == again[5][1]
    assert not torch.equal(ds[0][0], ds[1][0])


def test_synthetic_shapes_dtypes_and_labels():
    ds = _synthetic(50, image_size=12, channels=1, num_classes=4)
    assert len(ds) == 50
    for i in range(len(ds)):
        image, label = ds[i]
        assert image.shape == (1, 12, 12)
        assert image.dtype == torch.float32
        assert isinstance(label, int) and 0 <= label < 4
    with pytest.raises(IndexError):
        ds[50]


def test_synthetic_labels_balanced_and_shuffled():
    ds = _synthetic(1000, num_classes=10)
    labels = torch.tensor([ds[i][1] for i in range(len(ds))])
    counts = torch.bincount(labels, minlength=10)
    assert counts.min() >= 80 and counts.max() <= 120, counts
    # Not simply i % num_classes: an unshuffled loader must still see mixed classes.
    assert not torch.equal(labels, torch.arange(1000) % 10)


def test_synthetic_train_and_val_share_prototypes():
    train, val = _synthetic(500, split="train"), _synthetic(500, split="val")
    # Different noise streams per split (signal=0 leaves only the noise)...
    assert not torch.equal(
        _synthetic(signal=0.0, split="train")[0][0], _synthetic(signal=0.0, split="val")[0][0]
    )
    # ...but the same class prototypes: class c's val mean is nearest to class c's train mean.
    m_tr = _class_means(*_stack(train), 5).flatten(1)
    m_va = _class_means(*_stack(val), 5).flatten(1)
    dist = torch.cdist(m_va, m_tr)
    assert torch.equal(dist.argmin(1), torch.arange(5))
    same = dist.diagonal()
    other = dist + torch.eye(5) * 1e9
    assert same.max() < 0.5 * other.min()


def test_synthetic_seed_changes_data():
    a, b = _synthetic(seed=1), _synthetic(seed=2)
    assert not torch.equal(a[0][0], b[0][0])
    assert not torch.equal(a.prototypes, b.prototypes)


def test_synthetic_is_learnable_and_signal_matters():
    train, val = _synthetic(300, split="train"), _synthetic(200, split="val")
    assert _nearest_mean_accuracy(train, val) > 0.9
    no_signal = dict(signal=0.0)
    chance = _nearest_mean_accuracy(
        _synthetic(300, split="train", **no_signal), _synthetic(200, split="val", **no_signal)
    )
    assert chance < 0.4  # chance is 0.2 for 5 classes


def test_build_datasets_synthetic_from_config():
    cfg = DataConfig(name="synthetic", train_size=40, val_size=12, image_size=8, num_classes=3)
    train, val = build_datasets(cfg)
    assert (len(train), len(val)) == (40, 12)
    assert train[0][0].shape == (3, 8, 8)
    assert torch.equal(train.prototypes, val.prototypes)
    with pytest.raises(ConfigError, match="data.train_size"):
        build_datasets(DataConfig(name="synthetic", train_size=0))


def test_build_datasets_unknown_name():
    with pytest.raises(ConfigError, match="data.name") as err:
        build_datasets(DataConfig(name="mnist"))
    assert "mnist" in str(err.value) and "imagefolder" in str(err.value)


# --------------------------------------------------------------------------------------------
# GlobalBatchSampler
# --------------------------------------------------------------------------------------------


def _rank_batches(size: int, *, world: int, m: int, accum: int, **kwargs) -> list[list[list[int]]]:
    """batches[r][j] = rank r's j-th micro-batch of one iteration."""
    return [
        list(
            GlobalBatchSampler(
                size, micro_batch_size=m, world_size=world, rank=r, grad_accum_steps=accum, **kwargs
            )
        )
        for r in range(world)
    ]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("accum", [1, 2])
def test_global_sampler_ranks_match_single_process(world, accum):
    size, m = 101, 3
    g = world * accum * m
    steps = size // g
    per_rank = _rank_batches(size, world=world, m=m, accum=accum, seed=3)
    single = _rank_batches(size, world=1, m=world * m, accum=accum, seed=3)[0]

    assert all(len(batches) == steps * accum for batches in per_rank)
    assert all(len(b) == m for batches in per_rank for b in batches)
    union = [i for batches in per_rank for b in batches for i in b]
    assert len(union) == steps * g == len(set(union))
    assert all(0 <= i < size for i in union)
    for j, reference in enumerate(single):
        together = [i for r in range(world) for i in per_rank[r][j]]
        assert together == reference


def test_global_sampler_len_and_properties():
    s = GlobalBatchSampler(100, micro_batch_size=4, world_size=2, rank=1, grad_accum_steps=3)
    assert s.global_batch_size == 24
    assert s.steps_per_epoch == 4
    assert len(s) == 12 == len(list(s))


def test_global_sampler_drop_last_false_pads_full_steps():
    size, world, m, accum = 50, 2, 4, 2
    per_rank = _rank_batches(size, world=world, m=m, accum=accum, drop_last=False)
    sampler = GlobalBatchSampler(
        size, micro_batch_size=m, world_size=world, rank=0, grad_accum_steps=accum, drop_last=False
    )
    assert sampler.steps_per_epoch == 4  # ceil(50 / 16)
    assert all(len(b) == m for batches in per_rank for b in batches)
    union = [i for batches in per_rank for b in batches for i in b]
    assert len(union) == 4 * 16
    assert set(union) == set(range(size))


def test_global_sampler_epoch_order_is_deterministic_and_changes():
    def order(epoch: int, seed: int = 0) -> list[list[int]]:
        s = GlobalBatchSampler(64, micro_batch_size=4, world_size=2, rank=0, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    assert order(0) == order(0)
    assert order(1) == order(1)
    assert order(0) != order(1)
    assert order(0, seed=5) != order(0, seed=0)
    # seed + epoch defines the permutation.
    assert order(1, seed=0) == order(0, seed=1)


def test_global_sampler_start_step_yields_tail_then_resets():
    s = GlobalBatchSampler(100, micro_batch_size=3, world_size=2, rank=1, grad_accum_steps=2)
    s.set_epoch(2)
    full = list(s)
    s.set_start_step(5)
    assert len(s) == (s.steps_per_epoch - 5) * 2
    assert list(s) == full[5 * 2 :]
    # The offset applies once: the next iteration starts at the beginning again.
    assert len(s) == len(full)
    assert list(s) == full
    s.set_start_step(s.steps_per_epoch)
    assert list(s) == []
    with pytest.raises(ValueError):
        s.set_start_step(s.steps_per_epoch + 1)


def test_global_sampler_no_shuffle_is_arange():
    per_rank = _rank_batches(40, world=2, m=2, accum=2, shuffle=False)
    single = _rank_batches(40, world=1, m=4, accum=2, shuffle=False)[0]
    assert [i for b in single for i in b] == list(range(40))
    assert [i for j in range(len(single)) for r in range(2) for i in per_rank[r][j]] == list(
        range(40)
    )


def test_global_sampler_too_small_dataset():
    with pytest.raises(ConfigError, match="global_batch_size") as err:
        GlobalBatchSampler(10, micro_batch_size=3, world_size=4, rank=0, grad_accum_steps=2)
    assert "24" in str(err.value) and "10" in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(micro_batch_size=0, world_size=1, rank=0),
        dict(micro_batch_size=2, world_size=2, rank=2),
        dict(micro_batch_size=2, world_size=2, rank=-1),
        dict(micro_batch_size=2, world_size=0, rank=0),
        dict(micro_batch_size=2, world_size=1, rank=0, grad_accum_steps=0),
    ],
)
def test_global_sampler_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        GlobalBatchSampler(100, **kwargs)


# --------------------------------------------------------------------------------------------
# ShardedEvalSampler
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 3, 4])
def test_sharded_eval_sampler_covers_each_index_once(world):
    n = 10
    shards = [list(ShardedEvalSampler(n, world_size=world, rank=r)) for r in range(world)]
    flat = [i for shard in shards for i in shard]
    assert sorted(flat) == list(range(n))
    assert [len(ShardedEvalSampler(n, world_size=world, rank=r)) for r in range(world)] == [
        len(s) for s in shards
    ]
    with pytest.raises(ValueError):
        ShardedEvalSampler(n, world_size=world, rank=world)


# --------------------------------------------------------------------------------------------
# Image folders and CIFAR-10
# --------------------------------------------------------------------------------------------


def _write_images(folder: Path, count: int) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (20, 24), color=(40 * i, 100, 200)).save(folder / f"img{i}.png")


def _image_tree(root: Path, classes=("cat", "dog")) -> Path:
    for split in ("train", "val"):
        for name in classes:
            _write_images(root / split / name, 2)
    return root


def _folder_cfg(root, **overrides) -> DataConfig:
    return DataConfig(
        name="imagefolder",
        root=None if root is None else str(root),
        image_size=16,
        num_classes=2,
        **overrides,
    )


def test_imagefolder_loads(tmp_path):
    train, val = build_datasets(_folder_cfg(_image_tree(tmp_path)))
    assert (len(train), len(val)) == (4, 4)
    # data.on_bad_sample (tests/unit/test_bad_samples.py): error by default, so nothing counted.
    assert isinstance(train, CheckedImageFolder) and train.on_bad_sample == "error"
    assert train.skipped is None and skipped_samples(train) is None
    for ds in (train, val):
        image, label = ds[0]
        assert image.shape == (3, 16, 16) and image.dtype == torch.float32
        assert label in (0, 1)


def test_imagefolder_missing_root(tmp_path):
    with pytest.raises(ConfigError, match="data.root"):
        build_datasets(_folder_cfg(None))
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="data.root") as err:
        build_datasets(_folder_cfg(missing))
    assert str(missing) in str(err.value)


def test_imagefolder_missing_val(tmp_path):
    _write_images(tmp_path / "train" / "cat", 1)
    with pytest.raises(ConfigError, match="data.root") as err:
        build_datasets(_folder_cfg(tmp_path))
    assert "val" in str(err.value)


@pytest.mark.parametrize("layout", ["no_class_folders", "no_images"])
def test_imagefolder_empty_train(tmp_path, layout):
    _image_tree(tmp_path)
    for child in (tmp_path / "train").rglob("*.png"):
        child.unlink()
    if layout == "no_class_folders":
        for child in (tmp_path / "train").iterdir():
            child.rmdir()
    with pytest.raises(ConfigError, match="data.root") as err:
        build_datasets(_folder_cfg(tmp_path))
    assert str(tmp_path / "train") in str(err.value)


def test_imagefolder_class_count_mismatch(tmp_path):
    _image_tree(tmp_path, classes=("a", "b", "c"))
    with pytest.raises(ConfigError, match="data.num_classes") as err:
        build_datasets(_folder_cfg(tmp_path))
    assert "2" in str(err.value) and "3" in str(err.value)


def test_imagefolder_val_classes_must_match_train(tmp_path):
    _image_tree(tmp_path)
    (tmp_path / "val" / "dog").rename(tmp_path / "val" / "wolf")
    with pytest.raises(ConfigError, match="wolf"):
        build_datasets(_folder_cfg(tmp_path))


def test_cifar10_missing_data(tmp_path):
    with pytest.raises(ConfigError, match="data.root") as err:
        build_datasets(DataConfig(name="cifar10", root=str(tmp_path), download=False))
    assert str(tmp_path) in str(err.value) and "data.download" in str(err.value)
    with pytest.raises(ConfigError, match="data.root"):
        build_datasets(DataConfig(name="cifar10", root=None))


# --------------------------------------------------------------------------------------------
# build_loader
# --------------------------------------------------------------------------------------------


def _loader_batches(num_workers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = DataConfig(num_workers=num_workers, pin_memory=True, persistent_workers=False)
    ds = _synthetic(24, image_size=8)
    sampler = GlobalBatchSampler(len(ds), micro_batch_size=4, world_size=2, rank=1, seed=1)
    loader = build_loader(ds, cfg=cfg, device_type="cpu", batch_sampler=sampler)
    assert loader.pin_memory is False
    return list(loader)


def test_build_loader_cpu_does_not_pin_and_workers_agree():
    serial = _loader_batches(0)
    assert len(serial) == 3
    x, y = serial[0]
    assert x.shape == (4, 3, 8, 8) and y.shape == (4,)
    parallel = _loader_batches(2)
    assert len(parallel) == len(serial)
    for (xa, ya), (xb, yb) in zip(serial, parallel):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_build_loader_eval_keeps_tail_and_validates_arguments():
    ds = _synthetic(10, image_size=8)
    cfg = DataConfig(num_workers=0)
    loader = build_loader(
        ds,
        cfg=cfg,
        device_type="cpu",
        sampler=ShardedEvalSampler(len(ds), world_size=1, rank=0),
        batch_size=4,
    )
    assert [len(y) for _, y in loader] == [4, 4, 2]
    batch_sampler = GlobalBatchSampler(10, micro_batch_size=2, world_size=1, rank=0)
    with pytest.raises(ValueError):
        build_loader(ds, cfg=cfg, device_type="cpu", batch_sampler=batch_sampler, batch_size=2)
    with pytest.raises(ValueError):
        build_loader(ds, cfg=cfg, device_type="cpu", batch_size=2)
    with pytest.raises(ConfigError, match="data.num_workers"):
        build_loader(
            ds, cfg=DataConfig(num_workers=-1), device_type="cpu", batch_sampler=batch_sampler
        )


def test_global_sampler_resumes_by_sample_position_with_another_global_batch():
    # 3 steps at world size 2 (G=16), then the rest of the epoch at world size 1 (G=8): every
    # sample of the epoch is visited exactly once, in the uninterrupted order.
    n = 64
    before = [
        GlobalBatchSampler(n, micro_batch_size=8, world_size=2, rank=r, seed=3) for r in range(2)
    ]
    seen = []
    iters = [iter(s) for s in before]
    for _ in range(3):
        for it in iters:
            seen += next(it)
    after = GlobalBatchSampler(n, micro_batch_size=8, world_size=1, rank=0, seed=3)
    after.set_start_sample(3 * 16)
    assert after.remaining_steps() == (64 - 48) // 8 and len(after) == 2
    for batch in after:
        seen += batch
    assert seen == after.epoch_order() and sorted(seen) == list(range(n))
    assert after.start_sample == 0  # the next epoch starts from its beginning


class _RandomShift(torch.utils.data.Dataset):
    """Adds a draw from torch's global generator to every sample, as a random augmentation."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        return torch.full((2,), float(index)) + torch.rand(2), index


def test_per_sample_seeding_only_where_loading_draws_random():
    cfg = compose(["data.num_workers=0"]).data
    kwargs = dict(cfg=cfg, device_type="cpu", micro_batch_size=4, grad_accum_steps=1, seed=3)
    tensors = torch.utils.data.TensorDataset(torch.arange(16.0), torch.arange(16))
    synthetic = SyntheticImages(16, image_size=4, channels=1, num_classes=2, seed=0)
    for plain in (tensors, synthetic):
        loader, _ = train_loader(plain, dp_size=1, dp_rank=0, **kwargs)
        assert loader.dataset is plain  # no per-sample seeding wrapper, plain indices
    assert draws_random(_RandomShift(16)) and not draws_random(tensors)

    def first_batch(seed_stream: int) -> torch.Tensor:
        torch.manual_seed(seed_stream)  # the caller's stream must not matter, nor be consumed
        loader, _ = train_loader(_RandomShift(16), dp_size=1, dp_rank=0, **kwargs)
        batch = next(iter(loader))[0]
        after = torch.rand(1)
        torch.manual_seed(seed_stream)
        assert torch.equal(after, torch.rand(1))  # the global stream was restored
        return batch

    # The augmentation is a function of (seed, epoch, index) only.
    torch.testing.assert_close(first_batch(0), first_batch(1), rtol=0, atol=0)
