"""``python -m sdnet_trainer.export checkpoint=... format=...``."""

import sys

from sdnet_trainer.export import main
from sdnet_trainer.lazy import freeze_imports

if __name__ == "__main__":
    freeze_imports()  # a process of its own: see sdnet_trainer/lazy.py
    sys.exit(main())
