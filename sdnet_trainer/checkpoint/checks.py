"""``checkpoint.*``, checked before launch (sdnet_trainer.preflight calls it), as the rest of the
folder reads those keys: the save periods, how many checkpoints pruning keeps, a resume setting,
an object store's URL and options."""

from __future__ import annotations

from sdnet_trainer.checkpoint.objects import check_url, is_url
from sdnet_trainer.config.checks import check_positive
from sdnet_trainer.config.schema import Config
from sdnet_trainer.errors import ConfigError


def validate_checkpoint(cfg: Config) -> None:
    """Raise ConfigError naming the first ``checkpoint.*`` key that is out of range."""
    ckpt = cfg.checkpoint
    check_positive("checkpoint.every_n_steps", ckpt.every_n_steps, allow_none=True)
    check_positive("checkpoint.every_n_minutes", ckpt.every_n_minutes, allow_none=True)
    check_positive("checkpoint.keep_last", ckpt.keep_last)
    if not ckpt.resume:
        raise ConfigError("checkpoint.resume must be auto, none or a checkpoint path")
    # An object store: its library installed, no credentials among its options.
    for key, value in (("checkpoint.dir", ckpt.dir), ("checkpoint.resume", ckpt.resume)):
        if value is not None and is_url(value):
            check_url(key, value, dict(ckpt.storage_options))
