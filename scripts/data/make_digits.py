"""Write scikit-learn's handwritten digits as an ImageFolder: real images to try the trainer on,
with nothing to download.

The data
    ``sklearn.datasets.load_digits``: 1,797 scanned 8x8 grayscale digits (0-16 intensity) in
    10 classes, shipped inside the scikit-learn package (the UCI "Optical Recognition of
    Handwritten Digits" test set).

What it writes
    OUT/train/<class>/<index>.png and OUT/val/<class>/<index>.png, classes ``0`` ... ``9``,
    ``<index>`` the sample's row in ``load_digits`` (four digits). Fixed split: every 5th row
    (index % 5 == 0) goes to val, 360 images; the other 1,437 to train. Each image is scaled to
    0-255 (value * 255 / 16, rounded), upscaled to --size x --size (nearest: the sharp pixel
    blocks of the scan; bilinear: smoothed) and stored as 3-channel RGB PNG, so the stock
    models and the ImageNet normalisation take it as they are. PNG is lossless: the pixels a
    loader decodes are exactly these, from a folder, from shards made of it, or from any copy.

    The same arguments write the same bytes. An OUT that already holds files is refused (they
    would mix into the class folders).

Run (from the repository root)
    python scripts/data/make_digits.py /tmp/digits                    # 32 x 32, nearest
    python scripts/data/make_digits.py /tmp/digits --size 64 --resample bilinear
    torchrun --standalone --nproc_per_node=2 -m sdnet_trainer dist.device=cpu model=simple_cnn \\
        data=imagefolder data.root=/tmp/digits data.image_size=32 data.augment.preset=none \\
        optim=sgd optim.lr=0.1 sched=cosine loop.global_batch_size=64 loop.max_steps=200
    (about 83% validation top-1 after 200 steps, under a minute on 2 CPU cores)

Exit status 0 with a one-line JSON summary printed; 2 with one error line for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

# Every VAL_EVERY-th row of load_digits is a validation image.
VAL_EVERY = 5
# load_digits' pixel intensities run from 0 to MAX_INTENSITY.
MAX_INTENSITY = 16
RESAMPLE = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR}


def split_of(index: int) -> str:
    """The split row ``index`` of ``load_digits`` belongs to."""
    return "val" if index % VAL_EVERY == 0 else "train"


def write_digits(out: Path, *, size: int = 32, resample: str = "nearest") -> dict[str, int]:
    """Write the ImageFolder under ``out``; returns the image count per split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.rint(digits.images * (255 / MAX_INTENSITY)).astype(np.uint8)  # [N, 8, 8]
    counts = {"train": 0, "val": 0}
    for index, (pixels, label) in enumerate(zip(images, digits.target)):
        split = split_of(index)
        gray = Image.fromarray(pixels).resize((size, size), RESAMPLE[resample])  # mode L
        path = out / split / str(int(label)) / f"{index:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        gray.convert("RGB").save(path, format="PNG")
        counts[split] += 1
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="folder to write (created; must be empty)")
    parser.add_argument("--size", type=int, default=32, help="side of the square images in px")
    parser.add_argument("--resample", choices=sorted(RESAMPLE), default="nearest")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 8 <= args.size <= 1024:
        print(f"error: --size={args.size} must be between 8 and 1024", file=sys.stderr)
        return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"error: {args.out} exists and is not a folder", file=sys.stderr)
        return 2
    if args.out.is_dir() and any(args.out.iterdir()):
        print(f"error: {args.out} is not empty; give a new or empty folder", file=sys.stderr)
        return 2
    try:
        import sklearn  # noqa: F401  # the data ships inside it
    except ImportError:
        print("error: the digits come with scikit-learn: pip install scikit-learn", file=sys.stderr)
        return 2
    counts = write_digits(args.out, size=args.size, resample=args.resample)
    print(json.dumps({"out": str(args.out), "classes": 10, "size": args.size, **counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
