"""Normalization on the training device: images cross to it as uint8 and become float there.

On CUDA the loader hands images to the device as uint8 and they are converted to float and
normalized there (:class:`DeviceNormalize`): a quarter of the bytes to copy, and the per-pixel
float work off the loader's cores. :func:`deferrable_tail` splits a transform into its uint8 half
and the device half; :func:`defer_normalization` applies it to the data sets built from files.

Every run's loader imports this module, so it imports torchvision only where an image data set is
at hand, which has imported it already (see :mod:`~sdnet_trainer.lazy`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from sdnet_trainer.lazy import loaded_types


class DeviceNormalize:
    """The end of the float path (uint8 to float in [0, 1], then ``Normalize``) for a batch that
    arrives as uint8 [B, C, H, W] on the training device: the same operations in the same order,
    so on the CPU the result equals the float path's bit for bit. The float conversion is v2's
    ``ToDtype(float32, scale=True)`` (``x * (1 / 255)``), or with ``divide`` the older
    ``ToTensor``'s (``x / 255``): the two differ in the last bit for some values.

    ``memory_format`` is the layout of the float result (``torch.channels_last`` for
    ``model.channels_last``); the values do not depend on it.
    """

    def __init__(
        self, mean: Sequence[float], std: Sequence[float], *, divide: bool = False
    ) -> None:
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.divide = divide
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _key(self) -> tuple[Any, ...]:
        return self.mean, self.std, self.divide

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceNormalize) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"DeviceNormalize(mean={self.mean}, std={self.std}, divide={self.divide})"

    def __getstate__(self) -> dict[str, Any]:
        # Loader workers started by spawn receive data sets pickled, this with them: device
        # tensors must not travel (a worker would initialise CUDA).
        return {**self.__dict__, "_stats": {}}

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        stats = self._stats.get(device)
        if stats is None:  # copied to the device once, not per batch
            mean = torch.tensor(self.mean, dtype=torch.float32, device=device).view(-1, 1, 1)
            std = torch.tensor(self.std, dtype=torch.float32, device=device).view(-1, 1, 1)
            stats = self._stats[device] = (mean, std)
        return stats

    def __call__(
        self, images: torch.Tensor, *, memory_format: torch.memory_format = torch.contiguous_format
    ) -> torch.Tensor:
        mean, std = self._on(images.device)
        # uint8, or already float in [0, 255] (resized on the device): a new float tensor.
        out = images.to(torch.float32, memory_format=memory_format, copy=True)
        out = out.div_(255) if self.divide else out.mul_(1.0 / 255)  # as ToTensor / ToDtype
        return out.sub_(mean).div_(std)  # as Normalize


def defer_normalization(dataset: Dataset) -> tuple[Dataset, DeviceNormalize] | None:
    """``dataset`` delivering uint8 tensors, and what turns them into its float images on the
    device; None where ``dataset`` is not an image folder or CIFAR-10 data set
    (:mod:`~sdnet_trainer.data.folders`, :mod:`~sdnet_trainer.data.cifar`) or its transform does
    not end in one of the tails that :func:`deferrable_tail` knows. A transform with anything after
    ``Normalize`` (``data.augment.random_erase``: erasing fills with 0, the mean colour, in
    normalized units) is not deferred: the loader then hands over float images.

    The result is a shallow copy with its own transform (files, labels and the skip counter are
    shared): the original keeps producing float images for whoever else reads it (the FLOPs
    count, export).
    """
    # Checked without importing them: other data (synthetic, tokens) never loads torchvision.
    image_sets = loaded_types("sdnet_trainer.data.folders", "CheckedImageFolder")
    image_sets += loaded_types("torchvision.datasets", "CIFAR10")
    if not isinstance(dataset, image_sets):
        return None
    tail = deferrable_tail(dataset.transform)
    if tail is None:
        return None
    # An image data set is at hand, so torchvision is imported already.
    from torchvision.datasets.vision import StandardTransform

    uint8_transform, device_half = tail
    uint8 = copy.copy(dataset)
    uint8.transform = uint8_transform
    uint8.transforms = StandardTransform(uint8.transform, uint8.target_transform)
    return uint8, device_half


def deferrable_tail(transform: Any) -> tuple[Any, DeviceNormalize] | None:
    """(the transform up to uint8 tensors, the device half) of a transform that ends in one of
    the tails the device takes over: v2's PILToTensor | ToImage -> ToDtype(float32, scale=True) ->
    Normalize (data.augment's pipelines), or the older ToTensor -> Normalize (a transform of one's
    own); None for any other."""
    # Called with an image data set's transform: torchvision is imported already.
    from torchvision import transforms
    from torchvision.transforms import v2

    if isinstance(transform, v2.Compose) and len(transform.transforms) >= 3:
        *head, to_uint8, to_float, normalize = transform.transforms
        if (
            type(to_uint8) in (v2.PILToTensor, v2.ToImage)
            and type(to_float) is v2.ToDtype
            and to_float.dtype == torch.float32
            and to_float.scale
            and type(normalize) is v2.Normalize
        ):
            device_half = DeviceNormalize(normalize.mean, normalize.std)
            return v2.Compose([*head, to_uint8]), device_half
    if isinstance(transform, transforms.Compose) and len(transform.transforms) >= 2:
        *head, to_tensor, normalize = transform.transforms
        if type(to_tensor) is transforms.ToTensor and type(normalize) is transforms.Normalize:
            device_half = DeviceNormalize(normalize.mean, normalize.std, divide=True)
            # PILToTensor: the pixels as uint8 [C, H, W], without ToTensor's float conversion.
            return transforms.Compose([*head, transforms.PILToTensor()]), device_half
    return None
