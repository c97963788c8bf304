"""Tar shards (data=shards): the converter, random access through the shard index, the same
samples as the ImageFolder they came from, reading over real HTTP, and bad shards and indexes
named by shard and key."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pickle
import random
import re
import threading
from collections.abc import Iterator
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from sdnet_trainer import compose
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data import BadSampleError, skipped_samples
from sdnet_trainer.data.folders import build_imagefolder
from sdnet_trainer.data.shards import (
    DEFAULT_SHARD_SIZE,
    INDEX_SUFFIX,
    ShardError,
    ShardImages,
    build_shards,
    convert,
    expand_braces,
    load_index,
    main,
    parse_index,
    scan_shard,
)
from sdnet_trainer.errors import ConfigError
from tests.support import TINY, FaultTrainer, RecordingTrainer

CLASSES = ("cat", "dog", "owl")
PER_CLASS = 7  # 21 training images: shards of 5 leave a short last shard
SHARD_SIZE = 5


def _image(path: Path, seed: int) -> None:
    from PIL import Image

    rng = random.Random(seed)
    width, height = rng.randrange(16, 30), rng.randrange(16, 30)
    pixels = bytes(rng.randrange(256) for _ in range(width * height * 3))
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.frombytes("RGB", (width, height), pixels)
    if path.suffix == ".png":
        image.save(path, format="PNG")
    else:
        image.save(path, format="JPEG", quality=90)


def _folder(root: Path) -> Path:
    """train/<class>/ with PER_CLASS images each (JPEG and PNG mixed), val/<class>/ with 2."""
    for c, name in enumerate(CLASSES):
        for i in range(PER_CLASS):
            suffix = ".png" if i % 3 == 0 else ".jpg"
            _image(root / "train" / name / f"img{i:02d}{suffix}", seed=100 * c + i)
        for i in range(2):
            _image(root / "val" / name / f"v{i}.jpg", seed=10_000 + 100 * c + i)
    return root


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("shards")
    src = _folder(base / "folder")
    out = base / "shards"
    convert(src, out, shard_size=SHARD_SIZE)
    return src, out


def _copy(converted, tmp_path) -> Path:
    """A private copy of the shards, for a test that damages them."""
    import shutil

    _, out = converted
    shutil.copytree(out, tmp_path / "shards")
    return tmp_path / "shards"


def _cfg(root: str | Path, **overrides) -> DataConfig:
    kwargs = dict(
        name="shards",
        root=str(root),
        image_size=16,
        num_classes=len(CLASSES),
        persistent_workers=False,
    )
    kwargs.update(overrides)
    return DataConfig(**kwargs)


def _seeded(dataset, index: int):
    torch.manual_seed(index)
    random.seed(index)
    return dataset[index]


# --------------------------------------------------------------------------------------------
# HTTP: a threaded server with range requests, on a free port
# --------------------------------------------------------------------------------------------


class _RangeHandler(SimpleHTTPRequestHandler):
    """http.server's static files plus single ``Range: bytes=a-b`` requests, as object stores and
    web servers answer them."""

    ranges_served = 0

    def log_message(self, *args) -> None:  # keep the test output clean
        pass

    def send_head(self):
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if match is None or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        start = int(match.group(1))
        end = min(int(match.group(2)) if match.group(2) else size - 1, size - 1)
        if start >= size:
            self.send_error(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
            return None
        f = open(path, "rb")  # noqa: SIM115  # closed by copyfile's caller
        f.seek(start)
        self.send_response(HTTPStatus.PARTIAL_CONTENT)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        type(self).ranges_served += 1
        return _Limited(f, end - start + 1)


class _Limited:
    """A file object that ends after ``length`` bytes (what copyfile sends of a range)."""

    def __init__(self, f, length: int) -> None:
        self.f, self.left = f, length

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data

    def close(self) -> None:
        self.f.close()


@contextlib.contextmanager
def range_server(directory: Path) -> Iterator[str]:
    """``directory`` served by :class:`_RangeHandler` on a free port of 127.0.0.1, from a thread;
    yields the base URL."""
    handler = functools.partial(_RangeHandler, directory=str(directory))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def http_root(converted):
    _, out = converted
    with range_server(out) as url:
        yield url


# --------------------------------------------------------------------------------------------
# The converter
# --------------------------------------------------------------------------------------------


def test_converter_writes_shards_indexes_and_classes(converted):
    _, out = converted
    assert json.loads((out / "classes.json").read_text()) == {"classes": list(CLASSES)}
    train = sorted(p.name for p in (out / "train").glob("*.tar"))
    assert train == [f"train-{n:06d}.tar" for n in range(5)]  # 21 images / 5
    assert [p.name for p in sorted((out / "val").glob("*.tar"))] == [
        "val-000000.tar",
        "val-000001.tar",
    ]
    sizes = []
    for name in train:
        path = out / "train" / name
        index = parse_index(
            (out / "train" / (name + INDEX_SUFFIX)).read_bytes(), url=str(path), where="x"
        )
        assert index.tar_bytes == path.stat().st_size
        # What the index says is what a scan of the tar finds.
        scanned = scan_shard(str(path))
        assert (scanned.keys, scanned.offsets, scanned.sizes, scanned.labels) == (
            index.keys,
            index.offsets,
            index.sizes,
            index.labels,
        )
        sizes.append(len(index))
    assert sizes == [5, 5, 5, 5, 1]


def test_converter_is_idempotent_and_rewrites_only_changed_shards(converted, tmp_path):
    src_orig, _ = converted
    import shutil

    src = tmp_path / "folder"
    shutil.copytree(src_orig, src)
    out = tmp_path / "out"
    first = convert(src, out, shard_size=SHARD_SIZE)
    assert first["train"] == {"samples": 21, "shards": 5, "written": 5, "skipped": 0}
    shards = sorted((out / "train").glob("*.tar"))
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in shards}
    again = convert(src, out, shard_size=SHARD_SIZE)
    assert again["train"] == {"samples": 21, "shards": 5, "written": 0, "skipped": 5}
    assert again["val"]["written"] == 0
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in shards} == before
    # Sample 12 (dog/img05.jpg) lives in shard 2: only that shard is written again.
    _image(src / "train" / "dog" / "img05.jpg", seed=999)
    changed = convert(src, out, shard_size=SHARD_SIZE)
    assert changed["train"]["written"] == 1 and changed["train"]["skipped"] == 4
    assert [p for p in shards if p.read_bytes() != before[p][0]] == [shards[2]]
    # A shard whose index is missing (interrupted run) is written again.
    (out / "train" / f"train-000001.tar{INDEX_SUFFIX}").unlink()
    assert convert(src, out, shard_size=SHARD_SIZE)["train"]["written"] == 1
    # Shards of another layout in OUT are not silently mixed in.
    with pytest.raises(ConfigError, match=r"train-000003\.tar, train-000004\.tar\)"):
        convert(src, out, shard_size=8)  # 3 shards, where 5 are


def test_converter_cli(converted, tmp_path, capsys):
    src, _ = converted
    assert main([str(src), str(tmp_path / "out"), "shard_size=8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["classes"] == 3 and report["train"]["shards"] == 3
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "o2"), "shard_size=8"]) == 2
    assert "has no train/ folder" in capsys.readouterr().err
    assert main([str(src)]) == 2  # OUT is missing
    assert "usage:" in capsys.readouterr().err
    assert main([str(src), str(tmp_path / "o3"), "shards=8"]) == 2
    assert "unknown: shards" in capsys.readouterr().err
    assert main([str(src), str(tmp_path / "o4"), "--shard-size=8"]) == 2
    assert "(unknown: --shard-size)" in capsys.readouterr().err
    assert not (tmp_path / "o3").exists() and not (tmp_path / "o4").exists()


def test_converter_cli_defaults_shard_size(converted, tmp_path, capsys):
    src, out = converted
    assert main([str(src), str(tmp_path / "out")]) == 0
    report = json.loads(capsys.readouterr().out)
    # 21 training images and 6 validation images: one shard each at the default size.
    assert DEFAULT_SHARD_SIZE > 21
    assert report["train"] == {"samples": 21, "shards": 1, "written": 1, "skipped": 0}
    assert report["val"]["shards"] == 1 and report["classes"] == 3
    whole, _ = build_shards(_cfg(tmp_path / "out"))
    split, _ = build_shards(_cfg(out))
    assert whole.keys == split.keys and whole.targets == split.targets
    assert [whole.read(i) for i in range(len(whole))] == [split.read(i) for i in range(len(split))]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_converter_cli_help(flag, tmp_path, capsys):
    assert main([flag]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("usage: python -m sdnet_trainer.data.shards")
    assert f"shard_size=N  samples per shard (default {DEFAULT_SHARD_SIZE})" in printed.out
    assert printed.err == ""
    assert main([str(tmp_path / "src"), str(tmp_path / "out"), flag]) == 0  # help wins
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# The same samples as the ImageFolder
# --------------------------------------------------------------------------------------------


def test_same_tensors_as_the_image_folder(converted):
    src, out = converted
    folder_train, folder_val = build_imagefolder(_cfg(src, name="imagefolder"))
    shard_train, shard_val = build_shards(_cfg(out))
    assert isinstance(shard_train, ShardImages) and shard_val is not None
    assert shard_train.classes == list(CLASSES)
    for folder, shards in ((folder_train, shard_train), (folder_val, shard_val)):
        assert len(shards) == len(folder)
        assert shards.targets == folder.targets
        for index in range(len(folder)):
            # Seeded alike, the random crop and flip of training match too.
            image, label = _seeded(shards, index)
            expected, expected_label = _seeded(folder, index)
            assert label == expected_label
            assert torch.equal(image, expected), index


def test_a_brace_pattern_names_training_shards(converted):
    _, out = converted
    assert expand_braces("a-{008..010}-{x,y}.tar") == [
        "a-008-x.tar",
        "a-008-y.tar",
        "a-009-x.tar",
        "a-009-y.tar",
        "a-010-x.tar",
        "a-010-y.tar",
    ]
    train, val = build_shards(_cfg(out / "train" / "train-{000000..000004}.tar"))
    assert val is None and len(train) == 21
    # The class count: classes.json, else the config, else the largest label + 1.
    pattern = str(out / "train" / "train-{000000..000004}.tar")
    assert train.num_classes == 3
    assert build_shards(_cfg(pattern, num_classes=5))[0].num_classes == 5
    assert build_shards(_cfg(pattern, num_classes=None))[0].num_classes == 3
    assert build_shards(_cfg(out, num_classes=None))[0].num_classes == 3
    with pytest.raises(ShardError, match="label 2 is out of range for data.num_classes=2"):
        build_shards(_cfg(pattern, num_classes=2))
    full, _ = build_shards(_cfg(out))
    assert train.keys == full.keys and train.targets == full.targets
    with pytest.raises(ConfigError, match="neither a range"):
        expand_braces("train-{0-3}.tar")


def test_an_index_is_built_by_scanning_and_cached(converted, tmp_path, monkeypatch):
    out = _copy(converted, tmp_path)
    monkeypatch.setenv("SDNET_CACHE_DIR", str(tmp_path / "cache"))
    expected, _ = build_shards(_cfg(out))
    for index_file in out.glob(f"*/*{INDEX_SUFFIX}"):
        index_file.unlink()
    scanned, _ = build_shards(_cfg(out))
    cached = sorted((tmp_path / "cache" / "shard-index").iterdir())
    assert len(cached) == 7  # 5 train + 2 val shards, each scanned once
    assert scanned.keys == expected.keys and scanned.targets == expected.targets
    assert torch.equal(_seeded(scanned, 7)[0], _seeded(expected, 7)[0])
    # The cache is read back, not rebuilt: a scan would fail on this shard now.
    shard = out / "train" / "train-000000.tar"
    stamp = [p.stat().st_mtime_ns for p in cached]
    load_index(str(shard))
    assert [p.stat().st_mtime_ns for p in cached] == stamp


def test_missing_shards_and_classes_mismatch_are_config_errors(converted, tmp_path):
    _, out = converted
    with pytest.raises(ConfigError, match=r"has no train/\*\.tar shards"):
        build_shards(_cfg(tmp_path))
    with pytest.raises(ConfigError, match=r"data.num_classes=5, but .* has 3 classes"):
        build_shards(_cfg(out, num_classes=5))
    with pytest.raises(ConfigError, match="data.root is required"):
        build_shards(DataConfig(name="shards", root=None))


def test_dataset_pickles_after_reading(converted):
    _, out = converted
    train, _ = build_shards(_cfg(out))
    first = _seeded(train, 3)[0]
    clone = pickle.loads(pickle.dumps(train))  # as a spawned loader worker receives it
    assert clone._reader is None
    assert torch.equal(_seeded(clone, 3)[0], first)


# --------------------------------------------------------------------------------------------
# Over HTTP
# --------------------------------------------------------------------------------------------


def test_http_reads_the_same_samples_with_range_requests(converted, http_root):
    _, out = converted
    local_train, local_val = build_shards(_cfg(out))
    remote_train, remote_val = build_shards(_cfg(http_root))
    assert remote_train.urls[0] == f"{http_root}/train/train-000000.tar"
    assert remote_train.keys == local_train.keys and remote_train.targets == local_train.targets
    served = _RangeHandler.ranges_served
    for index in range(len(local_train)):
        assert remote_train.read(index) == local_train.read(index)
        assert torch.equal(_seeded(remote_train, index)[0], _seeded(local_train, index)[0])
    assert _RangeHandler.ranges_served - served == 2 * len(local_train)  # one range a read
    assert remote_val is not None and local_val is not None
    assert torch.equal(remote_val[5][0], local_val[5][0])


# --------------------------------------------------------------------------------------------
# Through the Trainer
# --------------------------------------------------------------------------------------------


class ShardTrainer(RecordingTrainer):
    """data=shards until the registry names it: the same Trainer with this data set."""

    def build_datasets(self):
        return build_shards(self.cfg.data)


class ShardFaultTrainer(FaultTrainer):
    def build_datasets(self):
        train, val = build_shards(self.cfg.data)
        return IndexedShards(train), val


class IndexedShards(torch.utils.data.Dataset):
    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return (*self.dataset[index], index)


def _train(root, *extra: str) -> list[str]:
    # 21 images / global batch 6 = 3 steps an epoch.
    return TINY + [
        "data=imagefolder",
        f"data.root={root}",
        "data.image_size=16",
        "data.num_classes=3",
        "model.num_classes=3",
        "loop.global_batch_size=6",
        "loop.max_steps=4",
        "loop.eval_at_end=false",
        *extra,
    ]


@pytest.fixture(scope="module")
def folder_losses(converted, tmp_path_factory):
    src, _ = converted
    trainer = RecordingTrainer(
        compose(_train(src, "data.num_workers=0")), output_dir=tmp_path_factory.mktemp("ref")
    )
    trainer.fit()
    return trainer.losses


@pytest.mark.parametrize(("where", "num_workers"), [("local", 2), ("http", 1)])
def test_trains_the_same_steps_as_the_image_folder(
    converted, folder_losses, tmp_path, request, where, num_workers
):
    _, out = converted
    root = request.getfixturevalue("http_root") if where == "http" else out
    cfg = compose(_train(root, f"data.num_workers={num_workers}"))
    trainer = ShardTrainer(cfg, output_dir=tmp_path / "run")
    trainer.fit()
    assert trainer.state.step == 4
    assert trainer.losses == folder_losses  # same samples, same crops, same order: bitwise


def test_stop_and_resume_is_bitwise_equal(converted, tmp_path, monkeypatch):
    _, out = converted
    cfg = compose(_train(out, "data.num_workers=0", "loop.max_steps=6"))
    reference = ShardFaultTrainer(cfg, output_dir=tmp_path / "reference")
    reference.fit()
    monkeypatch.setenv("SDNET_TEST_SIGTERM", "0:3")  # agreed during step 5: stops after it
    first = ShardFaultTrainer(cfg, output_dir=tmp_path / "run")
    with pytest.raises(SystemExit):
        first.fit()
    monkeypatch.delenv("SDNET_TEST_SIGTERM")
    second = ShardFaultTrainer(cfg, output_dir=tmp_path / "run")
    second.fit()
    assert 0 < first.state.step < 6 and second.state.step == 6
    assert first.seen + second.seen == reference.seen
    assert first.losses + second.losses == reference.losses


# --------------------------------------------------------------------------------------------
# Bad shards and indexes
# --------------------------------------------------------------------------------------------


def _index_path(out: Path, name: str = "train-000001.tar") -> Path:
    return out / "train" / (name + INDEX_SUFFIX)


def test_truncated_shard_names_the_shard_and_key(converted, tmp_path):
    out = _copy(converted, tmp_path)
    shard = out / "train" / "train-000001.tar"
    index = json.loads(_index_path(out).read_text())
    last_key, _, last_offset, _, _ = index["samples"][-1]
    shard.write_bytes(shard.read_bytes()[: last_offset + 10])
    with pytest.raises(ShardError) as err:
        build_shards(_cfg(out))
    message = str(err.value)
    assert str(shard) in message and repr(last_key) in message and "truncated" in message
    # Without its index, the scan finds the same.
    _index_path(out).unlink()
    with pytest.raises(ShardError, match=re.escape(str(shard)) + ".*truncated.*" + last_key):
        build_shards(_cfg(out))


def test_truncated_shard_under_skip_replaces_the_lost_samples(converted, tmp_path, caplog):
    out = _copy(converted, tmp_path)
    shard = out / "train" / "train-000001.tar"
    index = json.loads(_index_path(out).read_text())
    last_key, _, last_offset, _, _ = index["samples"][-1]
    shard.write_bytes(shard.read_bytes()[: last_offset + 10])
    train, _ = build_shards(_cfg(out, on_bad_sample="skip"))
    lost = [i for i, k in enumerate(train.keys) if k.startswith(f"{last_key}.")][0]
    caplog.set_level(logging.WARNING, logger="sdnet_trainer.data.shards")
    image, label = _seeded(train, lost)
    # In its place: the next sample, with the crop drawn for this index.
    assert label == train.targets[lost + 1]
    torch.manual_seed(lost)
    random.seed(lost)
    assert torch.equal(image, train.transform(train.decode(train.read(lost + 1))))
    counter = skipped_samples(train)
    assert counter is not None and counter() == 1
    warned = [
        r.getMessage() for r in caplog.records if r.name.startswith("sdnet_trainer.data.shards")
    ]
    skipping = [line for line in warned if line.startswith("data: skipping")]
    assert len(skipping) == 1 and str(shard) in skipping[0] and last_key in skipping[0]


def _corrupt_member(out: Path, number: int) -> tuple[Path, str]:
    """Overwrite the bytes of entry ``number`` of train-000001.tar with garbage (same length)."""
    shard = out / "train" / "train-000001.tar"
    key, ext, offset, size, _ = json.loads(_index_path(out).read_text())["samples"][number]
    data = bytearray(shard.read_bytes())
    data[offset : offset + size] = random.Random(0).randbytes(size)
    shard.write_bytes(bytes(data))
    return shard, f"{key}.{ext}"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupt_member_names_the_shard_and_key(converted, tmp_path, num_workers):
    from sdnet_trainer.data.loader import stop_workers, train_loader

    out = _copy(converted, tmp_path)
    shard, member = _corrupt_member(out, 2)
    cfg = _cfg(out, num_workers=num_workers)
    train, _ = build_shards(cfg)
    loader, _ = train_loader(
        train,
        cfg=cfg,
        device_type="cpu",
        micro_batch_size=7,
        grad_accum_steps=1,
        dp_size=1,
        dp_rank=0,
        seed=0,
    )
    batches = iter(loader)
    try:
        with pytest.raises(BadSampleError) as err:
            list(batches)
    finally:
        stop_workers(batches)  # also after the bad sample raised (see stop_workers)
    message = str(err.value)
    assert message.startswith(f"data: cannot decode {member} in shard {shard} (")
    assert message.endswith("fix or re-create the shard, or set data.on_bad_sample=skip")
    assert "\n" not in message and "Traceback" not in message


def test_corrupt_member_under_skip_loads_the_next_sample(converted, tmp_path):
    out = _copy(converted, tmp_path)
    _, member = _corrupt_member(out, 2)
    train, _ = build_shards(_cfg(out, on_bad_sample="skip"))
    bad = train.keys.index(member)
    assert train[bad][1] == train.targets[bad + 1]
    assert train[bad][1] == train.targets[bad + 1]
    counter = skipped_samples(train)
    assert counter is not None and counter() == 2  # counted per load, decoded once


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda doc: "{not json", "is not valid JSON"),
        (lambda doc: {**doc, "format": "x"}, "is not a shard index"),
        (lambda doc: {**doc, "version": 99}, "index version 99"),
        (
            lambda doc: _entry(doc, 2, offset=lambda o: o + 1),
            "key '.*': .*offset=.* is not the start",
        ),
        (
            lambda doc: _entry(doc, 2, size=lambda n: 10**9),
            "key '.*': .*size=1000000000 .* does not fit",
        ),
        (
            lambda doc: _entry(doc, 2, ext=lambda e: "exe"),
            "key '.*': .*ext='exe' is neither an image type",
        ),
        (lambda doc: _entry(doc, 2, label=lambda n: -1), "key '.*': .*label=-1"),
        (lambda doc: _entry(doc, 2, label=lambda n: 7), "key '.*': label 7 is out of range"),
        (lambda doc: _entry(doc, 2, key=lambda k: doc["samples"][0][0]), "lists the key twice"),
    ],
)
@pytest.mark.full  # seconds: out of the quick tier
def test_bad_index_is_one_error_naming_the_shard(converted, tmp_path, edit, expected):
    out = _copy(converted, tmp_path)
    path = _index_path(out)
    doc = edit(json.loads(path.read_text()))
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(ShardError) as err:
        build_shards(_cfg(out))
    message = str(err.value)
    assert f"data: shard {out / 'train' / 'train-000001.tar'}" in message
    assert re.search(expected, message), message
    assert "\n" not in message


def _entry(doc: dict, number: int, **change) -> dict:
    fields = ("key", "ext", "offset", "size", "label")
    entry = list(doc["samples"][number])
    for name, fn in change.items():
        entry[fields.index(name)] = fn(entry[fields.index(name)])
    doc["samples"][number] = entry
    return doc


def test_index_that_does_not_match_its_shard_is_caught_at_read(converted, tmp_path):
    out = _copy(converted, tmp_path)
    path = _index_path(out)
    doc = json.loads(path.read_text())
    # Entries 0 and 1 swapped: well-formed, but each points at the other's member.
    doc["samples"][0][2:4], doc["samples"][1][2:4] = doc["samples"][1][2:4], doc["samples"][0][2:4]
    path.write_text(json.dumps(doc))
    train, _ = build_shards(_cfg(out))
    key = doc["samples"][0][0]
    bad = [i for i, k in enumerate(train.keys) if k.startswith(f"{key}.")][0]
    with pytest.raises(BadSampleError, match=r"cannot read .* index does not match it: its tar "):
        train[bad]


def test_shard_that_is_not_a_tar_names_the_shard(converted, tmp_path):
    out = _copy(converted, tmp_path)
    shard = out / "val" / "val-000001.tar"
    shard.write_bytes(b"\x00garbage" * 100 + b"x" * 7)
    (out / "val" / f"val-000001.tar{INDEX_SUFFIX}").unlink()
    with pytest.raises(ShardError, match=re.escape(str(shard))):
        build_shards(_cfg(out))


def _webdataset_shard(path: Path, members: list[tuple[str, bytes]]) -> Path:
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:  # tarfile's default (pax) format, as WebDataset writes
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_shards_written_elsewhere_are_scanned(converted, tmp_path, monkeypatch):
    """WebDataset shards without an index: .json labels, keys with folders and long names."""
    src, _ = converted
    monkeypatch.setenv("SDNET_CACHE_DIR", str(tmp_path / "cache"))
    owl = (src / "train" / "owl" / "img01.jpg").read_bytes()
    cat = (src / "train" / "cat" / "img00.png").read_bytes()
    long_key = "deep/" + "k" * 120  # past the 100 bytes of a ustar name: a pax header
    shard = _webdataset_shard(
        tmp_path / "wds" / "part-0.tar",
        [
            ("a/x1.jpg", owl),
            ("a/x1.json", json.dumps({"label": 2, "caption": "owl"}).encode()),
            (f"{long_key}.cls", b"0\n"),
            (f"{long_key}.png", cat),
            ("caf\u00e9.cls", b"1"),  # non-ASCII: the name is in a pax header
            ("caf\u00e9.jpg", owl),
        ],
    )
    train, val = build_shards(_cfg(tmp_path / "wds" / "part-{0..0}.tar"))
    assert val is None and train.keys == ["a/x1.jpg", f"{long_key}.png", "caf\u00e9.jpg"]
    assert train.targets == [2, 0, 1]
    assert train.read(0) == owl and train.read(1) == cat and train.read(2) == owl
    # A key without a label, and a label that is not one, name the shard and the key.
    _webdataset_shard(shard, [("b.jpg", owl)])
    with pytest.raises(ShardError, match=re.escape(f"shard {shard}, key 'b': no label member")):
        scan_shard(str(shard))
    _webdataset_shard(shard, [("b.jpg", owl), ("b.json", b'{"label": "owl"}')])
    with pytest.raises(ShardError, match=r"key 'b': b\.json is not a label .*no integer"):
        scan_shard(str(shard))
    # A shard replaced by one of the same size (tar pads to 10 KiB records) is scanned again.
    _webdataset_shard(shard, [("b.jpg", owl), ("b.cls", b"1")])
    assert build_shards(_cfg(tmp_path / "wds" / "part-{0..0}.tar"))[0].keys == ["b.jpg"]
    same_size = shard.stat().st_size
    _webdataset_shard(shard, [("c.jpg", owl), ("c.cls", b"2")])
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert shard.stat().st_size == same_size
    assert build_shards(_cfg(tmp_path / "wds" / "part-{0..0}.tar"))[0].keys == ["c.jpg"]
    # A shard the pattern names but that is not there.
    with pytest.raises(ShardError, match=r"part-1\.tar does not exist"):
        build_shards(_cfg(tmp_path / "wds" / "part-{0..1}.tar"))


# --------------------------------------------------------------------------------------------
# Text shards
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("text")
    rng = random.Random(5)
    for name in ("a.txt", "b.txt", "sub/c.txt", "d.txt", "e.txt"):
        path = base / "src" / "train" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        words = " ".join(rng.choice(["owl", "cat", "dog", "été"]) for _ in range(40))
        path.write_text(words + "\n", encoding="utf-8")
    (base / "src" / "val").mkdir()
    (base / "src" / "val" / "v.txt").write_text("the validation text " * 9, encoding="utf-8")
    report = convert(base / "src", base / "out", shard_size=2)
    assert report["classes"] is None and report["train"]["shards"] == 3
    return base / "src", base / "out"


def _text_cfg(root, **overrides) -> DataConfig:
    return DataConfig(**{"name": "shards", "root": str(root), "seq_len": 16, **overrides})


def test_text_shards_give_the_windows_of_data_text(text_shards):
    from sdnet_trainer.data.shards import ShardText
    from sdnet_trainer.data.tokens import TextBytes

    src, out = text_shards
    train, val = build_shards(_text_cfg(out))
    assert isinstance(train, ShardText) and isinstance(val, ShardText)
    # data=text reads a folder's .txt files in sorted path order, concatenated.
    raw = b"".join(p.read_bytes() for p in sorted((src / "train").rglob("*.txt")))
    expected = TextBytes(torch.frombuffer(bytearray(raw), dtype=torch.uint8), seq_len=16)
    assert len(train) == len(expected) > 10
    for index in range(len(expected)):  # windows span member and shard boundaries
        inputs, targets = train[index]
        want_inputs, want_targets = expected[index]
        assert torch.equal(inputs, want_inputs) and torch.equal(targets, want_targets), index
    assert val[0][0].tolist() == list(b"the validation t")
    with pytest.raises(ConfigError, match="data.vocab_size=64: text shards are read as bytes"):
        build_shards(_text_cfg(out, vocab_size=64))


def test_text_shards_over_http(text_shards):
    _, out = text_shards
    with range_server(out) as url:
        remote, _ = build_shards(_text_cfg(url))
        local, _ = build_shards(_text_cfg(out))
        clone = pickle.loads(pickle.dumps(remote))
        for index in range(len(local)):
            assert torch.equal(clone[index][0], local[index][0])


class _TextBytesTrainer(RecordingTrainer):
    """The reference: data=text's windows over the same files, built in memory."""

    def build_datasets(self):
        from sdnet_trainer.data.tokens import TextBytes

        root = Path(self.cfg.data.root).parent / "src"
        splits = []
        for split in ("train", "val"):
            raw = b"".join(p.read_bytes() for p in sorted((root / split).rglob("*.txt")))
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            splits.append(TextBytes(data, seq_len=self.cfg.data.seq_len))
        return tuple(splits)


