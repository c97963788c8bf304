"""Command line: ``torchrun -m sdnet_trainer +recipe=NAME key=value ...``.

Hydra composes the config on every rank; ``run`` then validates it before any process group
exists, starts the group, runs the Trainer, and destroys the group on every path. User scripts
with their own Trainer subclass call ``launch(MyTrainer)`` for the same behaviour.

Processes a scheduler started without torchrun (Hydra's submitit launcher, or ``srun python`` with
SDNET_SLURM_TASKS=1) get torchrun's variables from the scheduler's first: see
sdnet_trainer/distributed/launchers.py. Under torchrun each worker first binds its life to the
agent's (sdnet_trainer/runtime/signals.py).

Exit codes: 2 config error, 3 non-finite abort (health.py), 4 hang (health.py), 5 checkpoint
error, 130 SIGINT and 143 SIGTERM (runtime/signals.py). A failure of ours ends the process with
one line and no traceback, on every rank that meets it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from sdnet_trainer.checkpoint import CheckpointError
from sdnet_trainer.checkpoint.files import folder_of
from sdnet_trainer.config import CONFIG_MODULE, Config, to_config
from sdnet_trainer.config.guards import given_keys, validate_switched_keys
from sdnet_trainer.config.synonyms import check_overrides, name_override_hints
from sdnet_trainer.distributed import distributed_session, launched_world_size
from sdnet_trainer.distributed.env import resolve_device
from sdnet_trainer.distributed.launchers import export_scheduler_env
from sdnet_trainer.distributed.ops import all_gather_objects
from sdnet_trainer.errors import EXIT_CONFIG_ERROR, ConfigError
from sdnet_trainer.lazy import freeze_imports
from sdnet_trainer.observability import setup_logging
from sdnet_trainer.preflight import validate
from sdnet_trainer.runtime.signals import EXIT_INTERRUPTED, die_with_launcher
from sdnet_trainer.training.classes import resolve_trainer_class
from sdnet_trainer.training.health import EXIT_NONFINITE, NonFiniteError
from sdnet_trainer.training.trainer import Trainer

logger = logging.getLogger("sdnet_trainer")

EXIT_CHECKPOINT = 5
INTERRUPTED_OUTSIDE_LOOP = "SIGINT: interrupted outside the training loop, no checkpoint saved"


def run(cfg: DictConfig, trainer_cls: type[Trainer] | None = None) -> dict[str, float]:
    """Validate ``cfg``, then train with ``trainer_cls`` (default: ``cfg.trainer._target_``).

    A ConfigError anywhere (validation, a missing data folder, an unknown model) ends the process
    with exit code 2 and the message alone, after the process group is torn down; a CheckpointError
    (a save or a resume that failed) likewise with exit code 5.
    """
    _start_process()  # under submitit this function is the task itself: no main() ran here
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    rank = int(os.environ.get("RANK", "0"))
    level = str(cfg.logging.level) if "logging" in cfg else "INFO"
    setup_logging(
        output_dir, rank=rank, level=level if level.upper() in logging._nameToLevel else "INFO"
    )
    try:
        config = _validated(cfg, output_dir)
        cls = trainer_cls or resolve_trainer_class(config.trainer._target_)
        # FSDP's CPU offload leaves CPU gradients: their norm needs a CPU backend beside NCCL.
        cpu_collectives = config.parallel.fsdp.cpu_offload
        with distributed_session(
            config.dist, output_dir=output_dir, cpu_collectives=cpu_collectives
        ) as env:
            _check_same_run(output_dir, config.run.id, _layout_keys(config))
            trainer = cls(config, output_dir=output_dir, env=env)
            try:
                return trainer.fit()
            finally:
                trainer.close()
    except NonFiniteError as err:
        logger.error("%s", err)
        sys.exit(EXIT_NONFINITE)
    except ConfigError as err:
        # Every rank that fails says why: torchrun stops the others as soon as one exits, so a
        # message left to rank 0 alone could be cut off. Ranks above 0 prefix their rank.
        logger.error("config error: %s", _with_group_hints(err))
        sys.exit(EXIT_CONFIG_ERROR)
    except CheckpointError as err:
        logger.error("checkpoint error: %s", _one_line(err))
        sys.exit(EXIT_CHECKPOINT)
    except KeyboardInterrupt:
        # Inside the training loop SIGINT stops at the end of the step with a checkpoint
        # (runtime/signals.py); before the loop or after it, it lands here.
        logger.warning(INTERRUPTED_OUTSIDE_LOOP)
        sys.exit(EXIT_INTERRUPTED)


def _with_group_hints(err: ConfigError) -> str:
    """The error, and for each ``X.name=value`` on the command line whose value is an option of
    the config group ``X`` (``optim.name=AdamW``), the group to choose (``optim=adamw``)."""
    message = str(err)
    # As typed: an override's value may be an interpolation that fails (the error reported).
    for hint in name_override_hints(_command_line_overrides()):
        if hint not in message:
            message = f"{message}; {hint}"
    return message


def _check_arguments() -> None:
    """A key brought from nanoGPT, Hugging Face or torchtitan (``model.gpt.n_embd=128``, with or
    without ``+``) is answered with this project's key before Hydra composes (its own message,
    "Key not in GPTConfig", names none; ``--cfg job`` would not check at all)."""
    try:
        check_overrides(sys.argv[1:])
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _start_process() -> None:
    """First thing in a worker: set its imports aside from the garbage collector's walks, die
    with torchrun's agent, then map scheduler task variables to torchrun's before anything reads
    RANK (the config's run directory included, which is why main() does this before Hydra
    composes)."""
    freeze_imports()
    die_with_launcher()
    _export_scheduler_env()


def _interruptible(entry: Callable[[], object]) -> None:
    """Ctrl-C while Hydra composes, before ``run`` takes over: one line, no traceback."""
    try:
        entry()
    except KeyboardInterrupt:
        print(INTERRUPTED_OUTSIDE_LOOP, file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


def _export_scheduler_env() -> None:
    """Map scheduler task variables to torchrun's (see ``_start_process``)."""
    try:
        export_scheduler_env()
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)


