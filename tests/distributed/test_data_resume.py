"""Exact resume on the data sets read from files other than an image folder: tar shards
(data=shards) and a Hugging Face dataset on disk (data=hf), both made from scikit-learn's digits
(scripts/data/make_digits.py), and tokenized text (data=text through its token cache), on
2 processes with gloo.

A run stopped by SIGTERM at step 3 is resumed twice from the same checkpoint: with 2 processes it
ends bitwise equal to the uninterrupted 2-process run; with 1 process (the global batch kept) it
trains on every sample of the epoch exactly once, the same samples as the uninterrupted run, and
ends at the same weights within float tolerance. The method of tests/distributed/test_faults.py
for the synthetic images, here with the random crops of the real data sets' training transforms.
"""

from __future__ import annotations

import shutil
from importlib.util import find_spec

import pytest
import torch

from tests.support import (
    CPU,
    DIGITS_CLASSES,
    FINAL_STATE,
    convert_to_shards,
    corpus_line,
    image_folder_to_hf,
    make_digits,
    run_cli,
    seen_samples,
    write_bpe_tokenizer,
)

GLOBAL_BATCH = 64
# The first 46 training images of each digit: an epoch of 7 steps (448 of the 460 images, the
# last partial batch dropped) and shards of 100 images, more than one per epoch: the resume at step
# 3 has 4 steps after it; the whole 1,437 images would only repeat the same check 3 times over.
TRAIN_PER_CLASS = 46
TRAIN_IMAGES = TRAIN_PER_CLASS * DIGITS_CLASSES
STEPS = TRAIN_IMAGES // GLOBAL_BATCH
COMMON = [
    *CPU,
    "trainer._target_=tests.support.FaultTrainer",  # records each rank's sample indices
    "model=simple_cnn",
    "data.image_size=16",
    "data.num_workers=1",
    "optim=sgd",
    "optim.lr=0.05",
    "sched=cosine",
    f"loop.global_batch_size={GLOBAL_BATCH}",
    f"loop.max_steps={STEPS}",
    "loop.eval_at_end=false",
    "loop.eval_at_epoch_end=false",
    "logging.log_every_n_steps=2",
]
# No dropout: a resume on another world size re-derives the per-rank random streams, and the
# uninterrupted run is the reference of both resumes.
ENV = {"SDNET_TEST_DROPOUT": "0"}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The digits' ImageFolder, its training split cut to TRAIN_PER_CLASS images a class."""
    folder = make_digits(tmp_path_factory.mktemp("digits") / "folder", size=16)
    for label in (folder / "train").iterdir():
        for image in sorted(label.iterdir())[TRAIN_PER_CLASS:]:
            image.unlink()
    assert len(list((folder / "train").glob("*/*.png"))) == TRAIN_IMAGES
    return folder


@pytest.fixture(scope="module")
def digit_shards(digits):
    """The digits as shards, written once and only read by the runs."""
    return convert_to_shards(digits, digits.parent / "shards", shard_size=100)


def _data_args(kind: str, digits, digit_shards, base) -> list[str]:
    if kind == "shards":
        return ["data=shards", f"data.root={digit_shards}"]
    if find_spec("datasets") is None:
        pytest.skip("needs the hf extra: pip install 'sdnet_trainer[hf]'")
    return ["data=hf", f"data.root={image_folder_to_hf(digits, base / 'hf')}"]


def _final(run_dir) -> dict:
    return torch.load(run_dir / FINAL_STATE, weights_only=True)


