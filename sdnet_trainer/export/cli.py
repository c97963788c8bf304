"""``python -m sdnet_trainer.export key=value ...``: the command (its help is the package's
docstring, ``export/__init__.py``)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import sdnet_trainer.export as package
from sdnet_trainer.checkpoint.objects import ObjectFolder
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export import EXIT_BAD_INPUT, EXIT_EXPORT_FAILED, ExportError, export, parse_args


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sdnet_trainer.export key=value ...``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(package.__doc__)
        return 0
    if not logging.getLogger().handlers:
        # This package's progress at INFO; the exporters' own INFO chatter (graph passes) stays out.
        logging.basicConfig(level=logging.WARNING, format="[%(name)s][%(levelname)s] %(message)s")
        logging.getLogger("sdnet_trainer").setLevel(logging.INFO)
    try:
        result = export(parse_args(argv))
    except ConfigError as err:
        print(f"export error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ExportError as err:
        print(f"export failed: {err}", file=sys.stderr)
        return EXIT_EXPORT_FAILED
    uploaded = result.out.listing()[0] if isinstance(result.out, ObjectFolder) else {}
    for path in result.files:
        size = uploaded[path.name] if isinstance(path, ObjectFolder) else path.stat().st_size
        print(f"wrote {path} ({size / 2**20:.2f} MB)")
    for fmt, diff in result.max_abs_diff.items():
        print(f"{fmt}: outputs match PyTorch, max abs difference {diff:.3g}")
    return 0
