"""Hugging Face datasets on disk (data.name=hf): save_to_disk and parquet layouts, images with
their class count, text as bytes or tokenizer ids, the errors, and training through the Trainer.

Every data set is built in tmp_path by the test: nothing is downloaded."""

from __future__ import annotations

import io
import logging
import pickle
import sys
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.bad_samples import BadSampleError
from sdnet_trainer.data.hf import HFImages, build_hf
from sdnet_trainer.data.tokens import TextBytes, TokenWindows
from sdnet_trainer.data.transforms import build_transforms
from sdnet_trainer.distributed.ddp import unwrap
from sdnet_trainer.errors import ConfigError
from tests.support import CPU, FaultTrainer, IndexedDataset

needs_datasets = pytest.mark.skipif(
    find_spec("datasets") is None, reason="needs the hf extra: pip install 'sdnet_trainer[hf]'"
)
needs_tokenizers = pytest.mark.skipif(
    find_spec("tokenizers") is None, reason="needs the hf extra: pip install 'sdnet_trainer[hf]'"
)

CLASSES = ["cat", "dog", "eel"]


@pytest.fixture(autouse=True)
def _hf_cache_in_tmp(tmp_path, monkeypatch):
    """load_dataset converts parquet/arrow folders into its cache: keep it in the test's tmp."""
    if find_spec("datasets") is not None:
        import datasets

        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def _png(seed: int, size: tuple[int, int] = (20, 24)) -> bytes:
    """A small PNG of random pixels (a distinct image per seed)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _image_table(n: int, *, seed: int = 0, class_label: bool = True, labels=None):
    import datasets

    label_feature = datasets.ClassLabel(names=CLASSES) if class_label else datasets.Value("int64")
    features = datasets.Features(
        {"image": datasets.Image(), "label": label_feature, "note": datasets.Value("string")}
    )
    return datasets.Dataset.from_dict(
        {
            "image": [{"bytes": _png(seed + i), "path": None} for i in range(n)],
            "label": labels if labels is not None else [i % len(CLASSES) for i in range(n)],
            "note": [f"row {i}" for i in range(n)],
        },
        features=features,
    )


def _save_image_dict(root: Path, *, train: int = 12, val: int = 5, val_name: str = "validation"):
    import datasets

    splits = {"train": _image_table(train), val_name: _image_table(val, seed=1000)}
    datasets.DatasetDict(splits).save_to_disk(str(root))
    return splits


def _cfg(root: Path | str | None, **overrides) -> DataConfig:
    values = dict(name="hf", root=None if root is None else str(root), image_size=16)
    values["num_classes"] = len(CLASSES)
    values.update(overrides)
    return DataConfig(**values)  # type: ignore[arg-type]


def _rgb(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png)).convert("RGB")


# --------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------


@needs_datasets
def test_saved_dataset_dict_gives_the_images_labels_and_classlabel_count(tmp_path):
    splits = _save_image_dict(tmp_path / "ds")
    train, val = build_hf(_cfg(tmp_path / "ds"))
    assert isinstance(train, HFImages) and isinstance(val, HFImages)
    assert (len(train), len(val)) == (12, 5)
    assert (train.num_classes, train.classes) == (3, CLASSES)
    assert (val.num_classes, val.classes) == (3, CLASSES)
    train_tf, val_tf = build_transforms(_cfg(None))
    # Validation: deterministic, exactly ImageFolder's val transform of the stored image.
    for i in range(len(val)):
        image, label = val[i]
        row = splits["validation"][i]
        assert label == row["label"]
        expected = val_tf(row["image"].convert("RGB"))
        assert image.shape == (3, 16, 16) and torch.equal(image, expected)
    # Train: the random crop and flip of ImageFolder's train transform, drawn from torch's RNG.
    for i in (0, 7):
        torch.manual_seed(5)
        image, label = train[i]
        torch.manual_seed(5)
        expected = train_tf(splits["train"][i]["image"].convert("RGB"))
        assert label == i % 3 and torch.equal(image, expected)


@needs_datasets
def test_datasets_pickle_for_loader_workers(tmp_path):
    _save_image_dict(tmp_path / "ds")
    _, val = build_hf(_cfg(tmp_path / "ds"))
    copy = pickle.loads(pickle.dumps(val))
    for i in range(len(val)):
        assert copy[i][1] == val[i][1] and torch.equal(copy[i][0], val[i][0])
    images, labels = next(iter(DataLoader(val, batch_size=len(val), num_workers=2)))
    assert labels.tolist() == [val[i][1] for i in range(len(val))]
    assert torch.equal(images, torch.stack([val[i][0] for i in range(len(val))]))


@needs_datasets
def test_val_split_falls_back_to_val_then_test(tmp_path):
    _save_image_dict(tmp_path / "val", val=4, val_name="val")
    assert len(build_hf(_cfg(tmp_path / "val"))[1]) == 4
    _save_image_dict(tmp_path / "test", val=3, val_name="test")
    assert len(build_hf(_cfg(tmp_path / "test"))[1]) == 3


@needs_datasets
def test_single_saved_dataset_holds_out_every_tenth_row(tmp_path):
    table = _image_table(25, labels=[i % 3 for i in range(25)])
    table.save_to_disk(str(tmp_path / "single"))
    train, val = build_hf(_cfg(tmp_path / "single"))
    assert (len(train), len(val)) == (23, 2)
    _, val_tf = build_transforms(_cfg(None))
    for k, row in enumerate((9, 19)):
        image, label = val[k]
        assert label == row % 3
        assert torch.equal(image, val_tf(_rgb(_png(row))))
    kept = [i for i in range(25) if i % 10 != 9]
    assert [train[k][1] for k in range(len(train))] == [i % 3 for i in kept]


@needs_datasets
def test_parquet_folder_in_hub_layout_with_integer_labels(tmp_path, caplog):
    root = tmp_path / "pq"
    (root / "data").mkdir(parents=True)
    _image_table(9, class_label=False, labels=[0, 4, 2, 1, 0, 4, 3, 2, 1]).to_parquet(
        str(root / "data" / "train-00000-of-00001.parquet")
    )
    _image_table(3, seed=50, class_label=False, labels=[1, 2, 0]).to_parquet(
        str(root / "data" / "validation-00000-of-00001.parquet")
    )
    with caplog.at_level(logging.WARNING, logger="sdnet_trainer.data.hf"):
        train, val = build_hf(_cfg(root, num_classes=None))
    assert train.num_classes == 5 and train.classes is None
    assert "largest label + 1 = 5" in caplog.text
    assert [train[i][1] for i in range(9)] == [0, 4, 2, 1, 0, 4, 3, 2, 1]
    _, val_tf = build_transforms(_cfg(None))
    assert val[1][1] == 2 and torch.equal(val[1][0], val_tf(_rgb(_png(51))))
    # An integer column only bounds the count from below: a larger data.num_classes is the count
    # (a class may have no rows), a smaller one is an error.
    assert build_hf(_cfg(root, num_classes=7))[0].num_classes == 7
    with pytest.raises(ConfigError, match=r"data.num_classes=4, .* gives 5 classes"):
        build_hf(_cfg(root, num_classes=4))


@needs_datasets
def test_a_selected_table_reads_its_rows_through_the_indices_mapping():
    table = _image_table(6)
    for ds, rows in (
        (table, range(6)),
        (table.select([4, 1]), [4, 1]),  # an indices mapping: read through the formatter
    ):
        images = HFImages(
            ds, image_column="image", label_column="label", transform=None, num_classes=3
        )
        assert len(images) == len(rows)
        for k, row in enumerate(rows):
            image, label = images[k]
            assert label == row % 3
            assert np.array_equal(np.asarray(image), np.asarray(_rgb(_png(row))))


@needs_datasets
def test_raw_image_bytes_column_and_a_single_parquet_file(tmp_path):
    import datasets

    table = datasets.Dataset.from_dict(
        {"png": [_png(i) for i in range(10)], "y": [i % 2 for i in range(10)]}
    )
    table.to_parquet(str(tmp_path / "all.parquet"))
    cfg = _cfg(tmp_path / "all.parquet", image_column="png", label_column="y", num_classes=2)
    train, val = build_hf(cfg)
    assert (len(train), len(val)) == (9, 1)
    _, val_tf = build_transforms(_cfg(None))
    assert val[0][1] == 1 and torch.equal(val[0][0], val_tf(_rgb(_png(9))))


@needs_datasets
def test_undecodable_image_follows_on_bad_sample(tmp_path):
    import datasets

    images = [_png(i) for i in range(10)]
    images[3] = b"not an image"
    table = datasets.Dataset.from_dict(
        {"image": images, "label": list(range(10))},
        features=datasets.Features(
            {"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)}
        ),
    )
    datasets.DatasetDict(train=table, validation=table).save_to_disk(str(tmp_path / "bad"))
    train, _ = build_hf(_cfg(tmp_path / "bad", num_classes=10))
    with pytest.raises(BadSampleError, match=r"row 3 of the 'train' split .*on_bad_sample=skip"):
        train[3]
    train, _ = build_hf(_cfg(tmp_path / "bad", num_classes=10, on_bad_sample="skip"))
    assert train[3][1] == 4  # the next row that decodes, with its own label
    assert train.skipped is not None and train.skipped() == 1


# --------------------------------------------------------------------------------------------
# Errors: one ConfigError naming the key and what exists
# --------------------------------------------------------------------------------------------


@needs_datasets
def test_errors_name_the_key_and_what_exists(tmp_path):
    _save_image_dict(tmp_path / "ds")
    root = tmp_path / "ds"
    with pytest.raises(ConfigError, match=r"data.root is required"):
        build_hf(_cfg(None))
    with pytest.raises(ConfigError, match=r"data.root=.*nowhere.* does not exist"):
        build_hf(_cfg(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"neither a dataset saved with save_to_disk"):
        build_hf(_cfg(tmp_path / "empty"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "train.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match=r"data.root=.*broken.* cannot be read as a Hugging Face"):
        build_hf(_cfg(tmp_path / "broken"))
    (tmp_path / "broken" / "val.arrow").write_bytes(b"not arrow")
    with pytest.raises(ConfigError, match=r"data.root=.*broken.* mixes .parquet and .arrow"):
        build_hf(_cfg(tmp_path / "broken"))
    with pytest.raises(
        ConfigError,
        match=r"data.image_column='img' is not a column .*\['image', 'label', 'note'\]",
    ):
        build_hf(_cfg(root, image_column="img"))
    with pytest.raises(ConfigError, match=r"data.label_column='class' is not a column"):
        build_hf(_cfg(root, label_column="class"))
    with pytest.raises(ConfigError, match=r"data.label_column='note' .* not integer class labels"):
        build_hf(_cfg(root, label_column="note"))
    with pytest.raises(ConfigError, match=r"data.image_column='note' .* not images"):
        build_hf(_cfg(root, image_column="note"))
    with pytest.raises(ConfigError, match=r"data.num_classes=10, .*ClassLabel has 3 classes"):
        build_hf(_cfg(root, num_classes=10))
    with pytest.raises(ConfigError, match=r"data.text_column='label' .* not text"):
        build_hf(_cfg(root, text_column="label"))


@needs_datasets
def test_unlabelled_split_and_missing_train_split_are_reported(tmp_path):
    import datasets

    labelled = _image_table(6)
    unlabelled = _image_table(3, labels=[-1, -1, -1])
    datasets.DatasetDict(train=labelled, test=unlabelled).save_to_disk(str(tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"'test' split .* holds the label -1"):
        build_hf(_cfg(tmp_path / "a"))
    datasets.DatasetDict(training=labelled).save_to_disk(str(tmp_path / "b"))
    with pytest.raises(ConfigError, match=r"no 'train' split; its splits are \['training'\]"):
        build_hf(_cfg(tmp_path / "b"))


def test_missing_datasets_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'sdnet_trainer\[hf\]'"):
        build_hf(_cfg(tmp_path))


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------

TEXTS = ["the quick brown fox", "jumps over", "the lazy dog " * 3, "héllo wörld"]


def _save_text(root: Path, *, val: bool = True) -> None:
    import datasets

    train = datasets.Dataset.from_dict({"text": TEXTS, "n": list(range(len(TEXTS)))})
    if val:
        held = datasets.Dataset.from_dict({"text": ["a dog and a fox", "over the brown dog"]})
        datasets.DatasetDict(train=train, validation=held).save_to_disk(str(root))
    else:
        train.save_to_disk(str(root))


def _stream(ds) -> list[int]:
    """The tokens a window dataset covers, reassembled from inputs and the last target."""
    return [x for i in range(len(ds)) for x in ds[i][0].tolist()] + [int(ds[len(ds) - 1][1][-1])]


@needs_datasets
def test_text_as_bytes_matches_the_text_format(tmp_path):
    _save_text(tmp_path / "t")
    train, val = build_hf(_cfg(tmp_path / "t", text_column="text", seq_len=8))
    assert isinstance(train, TextBytes) and isinstance(val, TextBytes)
    stream = "\n".join(TEXTS).encode()
    assert len(train) == (len(stream) - 1) // 8
    inputs, targets = train[2]
    assert inputs.dtype == torch.int64 and inputs.tolist() == list(stream[16:24])
    assert targets.tolist() == list(stream[17:25])
    assert bytes(_stream(val)) == b"a dog and a fox\nover the brown dog"[: 1 + 8 * len(val)]
    with pytest.raises(ConfigError, match=r"data.vocab_size=64: .* must be 256"):
        build_hf(_cfg(tmp_path / "t", text_column="text", seq_len=8, vocab_size=64))
    with pytest.raises(ConfigError, match=r"data.text_column='n' .* not text"):
        build_hf(_cfg(tmp_path / "t", text_column="n", seq_len=8))
    with pytest.raises(ConfigError, match=r"data.text_column='body' is not a column .*'text'"):
        build_hf(_cfg(tmp_path / "t", text_column="body", seq_len=8))
    with pytest.raises(ConfigError, match=r"data.seq_len=64 needs at least 65"):
        build_hf(_cfg(tmp_path / "t", text_column="text", seq_len=64))


@needs_datasets
def test_text_without_validation_split_holds_out_the_tail(tmp_path):
    _save_text(tmp_path / "t", val=False)
    train, val = build_hf(_cfg(tmp_path / "t", text_column="text", seq_len=4))
    stream = "\n".join(TEXTS).encode()
    val_len = max(int(len(stream) * 0.1), 5)
    assert bytes(_stream(train)) == stream[: len(stream) - val_len][: 1 + 4 * len(train)]
    assert bytes(_stream(val)) == stream[len(stream) - val_len :][: 1 + 4 * len(val)]


def _word_tokenizer(path: Path) -> Path:
    """A word-level tokenizer built offline from the test's own words, saved as tokenizer.json,
    with a template that ends every row with [EOS]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        TEXTS + ["a dog and a fox", "over the brown dog"],
        trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="$A [EOS]", special_tokens=[("[EOS]", tok.token_to_id("[EOS]"))]
    )
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return path


