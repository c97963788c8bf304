"""Text in tar shards: the ``KEY.txt`` members of a shard set read as byte-level language-model
windows, as ``data=text`` reads a folder of ``.txt`` files."""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Sequence

import torch

from sdnet_trainer.data.shards.index import _BLOCK, ShardIndex
from sdnet_trainer.data.shards.reading import _BadMember, _check_header, _ShardSet
from sdnet_trainer.data.windows import window_start
from sdnet_trainer.errors import ConfigError


class ShardText(_ShardSet):
    """Byte-level language-model windows over text shards: the ``.txt`` members of all shards,
    in index order, concatenated, then cut as :class:`~sdnet_trainer.data.tokens.TextBytes` cuts
    a text file (windows of ``seq_len + 1`` bytes at stride ``seq_len``), so the windows equal
    ``data=text``'s over the same bytes. A window is read with a range read per member it spans;
    a member's tar header is checked against the index the first time a process reads it.

    A window that cannot be read (a truncated shard) follows ``on_bad_sample``; under skip the
    next readable window takes its place.

    With ``random`` each window starts at a random byte instead, as many windows per epoch
    (data/windows.py); under skip the replacement is the next index's window, drawn next from
    the same per-sample seeding, so it too depends on (seed, epoch, index) only.
    """

    draws_random = False  # each sample is a pure function of its index

    def __init__(
        self,
        shards: Sequence[ShardIndex],
        *,
        seq_len: int,
        on_bad_sample: str = "error",
        shard_bytes: Sequence[int] | None = None,
        random: bool = False,
    ) -> None:
        super().__init__(shards, on_bad_sample=on_bad_sample, shard_bytes=shard_bytes)
        if seq_len < 1:
            raise ConfigError(f"data.seq_len={seq_len} must be >= 1")
        self.seq_len = seq_len
        # Where each member starts in the concatenated text.
        self._starts = list(itertools.accumulate(self._size.tolist(), initial=0))
        self.total_bytes = self._starts[-1]
        self.size = max(0, (self.total_bytes - 1) // seq_len)
        # Random starts draw from the generator the loader seeds per sample (data/seeding.py).
        self.draws_random = random
        self.skipped = self._skip_counter()
        self._verified: tuple[int, set[int]] = (os.getpid(), set())

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        windows = ", random windows" if self.draws_random else ""
        return (
            f"ShardText(shards={len(self.urls)}, bytes={self.total_bytes}, "
            f"seq_len={self.seq_len}, samples={self.size}{windows})"
        )

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self._first_loadable(index, self._load)
        return window[:-1], window[1:]

    def window(self, index: int) -> bytes:
        """The ``seq_len + 1`` bytes of the stride window ``index``."""
        return self._read(index * self.seq_len)

    def _read(self, start: int) -> bytes:
        """The ``seq_len + 1`` bytes from ``start`` of the concatenated text."""
        end = start + self.seq_len + 1
        pid, verified = self._verified
        if pid != os.getpid():
            verified = set()
            self._verified = (os.getpid(), verified)
        out = bytearray()
        member = bisect.bisect_right(self._starts, start) - 1
        while len(out) < end - start:
            number, key, offset, size = self._entry(member)
            begin = self._starts[member]
            lo, hi = max(start, begin) - begin, min(end, begin + size) - begin
            try:
                if member not in verified:
                    # First read of this member in this process: check its header too.
                    block = self._member(number, key, offset - _BLOCK, _BLOCK, header=False)
                    _check_header(block, name=key, size=size)
                    verified.add(member)
                out += self._member(number, key, offset + lo, hi - lo, header=False)
            except _BadMember as err:
                raise _BadMember(f"{key} in shard {self.urls[number]}: {err}") from err
            member += 1
        return bytes(out)

    def _load(self, index: int) -> torch.Tensor | None:
        skipped = self.skipped
        # A random window moves every epoch: that its index once hit a bad member says nothing.
        if skipped is not None and not self.draws_random and skipped.is_bad(index):
            return None
        start = window_start(
            index, seq_len=self.seq_len, tokens=self.total_bytes, random=self.draws_random
        )
        try:
            data = self._read(start)
        except _BadMember as err:
            where = f"text window {index}" + (f" (from byte {start})" if self.draws_random else "")
            self._bad(index, where, "read", str(err), err)
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
