"""``python -m sdnet_trainer.data.shards SRC OUT [shard_size=N]``: see :mod:`.cli`."""

import sys

from sdnet_trainer.data.shards.cli import main

if __name__ == "__main__":
    sys.exit(main())
