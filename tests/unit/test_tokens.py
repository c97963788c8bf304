"""Token datasets: the synthetic Markov language (data.name=tokens) and byte-level text (text)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data import MarkovTokens, TextBytes, build_datasets
from sdnet_trainer.errors import ConfigError


def _tokens(size: int = 64, *, split: str = "train", seed: int = 3, **overrides) -> MarkovTokens:
    kwargs = dict(seq_len=24, vocab_size=40, seed=seed)
    kwargs.update(overrides)
    return MarkovTokens(size, split=split, **kwargs)


# --------------------------------------------------------------------------------------------
# tokens
# --------------------------------------------------------------------------------------------


def test_tokens_sample_is_inputs_and_targets_shifted_by_one():
    ds = _tokens()
    x, y = ds[5]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (24,)
    assert torch.equal(x[1:], y[:-1])
    assert int(x.min()) >= 0 and int(torch.cat([x, y]).max()) < 40


def test_tokens_item_is_pure_function_of_seed_split_and_index():
    ds = _tokens()
    assert all(torch.equal(a, b) for a, b in zip(ds[7], _tokens()[7]))
    assert all(torch.equal(a, b) for a, b in zip(ds[-1], ds[63]))
    assert not torch.equal(ds[0][0], ds[1][0])
    assert not torch.equal(ds[0][0], _tokens(split="val")[0][0])
    assert not torch.equal(ds[0][0], _tokens(seed=4)[0][0])
    # Train and val speak the same language: one transition table per seed.
    assert _tokens(split="val").successors == ds.successors
    with pytest.raises(IndexError):
        ds[64]


def test_tokens_are_the_same_in_dataloader_workers():
    ds = _tokens(16)
    serial = torch.stack([ds[i][0] for i in range(16)])
    workers = torch.cat([x for x, _ in DataLoader(ds, batch_size=4, num_workers=2)])
    assert torch.equal(serial, workers)


def test_tokens_follow_a_sparse_markov_chain():
    ds = _tokens(200)
    table = ds.successors
    assert all(len(set(row)) == len(row) == 4 for row in table)
    transitions = Counter()
    for i in range(len(ds)):
        x, y = ds[i]
        for a, b in zip(x.tolist(), y.tolist()):
            assert b in table[a]
            transitions[table[a].index(b)] += 1
    total = sum(transitions.values())
    # The most likely successor is drawn half the time, the least likely a tenth.
    assert transitions[0] / total == pytest.approx(0.5, abs=0.03)
    assert transitions[3] / total == pytest.approx(0.1, abs=0.02)


def test_tokens_tiny_vocabulary_keeps_fewer_successors():
    ds = _tokens(4, vocab_size=2)
    assert all(sorted(row) == [0, 1] for row in ds.successors)
    assert int(ds[0][0].max()) <= 1


def test_build_datasets_tokens_from_config():
    cfg = DataConfig(
        name="tokens", seq_len=12, vocab_size=30, train_size=10, val_size=3, synthetic_seed=5
    )
    train, val = build_datasets(cfg)
    assert isinstance(train, MarkovTokens) and (len(train), len(val)) == (10, 3)
    assert train[0][0].shape == (12,) and val.split == "val" and train.seed == 5


@pytest.mark.parametrize(
    "key,value", [("train_size", 0), ("val_size", 0), ("seq_len", 0), ("vocab_size", 1)]
)
def test_build_tokens_rejects_bad_sizes(key, value):
    with pytest.raises(ConfigError, match=rf"data\.{key}={value}"):
        build_datasets(DataConfig(name="tokens", **{key: value}))


def test_data_groups_take_their_sizes_from_model_gpt():
    cfg = compose(["model=gpt_tiny", "data=tokens"])
    assert (cfg.data.name, cfg.data.seq_len, cfg.data.vocab_size) == ("tokens", 32, 64)
    cfg = compose(["model=gpt_small", "data=text"])
    assert (cfg.data.name, cfg.data.root, cfg.data.seq_len, cfg.data.vocab_size) == (
        "text",
        None,
        128,
        256,
    )


# --------------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------------


def _text_cfg(root: Path | str | None, *, seq_len: int = 8, **overrides) -> DataConfig:
    return DataConfig(
        name="text",
        root=None if root is None else str(root),
        seq_len=seq_len,
        vocab_size=256,
        **overrides,
    )


def _bytes(ds: TextBytes) -> bytes:
    """The bytes a dataset's windows cover, reassembled from inputs and the last target."""
    out = [x for i in range(len(ds)) for x in ds[i][0].tolist()]
    return bytes(out + [int(ds[len(ds) - 1][1][-1])])


def test_text_file_windows_and_val_tail(tmp_path):
    text = "".join(
        f"line {i}: héllo wörld\n" for i in range(40)
    ).encode()  # 960 bytes, some multi-byte
    (tmp_path / "corpus.txt").write_bytes(text)
    train, val = build_datasets(_text_cfg(tmp_path / "corpus.txt", seq_len=16))
    assert isinstance(train, TextBytes)
    x, y = train[3]
    assert x.dtype == torch.int64 and x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])
    assert bytes(x.tolist()) == text[48:64]  # stride seq_len
    # The last 10% of the bytes are val, the rest train; windows tile each part.
    val_start = len(text) - len(text) // 10
    assert len(train) == (val_start - 1) // 16 and len(val) == (len(text) // 10 - 1) // 16
    assert text[:val_start].startswith(_bytes(train)) and text[val_start:].startswith(_bytes(val))


def test_text_folder_concatenates_txt_files_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"B" * 40)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"C" * 40)
    (tmp_path / "a.txt").write_bytes(b"A" * 40)
    (tmp_path / "notes.md").write_bytes(b"ignored")
    train, val = build_datasets(_text_cfg(tmp_path, seq_len=20))
    # A small text still gets one val window: the last seq_len + 1 = 21 bytes, more than 10% of 120.
    assert len(val) == 1 and _bytes(val) == b"C" * 21
    # The other 99 bytes make 4 windows of 20 targets each.
    assert len(train) == 4 and _bytes(train) == b"A" * 40 + b"B" * 40 + b"C"


def test_text_errors_name_the_key_and_numbers(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.root is not set"):
        build_datasets(_text_cfg(None))
    with pytest.raises(ConfigError, match=r"data\.root=.*missing.*does not exist"):
        build_datasets(_text_cfg(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"data\.root=.*without \.txt files"):
        build_datasets(_text_cfg(tmp_path))
    (tmp_path / "short.txt").write_bytes(b"x" * 17)
    with pytest.raises(ConfigError, match=r"holds 17 bytes.*data\.seq_len=8 needs at least 18"):
        build_datasets(_text_cfg(tmp_path / "short.txt"))
    (tmp_path / "short.txt").write_bytes(b"x" * 18)
    train, val = build_datasets(_text_cfg(tmp_path / "short.txt"))
    assert len(train) == len(val) == 1
    with pytest.raises(ConfigError, match=r"data\.vocab_size=64.*256"):
        build_datasets(DataConfig(name="text", root=str(tmp_path), vocab_size=64))
