"""JPEG files decoded on the training device (``data.decode=cuda``).

The loader only reads each file (:func:`read_jpeg`) and draws its crop and flip from the file's
size (:class:`JpegCrop`); batches stay lists of encoded files (:func:`collate_encoded`). The
device decodes them with nvjpeg, crops, resizes, flips and normalizes (:class:`DeviceDecoder`).
:class:`~sdnet_trainer.data.folders.EncodedJpegFolder` is the class folder tree that yields them.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from PIL import Image
from torchvision import transforms
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as TF

from sdnet_trainer.data.augment import EVAL_CROP_RATIO
from sdnet_trainer.data.bad_samples import BadSampleError
from sdnet_trainer.data.normalize import DeviceNormalize

JPEG_SUFFIXES = (".jpg", ".jpeg")
_JPEG_MAGIC = b"\xff\xd8\xff"


@dataclass
class _JpegFile:
    """A JPEG file read but not decoded: its bytes and its header (size, mode)."""

    data: bytes
    header: Image.Image  # opened lazily by PIL: the pixels are never decoded here
    path: str


@dataclass
class EncodedImage:
    """One sample under ``data.decode=cuda``: the file's bytes and where to crop it."""

    data: torch.Tensor  # uint8 [n]: the JPEG file
    box: tuple[int, int, int, int]  # (top, left, height, width) in the file's pixels
    flip: bool
    path: str


@dataclass
class EncodedImages:
    """A batch of :class:`EncodedImage`; the loader pins it (``pin_memory``) for the copy."""

    data: list[torch.Tensor]
    boxes: list[tuple[int, int, int, int]]
    flips: list[bool]
    paths: list[str]

    def pin_memory(self) -> EncodedImages:
        return EncodedImages(
            [d.pin_memory() for d in self.data], self.boxes, self.flips, self.paths
        )


def collate_encoded(samples: list[tuple[EncodedImage, int]]) -> tuple[EncodedImages, torch.Tensor]:
    """The loader's ``collate_fn`` under ``data.decode=cuda``: files differ in length, so they
    stay a list instead of being stacked."""
    images = [image for image, _ in samples]
    batch = EncodedImages(
        [i.data for i in images], [i.box for i in images], [i.flip for i in images],
        [i.path for i in images],
    )  # fmt: skip
    return batch, torch.tensor([label for _, label in samples], dtype=torch.int64)


def read_jpeg(path: str) -> _JpegFile:
    """The file's bytes and header. What does not parse as a JPEG raises here, in the loader,
    where ``data.on_bad_sample`` handles it like a file PIL cannot decode."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(_JPEG_MAGIC):
        raise ValueError("not a JPEG file (data.decode=cuda decodes JPEG only)")
    header = Image.open(io.BytesIO(data))  # reads the header only
    if header.format not in ("JPEG", "MPO"):  # MPO: a camera's JPEG with extra frames
        raise ValueError(f"a {header.format} file, not JPEG (data.decode=cuda decodes JPEG only)")
    return _JpegFile(data, header, path)


class JpegCrop:
    """The loader's part of the ImageNet recipe under ``data.decode=cuda``: the box of the file's
    pixels that becomes the ``image_size`` square, and whether to flip it, from the file's size
    alone. Train draws a ``RandomResizedCrop`` box and a horizontal flip (probability ``hflip``)
    in the same order as the PIL path, so per-sample seeding keeps them reproducible; val takes
    the center crop of the image resized to ``resize_size`` (default ``image_size / 0.875``) on
    its short side, in the file's pixels."""

    def __init__(
        self,
        image_size: int,
        *,
        train: bool,
        hflip: float = 0.5,
        resize_size: int | None = None,
    ) -> None:
        self.image_size, self.train, self.hflip = image_size, train, hflip
        self.resize_size = resize_size or round(image_size / EVAL_CROP_RATIO)
        self._crop = transforms.RandomResizedCrop(image_size)  # its default scale and ratio

    def box(self, width: int, height: int) -> tuple[tuple[int, int, int, int], bool]:
        """((top, left, height, width), flip) for an image of ``width`` x ``height``."""
        if self.train:
            # get_params reads only the size: an empty tensor of that shape stands in.
            shape = torch.empty(1, 1, 1).expand(1, height, width)
            top, left, h, w = self._crop.get_params(shape, self._crop.scale, self._crop.ratio)
            # As RandomHorizontalFlip, which the PIL path leaves out (no draw) at p = 0.
            flip = self.hflip > 0 and bool(torch.rand(1) < self.hflip)
            return (int(top), int(left), int(h), int(w)), flip
        # Resize(short side -> resize_size) then CenterCrop(size), mapped back.
        side = self.image_size * min(width, height) / self.resize_size
        h, w = min(height, round(side)), min(width, round(side))
        return (round((height - h) / 2), round((width - w) / 2), h, w), False

    def __call__(self, jpeg: _JpegFile) -> EncodedImage:
        width, height = jpeg.header.size
        box, flip = self.box(width, height)
        data = torch.frombuffer(bytearray(jpeg.data), dtype=torch.uint8)
        return EncodedImage(data, box, flip, jpeg.path)


class DeviceDecoder:
    """The device's part under ``data.decode=cuda``: decode a batch of JPEG files with nvjpeg
    (``torchvision.io.decode_jpeg(device="cuda")``), resize each file's box (:class:`JpegCrop`) to
    ``image_size``, flip where drawn, then normalize. Resizing runs on float pixels with
    antialiasing, so the pixels differ slightly from PIL's on the CPU path (the same crops, not
    bit for bit the same data)."""

    def __init__(self, image_size: int, *, normalize: DeviceNormalize) -> None:
        self.image_size, self.normalize = image_size, normalize

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceDecoder) and (self.image_size, self.normalize) == (
            other.image_size,
            other.normalize,
        )

    def __hash__(self) -> int:
        return hash((self.image_size, self.normalize))

    def __call__(
        self,
        batch: EncodedImages,
        device: torch.device,
        *,
        memory_format: torch.memory_format = torch.contiguous_format,
    ) -> torch.Tensor:
        try:
            images = decode_jpeg(batch.data, mode=ImageReadMode.RGB, device=device)
        except RuntimeError as err:
            raise BadSampleError(self._which_failed(batch, device, err)) from err
        size = self.image_size
        out = torch.empty(len(images), 3, size, size, dtype=torch.float32, device=device)
        for i, image in enumerate(images):
            top, left, height, width = batch.boxes[i]
            pixels = TF.resized_crop(image.float(), top, left, height, width, [size, size])
            out[i] = pixels.flip(-1) if batch.flips[i] else pixels
        return self.normalize(out.clamp_(0, 255), memory_format=memory_format)

    @staticmethod
    def _which_failed(batch: EncodedImages, device: torch.device, err: Exception) -> str:
        """The batch failed as a whole: decode its files one by one to name the culprit."""
        for data, path in zip(batch.data, batch.paths):
            try:
                decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
            except RuntimeError as single:
                return (
                    f"data: nvjpeg cannot decode {path} ({single}); fix or remove the file, or "
                    f"set data.decode=cpu (where data.on_bad_sample=skip can replace it)"
                )
        return f"data: nvjpeg failed on a batch of {len(batch.paths)} files ({err})"