@needs_datasets
@needs_tokenizers
def test_text_with_a_tokenizer_gives_its_ids(tmp_path):
    from tokenizers import Tokenizer

    _save_text(tmp_path / "t")
    folder = _word_tokenizer(tmp_path / "tok")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    cfg = _cfg(tmp_path / "t", text_column="text", seq_len=3, tokenizer=str(folder))
    cfg.vocab_size = vocab
    train, val = build_hf(cfg)
    assert isinstance(train, TokenWindows)
    expected = [i for text in TEXTS for i in tok.encode(text).ids]
    assert expected.count(tok.token_to_id("[EOS]")) == len(TEXTS)  # one per row
    assert _stream(train) == expected[: 1 + 3 * len(train)]
    assert train[1][0].dtype == torch.int64
    held = [i for t in ("a dog and a fox", "over the brown dog") for i in tok.encode(t).ids]
    assert _stream(val) == held[: 1 + 3 * len(val)]
    # The file itself works too; a vocabulary that cannot hold the ids does not.
    cfg.tokenizer = str(folder / "tokenizer.json")
    assert _stream(build_hf(cfg)[0]) == _stream(train)
    cfg.vocab_size = vocab - 1
    with pytest.raises(ConfigError, match=rf"data.vocab_size={vocab - 1} .* {vocab} tokens"):
        build_hf(cfg)
    cfg.vocab_size, cfg.tokenizer = vocab, str(tmp_path)
    with pytest.raises(ConfigError, match=r"data.tokenizer=.* folder without tokenizer.json"):
        build_hf(cfg)