@pytest.mark.parametrize("kind", ["shards", "hf"])
def test_resume_is_bitwise_and_on_one_process_sees_each_sample_once(
    kind, digits, digit_shards, tmp_path
):
    args = [*COMMON, *_data_args(kind, digits, digit_shards, tmp_path)]

    def launch(run_dir, nproc, env=ENV):
        return run_cli(
            [*args, f"hydra.run.dir={run_dir}"],
            cwd=tmp_path,
            nproc=nproc if nproc > 1 else None,
            env=env,
        )

    reference = launch(tmp_path / "ref", 2)
    assert reference.returncode == 0, reference.output
    # Preempted during step 2: the ranks agree during step 3, save it and exit.
    stopped = launch(tmp_path / "same", 2, env={**ENV, "SDNET_TEST_SIGTERM": "0:2"})
    assert stopped.returncode == 143 and "SIGTERM: stopped at step 3" in stopped.output, (
        stopped.output
    )
    shutil.copytree(tmp_path / "same", tmp_path / "other")  # the checkpoint and the seen files
    expected = _final(tmp_path / "ref")
    epoch = seen_samples(tmp_path / "ref")
    assert len(epoch) == len(set(epoch)) == STEPS * GLOBAL_BATCH

    same = launch(tmp_path / "same", 2)
    assert same.returncode == 0, same.output
    assert "resumed from" in same.output and "step_00000003" in same.output
    got = _final(tmp_path / "same")
    assert got["losses"] == expected["losses"][3:]
    for name, value in expected["params"].items():
        assert torch.equal(got["params"][name], value), name
    assert sorted(seen_samples(tmp_path / "same")) == sorted(epoch)

    other = launch(tmp_path / "other", 1)
    assert other.returncode == 0, other.output
    assert "written by 2 ranks; random streams re-derived" in other.output
    seen = seen_samples(tmp_path / "other")
    assert sorted(seen) == sorted(epoch)  # the whole epoch, every sample exactly once
    got = _final(tmp_path / "other")
    assert got["losses"] == pytest.approx(expected["losses"][3:], rel=1e-4)
    for name, value in expected["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-6)


# The random parts of the training data, all on at once: per-sample augmentations, and the
# batch mixing that the batch seeds decide.
AUGMENT = ["data.augment.auto_augment=ta_wide", "data.augment.random_erase=0.25"]
MIXING = [*AUGMENT, "data.mixup_alpha=0.2", "data.cutmix_alpha=1.0"]


def test_mixed_batches_on_two_processes_resume_bitwise(digits, digit_shards, tmp_path):
    """MixUp/CutMix (on each rank's device batch, seeded by its place and data-parallel rank),
    TrivialAugment and random erasing on 2 ranks: a run stopped at step 3 and resumed ends
    bitwise equal to the uninterrupted run, and the mixing took place (other losses than the
    same augmented run without it)."""
    steps = 6
    args = [a for a in COMMON if not a.startswith("loop.max_steps=")]
    args += [f"loop.max_steps={steps}", *_data_args("shards", digits, digit_shards, tmp_path)]

    def launch(run_dir, extra, env=ENV):
        return run_cli([*args, *extra, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=2, env=env)

    plain = launch(tmp_path / "plain", AUGMENT)
    mixed = launch(tmp_path / "mixed", MIXING)
    assert plain.returncode == 0 and mixed.returncode == 0, plain.output + mixed.output
    expected = _final(tmp_path / "mixed")
    assert len(expected["losses"]) == steps
    assert expected["losses"][0] != _final(tmp_path / "plain")["losses"][0]

    stopped = launch(tmp_path / "resumed", MIXING, env={**ENV, "SDNET_TEST_SIGTERM": "0:2"})
    assert "SIGTERM: stopped at step 3" in stopped.output, stopped.output
    resumed = launch(tmp_path / "resumed", MIXING)
    assert resumed.returncode == 0 and "resumed from" in resumed.output, resumed.output
    got = _final(tmp_path / "resumed")
    assert got["losses"] == expected["losses"][3:]
    for name, value in expected["params"].items():
        assert torch.equal(got["params"][name], value), name


def test_text_resume_on_one_process_trains_every_token_once(tmp_path):
    """data=text through a BPE tokenizer's token cache (built here, in this process; the launches
    map it): stopped at step 3 on 2 processes and resumed on 1, the run trains every window of
    the epoch exactly once, so every token of the training split is a target exactly once."""
    from sdnet_trainer.config.schema import DataConfig
    from sdnet_trainer.data import build_datasets

    tokenizer = write_bpe_tokenizer(tmp_path / "tokenizer", template=None)
    corpus = tmp_path / "corpus.jsonl"
    seq_len, batch, documents = 32, 8, 300
    while True:  # an epoch of whole global batches covers the whole training split
        corpus.write_text("".join(f'{{"text": "{corpus_line(i)}"}}\n' for i in range(documents)))
        cfg = DataConfig(
            name="text", root=str(corpus), tokenizer=str(tokenizer), seq_len=seq_len, vocab_size=320
        )
        train, _ = build_datasets(cfg)
        if len(train) % batch == 0:
            break
        documents += 1
    steps = len(train) // batch
    args = [
        *CPU,
        "trainer._target_=tests.support.FaultTrainer",
        "model=gpt_tiny",
        "model.gpt.vocab_size=320",
        "data=text",
        f"data.root={corpus}",
        f"data.tokenizer={tokenizer}",
        "optim=adamw",
        "optim.lr=0.001",
        f"loop.global_batch_size={batch}",
        f"loop.max_steps={steps}",
        "loop.eval_at_end=false",
        "loop.eval_at_epoch_end=false",
        "logging.log_every_n_steps=2",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    stopped = run_cli(args, cwd=tmp_path, nproc=2, env={**ENV, "SDNET_TEST_SIGTERM": "0:2"})
    assert "SIGTERM: stopped at step 3" in stopped.output, stopped.output
    assert "token cache: reusing" in stopped.output  # mapped, not tokenized again
    resumed = run_cli(args, cwd=tmp_path, env=ENV)
    assert resumed.returncode == 0, resumed.output
    assert "written by 2 ranks; random streams re-derived" in resumed.output
    seen = seen_samples(tmp_path / "run")
    assert sorted(seen) == list(range(len(train)))  # every window of the epoch exactly once
    targets = sorted(p for i in seen for p in range(i * seq_len + 1, (i + 1) * seq_len + 1))
    assert targets == list(range(1, len(train) * seq_len + 1))  # every token exactly once
