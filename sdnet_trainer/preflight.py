"""Whole-config validation before launch: every component's own checks, run in one place.

Runs before any process group exists, on every rank, so a bad launch stops everywhere with the
same message. Each message names the keys and the numbers involved. The rules live beside the
component they concern; this module only decides the order: the batch split and the run's length
first, then data and training options, then the parallel layout and the model's fit to it, then the
devices, and the bookkeeping options last.
"""

from __future__ import annotations

from sdnet_trainer.checkpoint import validate_checkpoint
from sdnet_trainer.checkpoint.objects import is_url
from sdnet_trainer.config.paths import check_creatable_folder, is_local_path, local_path
from sdnet_trainer.config.schema import Config, names_stock_trainer
from sdnet_trainer.data import validate_data
from sdnet_trainer.distributed.batching import validate_batch
from sdnet_trainer.distributed.comm_hooks import validate_comm
from sdnet_trainer.distributed.context_parallel import validate_context_parallel
from sdnet_trainer.distributed.env import validate_dist
from sdnet_trainer.distributed.expert_parallel import validate_expert_parallel
from sdnet_trainer.distributed.float8 import validate_float8
from sdnet_trainer.distributed.mesh import parallel_dims
from sdnet_trainer.distributed.parallelize import validate_compile, validate_parallel
from sdnet_trainer.distributed.pipeline import validate_pipeline
from sdnet_trainer.ft.checks import validate_ft
from sdnet_trainer.models.build import build_model
from sdnet_trainer.models.lora import validate_lora
from sdnet_trainer.models.registry import model_family
from sdnet_trainer.observability.logs import validate_logging
from sdnet_trainer.observability.prometheus import validate_prometheus
from sdnet_trainer.observability.writers import validate_trackers
from sdnet_trainer.runtime.precision import validate_precision
from sdnet_trainer.training.ema import validate_ema
from sdnet_trainer.training.health import validate_health
from sdnet_trainer.training.optim import validate_optim
from sdnet_trainer.training.state import validate_loop


def validate(cfg: Config, *, world_size: int) -> None:
    """Raise ConfigError on the first rule the config breaks."""
    validate_batch(cfg, world_size)
    validate_loop(cfg)
    validate_data(cfg)
    validate_optim(cfg)
    validate_ema(cfg)
    validate_precision(cfg)
    validate_float8(cfg)
    validate_parallel(cfg, world_size)
    dims = parallel_dims(cfg.parallel, world_size)
    family = model_family(cfg.model.name)
    if family is not None and family.validate is not None:  # model.* against data and layout
        family.validate(cfg, tp=dims.tp, pp=dims.pp)
    # A Trainer subclass's model: its attention is checked when it is built.
    subclass = not names_stock_trainer(cfg)
    validate_lora(cfg, family, tp=dims.tp, build=None if subclass else build_model)
    supported = family.context_parallel if family is not None else subclass
    validate_context_parallel(cfg, cp=dims.cp, pp=dims.pp, supported=supported)
    experts = family.num_experts if family is not None else None
    validate_expert_parallel(cfg, dims, num_experts=experts(cfg.model) if experts else None)
    validate_pipeline(cfg, world_size)
    validate_comm(cfg, world_size)
    validate_compile(cfg, world_size)
    validate_dist(cfg)
    validate_ft(cfg, world_size)
    validate_checkpoint(cfg)
    validate_health(cfg)
    validate_logging(cfg)
    validate_trackers(cfg)
    validate_prometheus(cfg)
    _validate_paths(cfg)


def _validate_paths(cfg: Config) -> None:
    """The folders the run creates outside its run directory (which Hydra has created by now, see
    ``config.paths.RunDirCheck``): each must be creatable, or the launch stops naming its key.
    Input folders (``data.root``) are checked by the data's own validators, where a missing one is
    reported with what it should hold; except a folder CIFAR-10 is to be downloaded into."""
    if cfg.data.name == "cifar10" and cfg.data.download and cfg.data.root is not None:
        check_creatable_folder("data.root", cfg.data.root)
    if cfg.checkpoint.dir is not None and not is_url(cfg.checkpoint.dir):
        check_creatable_folder("checkpoint.dir", cfg.checkpoint.dir)
    if cfg.data.cache_dir is not None:  # the token cache of data=text / data=chat
        check_creatable_folder("data.cache_dir", cfg.data.cache_dir)
    uri = cfg.logging.mlflow.tracking_uri
    if "mlflow" in cfg.logging.trackers and uri and is_local_path(uri):
        check_creatable_folder("logging.mlflow.tracking_uri", local_path(uri))


__all__ = ["validate"]
