"""Labelled images in tar shards: ``KEY.jpg`` (any image type ImageFolder reads) with ``KEY.cls``
or ``KEY.json``, read with ``data=imagefolder``'s transforms."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from PIL import Image

from sdnet_trainer.data.shards.index import ShardIndex
from sdnet_trainer.data.shards.reading import _BadMember, _ShardSet


class ShardImages(_ShardSet):
    """Labelled images in tar shards (see :mod:`sdnet_trainer.data.shards`), sample ``i`` being
    the ``i``-th entry of the shards' indexes in shard order.

    ``on_bad_sample`` works as for :class:`~sdnet_trainer.data.folders.CheckedImageFolder`:
    ``error`` raises :class:`BadSampleError` naming the shard and the key, ``skip`` loads the
    first of ``i+1, i+2, ...`` that can be read and decoded in place of ``i`` (the same one every
    time), logs each bad member once and counts the replaced loads in :attr:`skipped`.
    """

    def __init__(
        self,
        shards: Sequence[ShardIndex],
        *,
        transform: Any = None,
        on_bad_sample: str = "error",
        classes: list[str] | None = None,
        shard_bytes: Sequence[int] | None = None,
    ) -> None:
        super().__init__(shards, on_bad_sample=on_bad_sample, shard_bytes=shard_bytes)
        self.transform = transform
        self.target_transform = None
        self.targets = [label for s in shards for label in s.labels]
        self.classes = classes
        # What the data says of its class count: the class names when the converter recorded
        # them, else the largest label + 1 (a set data.num_classes replaces it, see build_shards).
        self.num_classes: int | None = (
            len(classes) if classes is not None else max(self.targets, default=-1) + 1 or None
        )
        self.skipped = self._skip_counter()

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"ShardImages(shards={len(self.urls)}, samples={len(self)})"

    def where(self, index: int) -> str:
        """``KEY.EXT in shard URL``: how messages name sample ``index``."""
        return f"{self.keys[index]} in shard {self.urls[int(self._shard[index])]}"

    def read(self, index: int) -> bytes:
        """The image bytes of sample ``index``, checked against their tar header."""
        number, key, offset, size = self._entry(index)
        return self._member(number, key, offset, size, header=True)

    def decode(self, data: bytes) -> Image.Image:
        # As torchvision's pil_loader: the same pixels as an ImageFolder of the same files.
        return Image.open(io.BytesIO(data)).convert("RGB")

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        sample, target = self._first_loadable(index, self._load)
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, target

    def _load(self, index: int) -> tuple[Image.Image, int] | None:
        skipped = self.skipped
        if skipped is not None and skipped.is_bad(index):
            return None
        # Only what the shard holds is a bad sample; an I/O failure (network, permissions) from
        # read() is not, and propagates rather than being skipped.
        cause: Exception
        try:
            data = self.read(index)
        except _BadMember as err:
            verb, reason, cause = "read", str(err), err
        else:
            try:
                return self.decode(data), self.targets[index]
            except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ...
                verb, reason, cause = "decode", f"{type(err).__name__}: {err}", err
        self._bad(index, self.where(index), verb, reason, cause)
        return None