def test_a_gpt_trains_on_text_shards_like_on_the_text(text_shards, tmp_path):
    _, out = text_shards
    overrides = [
        "dist.device=cpu",
        "model=gpt_tiny",
        "model.gpt.vocab_size=256",
        "data=text",
        f"data.root={out}",
        "data.seq_len=16",
        "data.num_workers=0",
        "sched=constant",
        "loop.global_batch_size=4",
        "loop.max_steps=4",
        "loop.eval_at_end=false",
        "loop.eval_at_epoch_end=false",
    ]
    reference = _TextBytesTrainer(compose(overrides), output_dir=tmp_path / "reference")
    reference.fit()
    trainer = ShardTrainer(compose(overrides), output_dir=tmp_path / "run")
    trainer.fit()
    assert trainer.state.step == 4 and len(trainer.losses) == 4
    assert trainer.losses == reference.losses


def test_truncated_text_shard_names_the_shard_and_key(text_shards, tmp_path, caplog):
    import shutil

    _, original = text_shards
    out = tmp_path / "out"
    shutil.copytree(original, out)
    shard = out / "train" / "train-000001.tar"
    index = json.loads((out / "train" / f"train-000001.tar{INDEX_SUFFIX}").read_text())
    key, ext, offset, _, label = index["samples"][-1]
    assert ext == "txt" and label is None
    shard.write_bytes(shard.read_bytes()[: offset + 10])
    with pytest.raises(ShardError, match=re.escape(f"{shard}") + ".*" + key):
        build_shards(_text_cfg(out))
    train, _ = build_shards(_text_cfg(out, on_bad_sample="skip"))
    # Member 3 (train-000001's last) is cut 10 bytes in: the windows reaching past that are lost,
    # and each is replaced by the first window after it that lies wholly in readable bytes.
    first_bad = (train._starts[3] + 10) // 16
    replacement = -(-train._starts[4] // 16)
    caplog.set_level(logging.WARNING, logger="sdnet_trainer.data.shards")
    whole, _ = build_shards(_text_cfg(original))
    assert torch.equal(train[first_bad][0], whole[replacement][0])
    counter = skipped_samples(train)
    assert counter is not None and counter() == 1
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: skipping")]
    assert warned and f"{key}.txt in shard {shard}" in warned[0]
    strict, _ = build_shards(_text_cfg(out, on_bad_sample="skip"))
    strict.skipped = None  # as under error, from here
    with pytest.raises(BadSampleError, match=f"cannot read text window {first_bad} .*{key}.txt"):
        strict[first_bad]


def test_data_name_shards_builds_shards(converted):
    """data.name=shards is registered: the Trainer's own build_datasets reads shards."""
    from sdnet_trainer.data import build_datasets

    _, out = converted
    train, _ = build_datasets(_cfg(out))
    assert isinstance(train, ShardImages)
