"""The converter's command line: ``python -m sdnet_trainer.data.shards SRC OUT [shard_size=N]``
(run by ``__main__.py``; here so that importing the package does not import ``__main__``)."""

from __future__ import annotations

import json
import sys

from sdnet_trainer.data.shards.write import DEFAULT_SHARD_SIZE, convert
from sdnet_trainer.errors import ConfigError

USAGE = "usage: python -m sdnet_trainer.data.shards [-h] SRC OUT [shard_size=N]"

HELP = f"""{USAGE}

Write SRC's train/ and val/ as tar shards under OUT: an ImageFolder (class folders of images;
the class names go to OUT/classes.json), or folders of .txt files (one text member per file).
The shards are OUT/train/train-000000.tar, ... and OUT/val/..., each with its index
(.idx.json); they keep the folder's sample order, and a re-run skips the shards already written
from the same files. Prints a JSON report of what it wrote and skipped.

arguments:
  SRC           the folder to convert (with train/ and val/)
  OUT           the folder to write the shards to
  shard_size=N  samples per shard (default {DEFAULT_SHARD_SIZE})
  -h, --help    show this message and exit
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(HELP, end="")
        return 0
    positional = [a for a in args if "=" not in a and not a.startswith("-")]
    options = dict(a.split("=", 1) for a in args if "=" in a)
    unknown = sorted(set(options) - {"shard_size"}) + [
        a for a in args if "=" not in a and a.startswith("-")
    ]
    if len(positional) != 2 or unknown:
        extra = f" (unknown: {', '.join(unknown)})" if unknown else ""
        print(f"{USAGE}{extra}", file=sys.stderr)
        return 2
    try:
        shard_size = int(options.get("shard_size", DEFAULT_SHARD_SIZE))
    except ValueError:
        print(f"error: shard_size={options['shard_size']!r} is not an integer", file=sys.stderr)
        return 2
    try:
        report = convert(positional[0], positional[1], shard_size=shard_size)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0
