"""Images per second one CPU core loads for each input path of ``data.name=imagefolder``.

What it measures
    One process, one thread (``torch.set_num_threads(1)``, no loader workers): what one loader
    worker delivers, so ``cores needed per GPU = GPU img/s / img/s per core``. Training
    transforms (RandomResizedCrop 224 + flip), batches of 32 through a DataLoader (collate
    included), per path:

    float   PIL decode, crop, ToTensor + Normalize in the loader (the CPU device's path)
    uint8   PIL decode, crop, PILToTensor; float conversion and normalization on the device
            (the CUDA default, data.decode=cpu)
    encoded read the file and its header, draw the crop box; decode on the GPU with nvjpeg
            (data.decode=cuda)

    The images are generated: --images JPEGs of 500x375 (about ImageNet's mean size), smooth
    colour fields plus noise, quality 90.

    The per-core figure divides by the process's CPU time (``time.process_time``), not wall
    time, so it holds on a machine shared with other work; the wall-clock rate is printed
    beside it (equal on an idle machine).

Run (from the repository root; about a minute)
    OMP_NUM_THREADS=1 python scripts/bench/bench_loader.py
    OMP_NUM_THREADS=1 python scripts/bench/bench_loader.py --images 512 --repeats 3 --gpu-img-s 3000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from sdnet_trainer.data.folders import (
    CheckedImageFolder,
    EncodedJpegFolder,
    imagenet_transforms,
)
from sdnet_trainer.data.jpeg import collate_encoded
from sdnet_trainer.data.normalize import defer_normalization


def write_images(root: Path, count: int, *, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    folder = root / "train" / "a"
    folder.mkdir(parents=True)
    for i in range(count):
        coarse = rng.uniform(0, 255, size=(6, 8, 3)).astype(np.uint8)
        field = np.asarray(
            Image.fromarray(coarse).resize((500, 375), Image.Resampling.BICUBIC), np.float32
        )
        pixels = np.clip(field + rng.normal(0, 12, field.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:05d}.jpg", quality=90)


def rate(dataset: Dataset, *, repeats: int, collate=None) -> tuple[float, float]:
    """Best of ``repeats`` passes: images per CPU second and per wall-clock second."""
    cpu, wall = float("inf"), float("inf")
    for _ in range(repeats):
        loader = DataLoader(dataset, batch_size=32, num_workers=0, collate_fn=collate)
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        for _batch in loader:
            pass
        cpu = min(cpu, time.process_time() - cpu_started)
        wall = min(wall, time.perf_counter() - wall_started)
    count = len(dataset)  # type: ignore[arg-type]
    return count / cpu, count / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument(
        "--gpu-img-s", type=float, default=3000.0, help="the GPU's training rate to size for"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_images(root, args.images)
        train_tf, _ = imagenet_transforms(args.image_size)
        floats = CheckedImageFolder(str(root / "train"), transform=train_tf)
        deferred = defer_normalization(floats)
        assert deferred is not None
        encoded = EncodedJpegFolder(str(root / "train"), image_size=args.image_size, train=True)
        rows = [
            ("float", rate(floats, repeats=args.repeats)),
            ("uint8", rate(deferred[0], repeats=args.repeats)),
            ("encoded", rate(encoded, repeats=args.repeats, collate=collate_encoded)),
        ]
    target = f"cores per GPU at {args.gpu_img_s:.0f}"
    print(f"{'path':<8} {'img/s/core':>10} {'wall img/s':>10} {target:>22}")
    for name, (per_core, wall) in rows:
        print(f"{name:<8} {per_core:>10.0f} {wall:>10.0f} {args.gpu_img_s / per_core:>22.1f}")


if __name__ == "__main__":
    main()
