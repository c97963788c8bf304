"""``data.windows=random``: language-model windows at random offsets (data/windows.py), drawn
from (seed, epoch, sample) alone, so that they are reproducible and resume exactly on another
world size."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data import build_datasets, skipped_samples
from sdnet_trainer.data.loader import RunData, train_loader
from sdnet_trainer.data.seeding import SampleSeeded
from sdnet_trainer.data.shards import INDEX_SUFFIX, build_shards, convert
from sdnet_trainer.data.text import split_windows
from sdnet_trainer.data.token_cache import open_cache
from sdnet_trainer.data.tokens import TextBytes
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.preflight import validate
from sdnet_trainer.training.state import EpochShape, RunState

SEQ = 8
SEED = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, bytes]:
    """400 random bytes: every 9-byte window occurs once, so a window tells where it starts."""
    raw = random.Random(0).randbytes(400)
    path = tmp_path_factory.mktemp("text") / "corpus.bin.txt"
    path.write_bytes(raw)
    return path, raw


def _cfg(path: Path, **overrides) -> DataConfig:
    return DataConfig(
        **{"name": "text", "root": str(path), "seq_len": SEQ, "vocab_size": 256, **overrides}
    )


def _starts(raw: bytes, windows: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """Where each (inputs, targets) window starts in ``raw``, checking that it is a slice of it
    with the targets shifted by one."""
    starts = []
    for inputs, targets in windows:
        assert torch.equal(inputs[1:], targets[:-1])
        start = raw.find(bytes(inputs.tolist() + [int(targets[-1])]))
        assert start >= 0
        starts.append(start)
    return starts


def _epoch(dataset, *, seed: int = SEED, epoch: int = 0, num_workers: int = 0) -> list:
    """One epoch of 1-rank micro-batches of 4 from the training loader, split into samples."""
    cfg = DataConfig(num_workers=num_workers, persistent_workers=False)
    loader, sampler = train_loader(
        dataset,
        cfg=cfg,
        device_type="cpu",
        micro_batch_size=4,
        grad_accum_steps=1,
        dp_size=1,
        dp_rank=0,
        seed=seed,
    )
    sampler.set_epoch(epoch)
    return [(x, y) for inputs, targets in loader for x, y in zip(inputs, targets)]


def test_random_windows_are_reproducible_and_differ_from_stride(corpus):
    path, raw = corpus
    stride, stride_val = build_datasets(_cfg(path))
    train, val = build_datasets(_cfg(path, windows="random"))
    assert isinstance(train, TextBytes) and train.draws_random and not stride.draws_random
    # An epoch holds as many windows as the stride cut: loop.max_epochs keeps its meaning.
    assert len(train) == len(stride) == (360 - 1) // SEQ
    # Validation stays at stride: every held-out byte is evaluated once.
    assert not val.draws_random and len(val) == len(stride_val)
    assert all(torch.equal(val[i][0], stride_val[i][0]) for i in range(len(val)))

    first = _epoch(train)
    starts = _starts(raw[:360], first)
    assert starts == _starts(raw[:360], _epoch(train))  # the same seed: the same windows
    # ... also drawn in loader workers, whichever loads which sample.
    assert starts == _starts(raw[:360], _epoch(train, num_workers=2))
    assert all(0 <= s <= 360 - SEQ - 1 for s in starts)
    assert any(s % SEQ for s in starts)  # not the stride grid
    stride_starts = _starts(raw[:360], _epoch(stride))
    assert all(s % SEQ == 0 for s in stride_starts) and starts != stride_starts
    assert starts != _starts(raw[:360], _epoch(train, seed=SEED + 100))  # another seed
    assert starts != _starts(raw[:360], _epoch(train, epoch=1))  # another epoch


def _global_batches(
    dataset, state: RunState, shape: EpochShape, *, world: int, accum: int, steps: int
) -> tuple[list[torch.Tensor], list[dict]]:
    """The inputs of ``steps`` global batches of 4 from ``state``'s position on, gathered from
    ``world`` data-parallel ranks of micro-batch 4 / (world x accum) in the global order
    (micro-step, then rank), and what a checkpoint after each step would hold of ``state``
    (advanced after each step, as the Trainer does)."""
    micro = 4 // (world * accum)
    runs = [
        RunData(
            dataset,
            None,
            cfg=DataConfig(num_workers=0),
            device=torch.device("cpu"),
            micro_batch_size=micro,
            grad_accum_steps=accum,
            eval_batch_size=4,
            dp_size=world,
            dp_rank=rank,
            seed=SEED,
        )
        for rank in range(world)
    ]
    for run in runs:
        run.start(state)
    batches, saved = [], []
    try:
        for _ in range(steps):
            batches.append(torch.cat([run.next_batch()[0] for _ in range(accum) for run in runs]))
            state.advance(shape)
            saved.append(state.state_dict())  # the checkpoint's data position ("trainer" part)
        return batches, saved
    finally:
        for run in runs:
            run.close()


def test_random_windows_resume_exactly_on_another_world_size(corpus):
    path, _ = corpus
    train, _ = build_datasets(_cfg(path, windows="random"))
    shape = EpochShape(global_batch_size=4, steps_per_epoch=len(train) // 4)  # 11 steps
    total, stop = 16, 7  # stopped mid epoch 0, resumed into epoch 1
    state = RunState()
    uninterrupted, saved = _global_batches(train, state, shape, world=1, accum=1, steps=total)
    assert state.epoch == 1  # the run went past an epoch's end

    resumed_state = RunState()
    resumed_state.load_state_dict(saved[stop - 1])  # the checkpoint of step `stop`
    resumed, _ = _global_batches(train, resumed_state, shape, world=2, accum=2, steps=total - stop)

    assert len(resumed) == total - stop
    for step, (want, got) in enumerate(zip(uninterrupted[stop:], resumed), start=stop):
        assert torch.equal(want, got), f"step {step}"
    # Epoch 1 draws other windows than epoch 0 (not the same batches again).
    assert not torch.equal(uninterrupted[0], uninterrupted[shape.steps_per_epoch])


def test_packed_tokens_and_text_shards_draw_the_same_random_windows(corpus, tmp_path):
    """The token cache's windows (data=text with a tokenizer, data=chat) and the text shards'
    follow data.windows too, drawing as the byte windows do."""
    path, raw = corpus
    cfg = _cfg(path, windows="random")
    cache = open_cache(
        root=path,
        sources=[path],
        folder=tmp_path / "cache",
        settings={"kind": "test"},
        vocab_size=256,
        with_trained=False,
        encode=lambda: [(list(raw), None, len(raw))],
    )
    packed, packed_val = split_windows(cfg, cache, mask_eos=None)
    assert packed.draws_random and not packed_val.draws_random
    src = tmp_path / "src"
    for split, data in (("train", raw[:360]), ("val", raw[360:])):
        (src / split).mkdir(parents=True)
        (src / split / "a.txt").write_bytes(data)
    convert(src, tmp_path / "shards", shard_size=1)
    shards, shards_val = build_shards(_cfg(tmp_path / "shards", windows="random"))
    assert shards.draws_random and not shards_val.draws_random
    text, _ = build_datasets(cfg)
    assert len(packed) == len(shards) == len(text)
    for epoch, index in ((0, 0), (0, 5), (1, 5), (2, len(text) - 1)):
        key = (epoch, index)
        want = SampleSeeded(text, seed=SEED)[key]
        for other in (packed, shards):
            got = SampleSeeded(other, seed=SEED)[key]
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (other, key)


def test_random_shard_windows_skip_bad_bytes_alike_in_every_process(tmp_path):
    """Under data.on_bad_sample=skip, a random window that reaches into a truncated shard is
    replaced by the next draw; that an index hit a bad member in an earlier epoch changes
    nothing, so a resumed process (which has read nothing yet) loads what the first one does."""
    raw = random.Random(1).randbytes(360)
    src, out = tmp_path / "src", tmp_path / "out"
    for split, parts in (("train", (raw[:120], raw[120:240], raw[240:])), ("val", (raw[:40],))):
        (src / split).mkdir(parents=True)
        for number, part in enumerate(parts):
            (src / split / f"{number}.txt").write_bytes(part)
    convert(src, out, shard_size=1)
    shard = out / "train" / "train-000001.tar"
    (_, _, offset, _, _) = json.loads(Path(f"{shard}{INDEX_SUFFIX}").read_text())["samples"][0]
    shard.write_bytes(shard.read_bytes()[: offset + 10])  # bytes 130..240 are lost
    cfg = DataConfig(
        name="shards", root=str(out), seq_len=SEQ, windows="random", on_bad_sample="skip"
    )

    def epoch(dataset, number: int) -> list:
        seeded = SampleSeeded(dataset, seed=SEED)
        return [seeded[(number, index)] for index in range(len(dataset))]

    used, _ = build_shards(cfg)
    epoch(used, 0)
    counter = skipped_samples(used)
    assert counter is not None and counter() > 0  # some windows reached into the cut
    fresh, _ = build_shards(cfg)
    later = epoch(used, 1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(later, epoch(fresh, 1)))
    assert all(s + SEQ < 130 or s >= 240 for s in _starts(raw, later))


def test_windows_key_is_checked_and_refused_where_there_is_no_stream(corpus, tmp_path):
    path, _ = corpus
    assert compose(["model=gpt_small", "data=text", "data.windows=random"]).data.windows == "random"
    with pytest.raises(ConfigError, match=r"data\.windows='randon' is not one of .*'random'"):
        build_datasets(_cfg(path, windows="randon"))
    with pytest.raises(ConfigError, match=r"data\.windows=random .* data\.name='tokens'"):
        build_datasets(DataConfig(name="tokens", seq_len=SEQ, vocab_size=16, windows="random"))
    from PIL import Image

    for split in ("train", "val"):
        (tmp_path / "images" / split / "cat").mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(tmp_path / "images" / split / "cat" / "0.png")
    convert(tmp_path / "images", tmp_path / "shards")
    cfg = DataConfig(name="shards", root=str(tmp_path / "shards"), windows="random")
    with pytest.raises(ConfigError, match=r"data\.windows=random .* has image shards"):
        build_shards(cfg)
    # Images without a stream at all (synthetic, folders, CIFAR-10): refused before launch.
    with pytest.raises(ConfigError, match=r"data\.windows=random .* data\.name='synthetic' holds"):
        validate(compose(["model=simple_cnn", "data.windows=random"]), world_size=1)
    with pytest.raises(ConfigError, match=r"data\.windows='randon' is not one of"):
        validate(compose(["model=simple_cnn", "data.windows=randon"]), world_size=1)