# --------------------------------------------------------------------------------------------
# Training through the Trainer
# --------------------------------------------------------------------------------------------


class _HFTrainer(Trainer):
    """Trains on build_hf's data and records what each step received, with the indices."""

    def build_datasets(self):
        train, val = build_hf(self.cfg.data)
        self.hf_train = train
        return IndexedDataset(train), val

    def compute_loss(self, batch):
        inputs, targets, indices = batch
        self.received = [*getattr(self, "received", []), (inputs, targets, indices)]
        return super().compute_loss((inputs, targets))


LOOP = [
    *CPU,
    "loop.max_steps=3",
    "loop.global_batch_size=4",
    "loop.eval_at_epoch_end=false",
    "logging.log_every_n_steps=1",
    "sched=constant",
]


@needs_datasets
def test_trainer_trains_on_saved_images(tmp_path):
    splits = _save_image_dict(tmp_path / "ds")
    cfg = compose(
        [
            *LOOP,
            "model=simple_cnn",
            "model.num_classes=3",
            "data.name=hf",
            f"data.root={tmp_path / 'ds'}",
            "data.image_size=16",
            "data.num_classes=3",
        ]
    )
    trainer = _HFTrainer(cfg, output_dir=tmp_path / "run")
    metrics = trainer.fit()
    assert trainer.state.step == 3 and len(trainer.received) == 3
    labels = splits["train"]["label"]
    for inputs, targets, indices in trainer.received:
        assert inputs.shape == (4, 3, 16, 16)
        assert targets.tolist() == [labels[i] for i in indices.tolist()]
    # The final evaluation read the validation split: its loss is the model's on those rows.
    _, val = build_hf(cfg.data)
    images = torch.stack([val[i][0] for i in range(len(val))])
    model = unwrap(trainer.model).eval()
    with torch.no_grad():
        expected = F.cross_entropy(model(images), torch.tensor(splits["validation"]["label"]))
    assert metrics["val/loss"] == pytest.approx(expected.item(), rel=1e-4)


