"""``python -m sdnet_trainer.export checkpoint=... format=...``."""

import sys

from sdnet_trainer.export import main

if __name__ == "__main__":
    sys.exit(main())
