"""What a sample that is there but cannot be decoded does: ``data.on_bad_sample``.

A damaged file (truncated, not an image) only shows when it is loaded, mid-training and often in
a DataLoader worker. ``error`` stops with the file's path (:class:`BadSampleError`); ``skip``
loads the next sample that decodes in its place (:func:`first_loadable`) and counts it
(:class:`SkippedSamples`). The data sets that follow the policy (image folders, shards, Hugging
Face images) use these pieces; CIFAR-10 is read from pickled arrays, not per-image files, so the
policy does not apply to it.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import TypeVar

from sdnet_trainer.errors import ConfigError

# data.on_bad_sample: what an image file that cannot be decoded does.
ON_BAD_SAMPLE = ("error", "skip")


class BadSampleError(ConfigError):
    """A data file that cannot be decoded, under ``data.on_bad_sample=error``.

    Raised in a DataLoader worker, it reaches the main process through torch's
    ``ExceptionWrapper.reraise``, which builds a new ``BadSampleError`` from "Caught
    BadSampleError in DataLoader worker process N." plus the worker's whole traceback. The
    constructor keeps only the original one-line message, so the CLI's ``config error: ...`` line
    names the file either way.
    """

    def __init__(self, message: str) -> None:
        super().__init__(original_message(str(message), type(self)))


def original_message(message: str, cls: type) -> str:
    """``message`` itself, or, for torch's re-raised worker traceback, its last line without the
    exception's qualified name."""
    if "Original Traceback" not in message:
        return message
    prefix = f"{cls.__module__}.{cls.__qualname__}: "
    lines = [line for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(prefix):
            return line[len(prefix) :]
    return message


class SkippedSamples:
    """The samples replaced under ``data.on_bad_sample=skip``, shared with DataLoader workers.

    Calling it gives how many sample loads were replaced so far, by this process and by its loader
    workers (counted when loaded, so prefetched batches are included). It lives in shared memory
    created with the data set, before any worker starts: forked workers inherit it, spawned ones
    receive it with the data set. It also remembers which indices are known bad, so each bad file
    is logged once per run and not decoded again.
    """

    def __init__(self, size: int) -> None:
        context = multiprocessing.get_context()
        self._count = context.Value("q", 0)
        # Guarded by the count's lock for writes; a racing read at worst decodes a file again.
        self._bad = context.RawArray("b", size)

    def __call__(self) -> int:
        return int(self._count.value)

    def is_bad(self, index: int) -> bool:
        return bool(self._bad[index])

    def mark_bad(self, index: int) -> bool:
        """Remember ``index`` as undecodable; True the first time it is marked in this run."""
        with self._count.get_lock():
            first = not self._bad[index]
            self._bad[index] = 1
        return first

    def add(self) -> None:
        with self._count.get_lock():
            self._count.value += 1


T = TypeVar("T")


def first_loadable(
    index: int,
    size: int,
    load: Callable[[int], T | None],
    skipped: SkippedSamples | None,
    *,
    none_loads: str,
) -> T:
    """``load(index)``; where it gives None (a bad sample under ``data.on_bad_sample=skip``), the
    first of ``index + 1, index + 2, ...`` (wrapping around) that loads, counted in ``skipped``.
    The same replacement every time, so resuming stays exact. ``none_loads``: the message when
    no sample of the ``size`` loads."""
    start = range(size)[int(index)]  # IndexError out of range, like ImageFolder
    for offset in range(size):
        loaded = load((start + offset) % size)
        if loaded is None:
            continue
        if offset and skipped is not None:
            skipped.add()
        return loaded
    raise BadSampleError(f"data: {none_loads} (data.on_bad_sample=skip)")


def failure_reason(err: BaseException, path: str) -> str:
    """``Type: message``; PIL's "cannot identify image file <_io.BufferedReader name=...>" loses
    the file object's repr, as the path is in the message already."""
    text = str(err).replace(f"<_io.BufferedReader name={path!r}>", "").strip()
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