@needs_datasets
def test_trainer_trains_a_gpt_on_text_bytes(tmp_path):
    _save_text(tmp_path / "t")
    cfg = compose(
        [
            *LOOP,
            "model=gpt_tiny",
            "model.gpt.vocab_size=256",
            "data=text",
            "data.name=hf",
            f"data.root={tmp_path / 't'}",
            "data.text_column=text",
            "data.seq_len=8",
            "loop.eval_at_end=false",
            # Unused by the GPT; stands in for the class count only until data.name=hf with a
            # text column counts as language-model data in data/__init__.py.
            "model.num_classes=256",
        ]
    )
    trainer = _HFTrainer(cfg, output_dir=tmp_path / "run")
    trainer.fit()
    stream = torch.tensor(list("\n".join(TEXTS).encode()), dtype=torch.int64)
    assert trainer.state.step == 3 and len(trainer.received) == 3
    for inputs, targets, indices in trainer.received:
        for row, index in enumerate(indices.tolist()):
            assert torch.equal(inputs[row], stream[8 * index : 8 * index + 8])
            assert torch.equal(targets[row], stream[8 * index + 1 : 8 * index + 9])


class _HFFaultTrainer(FaultTrainer):
    """FaultTrainer (SIGTERM on request, records losses and indices) on build_hf's data."""

    def build_datasets(self):
        train, val = build_hf(self.cfg.data)
        return IndexedDataset(train), val


