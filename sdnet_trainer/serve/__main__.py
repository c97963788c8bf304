"""``python -m sdnet_trainer.serve key=value ...``: the command is ``serve/cli.py``."""

import sys

from sdnet_trainer.lazy import freeze_imports
from sdnet_trainer.serve.cli import main

if __name__ == "__main__":
    freeze_imports()  # a process of its own: see sdnet_trainer/lazy.py
    sys.exit(main())
