"""``python -m sdnet_trainer.export key=value ...``: the command is ``export/cli.py``."""

import sys

from sdnet_trainer.export.cli import main
from sdnet_trainer.lazy import freeze_imports

if __name__ == "__main__":
    freeze_imports()  # a process of its own: see sdnet_trainer/lazy.py
    sys.exit(main())
