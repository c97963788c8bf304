"""Where a language model's training window starts: ``data.windows``.

``stride`` (the default) cuts the token stream into windows of ``seq_len + 1`` tokens at stride
``seq_len``: window ``i`` starts at ``i * seq_len``, so every token but the first is a target
exactly once per epoch. ``random`` starts each window at an offset drawn uniformly from every
start that fits (``0 .. tokens - seq_len - 1``), as nanoGPT's
``torch.randint(len(data) - block_size, (batch_size,))`` does: the model sees the text at every
alignment, not only at multiples of ``seq_len``.

An epoch of random windows holds as many windows as the stride cut, ``(tokens - 1) // seq_len``
(nanoGPT's notional epoch: on average every token a target once), so ``loop.max_epochs``, the
steps per epoch and the sampler's positions mean what they mean for stride windows.

The draw is the one the training loader already makes reproducible: a data set that says
``draws_random`` is loaded through :class:`~sdnet_trainer.data.seeding.SampleSeeded`, which seeds
torch's generator from (seed, epoch, index) right before each sample, in whichever process or
worker loads it, and the index is the sampler's, a function of (seed, epoch, global position)
(:class:`~sdnet_trainer.data.sampler.GlobalBatchSampler`). A window's start is therefore a
function of (seed, epoch, global sample position) alone: not of the world size, the micro-batch,
the loader's workers or the step a run resumed at, and the checkpoint's data position (epoch and
sample of the epoch) is all a resume needs, on any world size. A hash of (seed, epoch, index)
computed here would duplicate that seeding, and would need the epoch, which the loader hands to
``SampleSeeded`` and not to the data set.

Validation windows stay at stride: evaluation covers every held-out token exactly once.
"""

from __future__ import annotations

import torch

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.errors import ConfigError

# data.windows
WINDOWS = ("stride", "random")


def random_windows(cfg: DataConfig) -> bool:
    """Whether ``data.windows`` asks for random training windows (checked against WINDOWS)."""
    check_choice("data.windows", cfg.windows, WINDOWS)
    return cfg.windows == "random"


def refuse_random_windows(cfg: DataConfig, what: str) -> None:
    """For data without a token stream to window (``what`` says what it has instead)."""
    if random_windows(cfg):
        raise ConfigError(
            f"data.windows=random draws windows from a token stream, but data.name={cfg.name!r} "
            f"has {what}; set data.windows=stride (its default)"
        )


def window_start(index: int, *, seq_len: int, tokens: int, random: bool) -> int:
    """Where window ``index`` of a ``tokens``-long stream starts (``index`` checked already).

    Random starts draw from torch's default generator, which the training loader seeds per
    sample (see the module's docstring); called outside that seeding it advances the caller's
    stream by one draw, as a random crop does.
    """
    if not random:
        return index * seq_len
    return int(torch.randint(tokens - seq_len, (1,)))
