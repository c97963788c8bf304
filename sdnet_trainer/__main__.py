"""``python -m sdnet_trainer`` and ``torchrun -m sdnet_trainer``."""

from sdnet_trainer.cli import main

if __name__ == "__main__":
    main()