def _validated(cfg: DictConfig, output_dir: Path) -> Config:
    try:
        config = to_config(cfg)
    except MissingMandatoryValue as err:
        raise ConfigError(
            f"{err.full_key} must be set (it has no default in this config)"
        ) from None
    except OmegaConfBaseException as err:  # a bad interpolation or a value the schema rejects
        raise ConfigError(
            str(err).splitlines()[0] + f" (key {getattr(err, 'full_key', '?')})"
        ) from None
    world_size = launched_world_size()
    if config.parallel.strategy == "auto":
        # The planner (and the dry run it uses) is imported by the runs that ask for it.
        from sdnet_trainer.plan.auto import resolve_auto

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        config = resolve_auto(
            config,
            world_size,
            checkpoint_dir=folder_of(
                config.checkpoint.dir or output_dir / "checkpoints",
                dict(config.checkpoint.storage_options),
            ),
            device=resolve_device(config.dist, local_rank),
        )
    validate(config, world_size=world_size)
    # Last: a component's own check of a key behind its switch speaks first, in its own words.
    validate_switched_keys(config, given_keys(_command_line_overrides()))
    return config


def _command_line_overrides() -> list[str]:
    """The command line's key=value overrides as typed (none where Hydra's main did not compose
    the config: a caller handing ``run`` a config of its own)."""
    if not HydraConfig.initialized():
        return []
    task = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)
    return [str(item) for item in task]  # type: ignore[union-attr]


def _layout_keys(config: Config) -> tuple[object, ...]:
    """What parallel=auto chooses, as the ranks compare it."""
    p = config.parallel
    return (
        p.strategy,
        p.dp_replicate,
        p.dp_shard,
        p.tp,
        p.pp,
        p.pipeline.schedule,
        p.pipeline.microbatches,
        p.activation_checkpointing,
        p.activation_checkpointing_every,
        config.loop.grad_accum_steps,
    )


def _check_same_run(output_dir: Path, run_id: str, layout: tuple[object, ...]) -> None:
    """Every rank composed its config alone: the run directory and run.id (the checkpoint
    directory's claim, the metrics' identity) must have come out the same on all of them, and so
    must the layout (parallel=auto plans on each rank, from figures a node's ranks read alike)."""
    gathered = all_gather_objects((str(output_dir), run_id, layout))
    seen = sorted({(d, i) for d, i, _ in gathered})
    if len(seen) > 1:
        raise ConfigError(
            "ranks resolved different run directories or run.id values ("
            + "; ".join(f"{d} with run.id {i!r}" for d, i in seen)
            + "); pass the same run.id (or SDNET_RUN_ID) to every rank: a launch without "
            "torchrun or a scheduler's job id names each rank's run after its own clock"
        )
    layouts = sorted({repr(lay) for _, _, lay in gathered})
    if len(layouts) > 1:
        raise ConfigError(
            f"ranks chose different layouts ({'; '.join(layouts)}): parallel=auto planned from "
            f"figures that differ between nodes (memory, cores, LOCAL_WORLD_SIZE, the "
            f"calibration file, the checkpoints they see); set parallel.memory_per_rank_gib, "
            f"parallel.auto.ranks_per_node and parallel.auto.shared_cores"
        )


@hydra.main(version_base=None, config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
def _main(cfg: DictConfig) -> dict[str, float]:
    return run(cfg)


def main() -> None:
    for command in ("--dry-run", "--plan"):
        if command in sys.argv[1:]:
            # Plans a launch on this machine instead of running it (sdnet_trainer/plan/cli.py).
            from sdnet_trainer.plan import cli

            entry = cli.dry_run if command == "--dry-run" else cli.plan
            sys.exit(entry([a for a in sys.argv[1:] if a != command]))
    _start_process()
    _check_arguments()
    _interruptible(_main)


def launch(trainer_cls: type[Trainer]) -> None:
    """Run the CLI with ``trainer_cls``: the entry point of a user script.

    if __name__ == "__main__":
        sdnet_trainer.launch(MyTrainer)   # torchrun --nproc_per_node=2 my_train.py +recipe=...
    """

    @hydra.main(version_base=None, config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
    def _task(cfg: DictConfig) -> dict[str, float]:
        return run(cfg, trainer_cls=trainer_cls)

    _start_process()
    _check_arguments()
    _interruptible(_task)