@needs_datasets
def test_stop_and_resume_on_hf_images_is_bitwise(tmp_path, monkeypatch):
    """The global-index sampler's guarantee holds for data.name=hf: with loader workers and the
    random train transforms, a run stopped after step 3 and resumed equals the uninterrupted
    one, across an epoch boundary (12 rows, 4 per step: 3 steps an epoch)."""
    _save_image_dict(tmp_path / "ds")
    cfg = compose(
        [
            *LOOP,
            "loop.max_steps=7",
            "loop.eval_at_end=false",
            "data.num_workers=2",
            "model=simple_cnn",
            "data.name=hf",
            f"data.root={tmp_path / 'ds'}",
            "data.image_size=16",
            "data.num_classes=null",  # taken from the ClassLabel
        ]
    )
    for leg in ("ref", "run"):
        (tmp_path / leg).mkdir()  # FaultTrainer saves its record there
    reference = _HFFaultTrainer(cfg, output_dir=tmp_path / "ref")
    reference.fit()
    assert (cfg.data.num_classes, cfg.model.num_classes) == (3, 3)
    monkeypatch.setenv("SDNET_TEST_SIGTERM", "0:2")  # agreed, and saved, at step 3
    with pytest.raises(SystemExit):
        _HFFaultTrainer(cfg, output_dir=tmp_path / "run").fit()
    monkeypatch.delenv("SDNET_TEST_SIGTERM")
    resumed = _HFFaultTrainer(cfg, output_dir=tmp_path / "run")
    resumed.fit()
    assert resumed.losses == reference.losses[3:]
    assert resumed.seen == reference.seen[3 * 4 :]
    for name, value in reference.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
