"""``python -m sdnet_trainer.data.shards SRC OUT [shard_size=N]``: see :mod:`.cli`."""

import sys

from sdnet_trainer.data.shards.cli import main
from sdnet_trainer.lazy import freeze_imports

if __name__ == "__main__":
    freeze_imports()  # a process of its own: see sdnet_trainer/lazy.py
    sys.exit(main())
