"""Image classifiers: an uploaded PNG/JPEG (or a ready tensor) in, the top classes out.

An image goes through the evaluation transform of the data the model was trained on, so the
server sees what the validation loop saw. A ready tensor skips the transform and must have the
model's input shape: the way to serve models whose inputs are not image files (``data=synthetic``
with other than 3 channels, a subclass's own data).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from torchvision.datasets.folder import find_classes

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.augment import CIFAR10_MEAN, CIFAR10_STD
from sdnet_trainer.data.transforms import build_transforms
from sdnet_trainer.serve.errors import InputError, first_line

logger = logging.getLogger(__name__)

# What POST /v1/predict decodes; anything else is 415.
IMAGE_FORMATS = ("PNG", "JPEG")
_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")
# torchvision's CIFAR10.classes, in label order (not imported: that class reads files).
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
_CLASSES_JSON_MAX_BYTES = 1 << 20

Runner = Callable[[torch.Tensor], torch.Tensor]


def eval_transform(data: DataConfig) -> Callable[[Image.Image], torch.Tensor] | None:
    """The validation transform of ``data``'s image files (the data layer's
    :func:`~sdnet_trainer.data.augment.build_transforms`: ``data.augment``'s preset and sizes,
    normalized with CIFAR-10's statistics for data=cifar10 and ImageNet's otherwise), from a PIL
    image to the model's input; None where the data are not RGB images (only ready tensors are
    served then). data=synthetic has no image files: an image sent to a model trained on it gets
    the transform its config describes, like any other image data."""
    if data.channels != 3:
        return None
    if data.name == "cifar10":
        _, val = build_transforms(data, mean=CIFAR10_MEAN, std=CIFAR10_STD)
    else:
        _, val = build_transforms(data)
    return val


def class_names(data: DataConfig, count: int) -> list[str]:
    """The names of the model's ``count`` classes, in label order: CIFAR-10's, the class folders of
    a local ``data=imagefolder`` root, or the ``classes.json`` of local ``data=shards``; else the
    label numbers as text. Only a local data.root is read, and only for these names."""
    names = _known_names(data)
    if names is not None and len(names) != count:
        logger.warning(
            "the data's %d class names do not fit the model's %d outputs; labels are numbers",
            len(names),
            count,
        )
        names = None
    return list(names) if names is not None else [str(i) for i in range(count)]


def _known_names(data: DataConfig) -> Sequence[str] | None:
    if data.name == "cifar10":
        return CIFAR10_CLASSES
    root = data.root
    if not root or "://" in root:
        return None
    path = Path(root).expanduser()
    try:
        if data.name == "imagefolder" and (path / "train").is_dir():
            classes, _ = find_classes(str(path / "train"))
            return classes
        if data.name == "shards" and path.is_dir():
            return _classes_json(path / "classes.json")
    except (OSError, ValueError) as err:
        logger.warning("cannot read the class names under data.root=%s: %s", root, err)
    return None


def _classes_json(path: Path) -> list[str] | None:
    """The ``{"classes": [...]}`` file the shard converter writes, read as data."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as file:
        raw = file.read(_CLASSES_JSON_MAX_BYTES + 1)
    classes = json.loads(raw).get("classes") if len(raw) <= _CLASSES_JSON_MAX_BYTES else None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ValueError(f'{path} has no "classes" list of names')
    return classes


def decode_image(data: bytes, *, max_pixels: int, mode: str = "RGB") -> Image.Image:
    """The PNG or JPEG file ``data`` as a PIL image of ``mode``. Refused without decoding: an
    empty body, another format (415), more than ``max_pixels`` pixels (413); a file that does not
    decode (truncated, corrupt) is 400."""
    if not data:
        raise InputError(400, "image: the file is empty")
    try:
        with warnings.catch_warnings():
            # PIL only warns between its own limit and twice that; here both are refusals.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
            width, height = image.size
            if width * height > max_pixels:
                raise InputError(
                    413,
                    f"image: {width}x{height} pixels is more than the server takes "
                    f"(max_image_pixels={max_pixels})",
                )
            image.load()
            return image.convert(mode)
    except InputError:
        raise
    except UnidentifiedImageError:
        if data.startswith(_MAGIC):  # the start of one, cut short or corrupt after it
            raise InputError(400, "image: cannot decode the file (truncated or corrupt)") from None
        raise InputError(415, "image: not a PNG or JPEG file") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise InputError(413, f"image: {first_line(err)}") from None
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ... for bad files
        raise InputError(400, f"image: cannot decode the file ({first_line(err)})") from None


class ImageModel:
    """A classifier: requests become input tensors (:meth:`from_image`, :meth:`from_tensor`), a
    batch of them becomes class probabilities (:meth:`run`), probabilities become the top classes
    (:meth:`top`)."""

    kind = "image"

    def __init__(
        self,
        runner: Runner,
        *,
        input_shape: tuple[int, ...],
        classes: list[str],
        transform: Callable[[Image.Image], torch.Tensor] | None,
        max_pixels: int,
        top_k: int,
    ) -> None:
        self.runner = runner
        self.input_shape = input_shape
        self.classes = classes
        self.transform = transform
        self.max_pixels = max_pixels
        self.top_k = top_k

    def from_image(self, data: bytes) -> torch.Tensor:
        if self.transform is None:
            raise InputError(
                415,
                f"this model takes tensors of shape {list(self.input_shape)}, not image files: "
                f'send {{"tensor": [...]}}',
            )
        image = decode_image(data, max_pixels=self.max_pixels)
        try:
            tensor = self.transform(image)
        except Exception as err:  # the transform of an image that decoded: still its content
            raise InputError(422, f"image: cannot preprocess ({first_line(err)})") from None
        if tuple(tensor.shape) != self.input_shape:
            raise InputError(
                422,
                f"image: preprocessing gives shape {list(tensor.shape)}, the model takes "
                f"{list(self.input_shape)}",
            )
        return tensor

    def from_tensor(self, values: Any) -> torch.Tensor:
        try:
            tensor = torch.tensor(values, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise InputError(
                422, "tensor: not a rectangular array of numbers (nested lists, channels first)"
            ) from None
        if tuple(tensor.shape) != self.input_shape:
            raise InputError(
                422,
                f"tensor: shape {list(tensor.shape)}, the model takes {list(self.input_shape)} "
                f"(channels, height, width)",
            )
        if not bool(torch.isfinite(tensor).all()):
            raise InputError(422, "tensor: holds values that are not finite numbers")
        return tensor

    def run(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        """Class probabilities for each input, in order (one forward pass for the batch)."""
        logits = self.runner(torch.stack(batch))
        return list(torch.softmax(logits.float(), dim=-1))

    def top(self, probs: torch.Tensor, k: int | None) -> list[dict[str, Any]]:
        count = min(k or self.top_k, len(self.classes))
        values, indices = probs.topk(count)
        return [
            {"index": int(i), "label": self.classes[int(i)], "probability": float(p)}
            for p, i in zip(values.tolist(), indices.tolist())
            if math.isfinite(p)
        ]

    def info(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "input_shape": list(self.input_shape),
            "accepts_images": self.transform is not None,
            "classes": self.classes,
        }
