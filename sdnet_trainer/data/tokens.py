"""Token datasets for the GPT: a synthetic language that needs no download, and byte-level text.

``tokens``: sequences from a fixed random *sparse Markov chain*. Every token has a few likely
successors, with fixed probabilities, so the next token is predictable from the current one: a
small model learns the table within a few hundred steps, and the best achievable loss (the chain's
entropy, at most ~1.2 nats with the probabilities below) sits far below the ``log(vocab_size)`` of
guessing. Sample ``i`` is a pure function of ``(seed, split, i)``, so ``ds[i]`` is identical every
call and in every DataLoader worker; the transition table depends on the seed only, so train and
val speak the same language.

``text`` without ``data.tokenizer``: the bytes of a UTF-8 file (or of a folder's ``.txt`` files) as
tokens 0..255, cut into windows; the last ~10% of the bytes are held out for validation. With a
tokenizer, ``data/text.py`` tokenizes the files into a token cache instead.

A sample is ``(inputs, targets)``: two int64 tensors of ``seq_len`` tokens, ``targets`` being
``inputs`` shifted left by one, so each position is trained to predict the token after it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.utils.data import Dataset

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.synthetic import _SPLITS, _generator, check_index
from sdnet_trainer.data.windows import random_windows, refuse_random_windows, window_start
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

# Successor probabilities, most likely first. Entropy: 1.21 nats per token, against log(256) = 5.5
# or log(64) = 4.2 for a uniform guess.
_SUCCESSOR_PROBS = (0.5, 0.25, 0.15, 0.1)

# Random streams distinct from synthetic.py's, so the two datasets never share one.
_STREAM_TRANSITIONS = 11
_STREAM_SEQUENCES = 12

# Bytes are the tokens of the text dataset.
BYTE_VOCAB = 256
# Share of the text (its tail) held out for validation.
_TEXT_VAL_FRACTION = 0.1


def _transition_table(seed: int, vocab_size: int) -> list[list[int]]:
    """``table[v]``: the distinct successors of token ``v``, most likely first.

    Distinct without a per-token ``randperm(vocab_size)`` (quadratic in the vocabulary): sorted
    draws from ``[0, V - K]`` plus ``0, 1, .., K-1`` are strictly increasing, hence distinct; a
    random column order per row then decides which of them is the most likely.
    """
    k = min(len(_SUCCESSOR_PROBS), vocab_size)
    gen = _generator(seed, _STREAM_TRANSITIONS)
    draws = torch.randint(vocab_size - k + 1, (vocab_size, k), generator=gen).sort(dim=1).values
    successors = draws + torch.arange(k)
    order = torch.rand(vocab_size, k, generator=gen).argsort(dim=1)
    # Plain lists: the per-token walk in __getitem__ indexes them faster than a tensor.
    return successors.gather(1, order).tolist()


class MarkovTokens(Dataset):
    """``size`` token sequences of the seed's sparse Markov chain over ``vocab_size`` tokens."""

    draws_random = False  # each sample is a pure function of its index (no per-sample seeding)

    def __init__(
        self, size: int, *, seq_len: int, vocab_size: int, seed: int, split: str = "train"
    ) -> None:
        if size < 0:
            raise ValueError(f"MarkovTokens: size must be >= 0, got {size}")
        if seq_len < 1 or vocab_size < 2:
            raise ValueError(
                f"MarkovTokens: need seq_len >= 1 and vocab_size >= 2, got {seq_len}, {vocab_size}"
            )
        if split not in _SPLITS:
            raise ValueError(f"MarkovTokens: split must be one of {sorted(_SPLITS)}, got {split!r}")
        self.size = size
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.split = split
        self._split_id = _SPLITS[split]
        self.successors = _transition_table(seed, vocab_size)
        probs = torch.tensor(_SUCCESSOR_PROBS[: len(self.successors[0])], dtype=torch.float64)
        # Cumulative, renormalised (vocab_size < 4 keeps fewer successors), for inverse-CDF draws.
        self._cdf = (probs.cumsum(0) / probs.sum())[:-1]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = check_index(index, self.size, type(self).__name__)
        gen = _generator(self.seed, self._split_id, _STREAM_SEQUENCES, index)
        first = int(torch.randint(self.vocab_size, (1,), generator=gen))
        # One uniform draw per step, turned into a successor rank all at once; only the walk
        # itself, where each step depends on the last, is a Python loop.
        ranks = torch.searchsorted(
            self._cdf, torch.rand(self.seq_len, generator=gen, dtype=torch.float64), right=True
        ).tolist()
        tokens = [first]
        for rank in ranks:
            tokens.append(self.successors[tokens[-1]][rank])
        seq = torch.tensor(tokens, dtype=torch.int64)
        return seq[:-1], seq[1:]

    def __repr__(self) -> str:
        return (
            f"MarkovTokens(size={self.size}, seq_len={self.seq_len}, vocab_size={self.vocab_size}, "
            f"seed={self.seed}, split={self.split!r})"
        )


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` token ids at stride ``seq_len`` over a 1-D integer tensor;
    sample ``i`` is (inputs, targets), the targets shifted by one.

    The stride is ``seq_len``, not ``seq_len + 1``: the last token of one window is the first input
    of the next, so every token but the very first is a target exactly once. With ``random``
    each window starts at a random offset instead, as many windows per epoch (data/windows.py).
    """

    draws_random = False  # each sample is a pure function of its index (no per-sample seeding)

    def __init__(self, data: torch.Tensor, *, seq_len: int, random: bool = False) -> None:
        name = type(self).__name__
        if data.dim() != 1 or not self._accepts(data.dtype):
            raise ValueError(
                f"{name}: data must be a 1-D {self._dtype_text} tensor, got {data.dtype} "
                f"{tuple(data.shape)}"
            )
        if seq_len < 1:
            raise ValueError(f"{name}: seq_len must be >= 1, got {seq_len}")
        self.data = data
        self.seq_len = seq_len
        self.size = max(0, (len(data) - 1) // seq_len)
        # Random starts draw from the generator the loader seeds per sample (data/seeding.py).
        self.draws_random = random

    _dtype_text = "integer"

    @staticmethod
    def _accepts(dtype: torch.dtype) -> bool:
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = check_index(index, self.size, type(self).__name__)
        start = window_start(
            index, seq_len=self.seq_len, tokens=len(self.data), random=self.draws_random
        )
        window = self.data[start : start + self.seq_len + 1].to(torch.int64)
        return window[:-1], window[1:]

    def __repr__(self) -> str:
        name, tokens = type(self).__name__, len(self.data)
        windows = ", random windows" if self.draws_random else ""
        return f"{name}(tokens={tokens}, seq_len={self.seq_len}, samples={self.size}{windows})"


class TextBytes(TokenWindows):
    """:class:`TokenWindows` over the bytes of a text (a uint8 tensor): byte-level modelling."""

    _dtype_text = "uint8"

    @staticmethod
    def _accepts(dtype: torch.dtype) -> bool:
        return dtype == torch.uint8


def build_tokens(cfg: DataConfig) -> tuple[MarkovTokens, MarkovTokens]:
    """The (train, val) pair described by ``cfg``: one Markov chain, different sequences."""
    for key in ("train_size", "val_size", "seq_len"):
        value = getattr(cfg, key)
        if value < 1:
            raise ConfigError(f"data.{key}={value} must be >= 1 for data.name='tokens'")
    if cfg.vocab_size < 2:
        raise ConfigError(f"data.vocab_size={cfg.vocab_size} must be >= 2 for data.name='tokens'")
    refuse_random_windows(cfg, "independent generated sequences, each a function of its index")
    common = dict(seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, seed=cfg.synthetic_seed)
    train = MarkovTokens(cfg.train_size, split="train", **common)
    val = MarkovTokens(cfg.val_size, split="val", **common)
    logger.info(
        "token data: %d train / %d val sequences of %d tokens", len(train), len(val), cfg.seq_len
    )
    return train, val


def build_text(cfg: DataConfig) -> tuple[TextBytes, TextBytes]:
    """Byte-level (train, val) windows over the text at ``data.root``; val is the last ~10%."""
    if cfg.vocab_size != BYTE_VOCAB:
        raise ConfigError(
            f"data.vocab_size={cfg.vocab_size}: data.name='text' reads bytes, so it must be "
            f"{BYTE_VOCAB} (set model.gpt.vocab_size={BYTE_VOCAB})"
        )
    if cfg.seq_len < 1:
        raise ConfigError(f"data.seq_len={cfg.seq_len} must be >= 1 for data.name='text'")
    random = random_windows(cfg)
    data = _read_bytes(cfg.root)
    window = cfg.seq_len + 1
    # At least one window each for val and train.
    val_bytes = max(int(len(data) * _TEXT_VAL_FRACTION), window)
    if len(data) - val_bytes < window:
        raise ConfigError(
            f"data.root={cfg.root!r} holds {len(data)} bytes of text; data.seq_len={cfg.seq_len} "
            f"needs at least {2 * window} (one window of seq_len + 1 bytes each for train and val)"
        )
    train = TextBytes(data[: len(data) - val_bytes], seq_len=cfg.seq_len, random=random)
    val = TextBytes(data[len(data) - val_bytes :], seq_len=cfg.seq_len)
    logger.info(
        "text data: %d bytes, %d train (%s) / %d val windows of %d bytes",
        len(data),
        len(train),
        cfg.windows,
        len(val),
        cfg.seq_len,
    )
    return train, val


def _read_bytes(root: str | None) -> torch.Tensor:
    """The bytes of ``root`` (a file) or of its ``.txt`` files (a folder, recursively, in sorted
    path order), concatenated into one uint8 tensor held in memory."""
    if root is None:
        raise ConfigError(
            "data.root is not set: data.name='text' needs a UTF-8 text file or a folder of "
            ".txt files (data.root=PATH)"
        )
    path = Path(root).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise ConfigError(f"data.root={root!r} is a folder without .txt files")
    elif path.is_file():
        files = [path]
    else:
        raise ConfigError(f"data.root={root!r} does not exist")
    raw = bytearray()
    for file in files:
        raw += file.read_bytes()
    # A bytearray is writable, so torch.frombuffer shares it without a warning or a copy.
    return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
