"""The torchrun launcher: trials one after another, each a distributed run in its own directory.

Hydra's basic launcher calls the task function in this process, which gives every trial a world
size of one. This one starts ``torchrun --standalone --nproc_per_node=N`` per trial with the trial's
overrides and ``hydra.run.dir`` set to the trial's sweep subdirectory, waits for it, and returns the
trial's final metrics read from its metrics.jsonl. After each batch it rewrites the sweep's
summary.csv / summary.md (see sdnet_trainer.sweep) and prints the table.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import (
    JobReturn,
    JobRuntime,
    JobStatus,
    configure_log,
    filter_overrides,
    setup_globals,
)
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)


class TrialFailed(RuntimeError):
    """A trial that exited non-zero, or lacks the metric the sweep optimises."""


class TorchrunLauncher(Launcher):
    def __init__(
        self,
        nproc_per_node: Any = 1,
        torchrun_args: Sequence[str] = (),
        summary_metrics: Sequence[str] | None = None,
        objective: str | None = None,
    ) -> None:
        self.nproc_per_node = _checked_nproc(nproc_per_node)
        self.torchrun_args = [str(a) for a in _plain(torchrun_args)]
        self.summary_metrics = (
            None if summary_metrics is None else [str(m) for m in _plain(summary_metrics)]
        )
        self.objective = objective
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        # task_function is not called here: each trial runs the program again under torchrun.
        self.config = config
        self.hydra_context = hydra_context

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from sdnet_trainer.sweep import write_summary

        assert self.config is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        # Resolving the sweep dir here caches its run id in the master config; Hydra copies that
        # cache into every trial's config, so all trials land under this one directory.
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(
            "Launching %d trial(s), each with torchrun --standalone --nproc_per_node=%s",
            len(job_overrides),
            self.nproc_per_node,
        )
        hydra_cfg = HydraConfig.instance().cfg
        try:
            returns = [
                self._run_trial(list(o), initial_job_idx + i) for i, o in enumerate(job_overrides)
            ]
        finally:
            HydraConfig.instance().cfg = hydra_cfg  # each trial set its own, as run_job would
        table = write_summary(sweep_dir, self.summary_metrics)
        log.info("Sweep summary (%s):\n%s", sweep_dir, table)
        return returns

    def _run_trial(self, overrides: list[str], num: int) -> JobReturn:
        from sdnet_trainer.sweep import read_final_metrics, torchrun_command, write_trial

        assert self.config is not None and self.hydra_context is not None
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = num
            sweep_config.hydra.job.num = num
        HydraConfig.instance().set_config(
            sweep_config
        )  # ${hydra:job.num} and friends in the subdir
        run_dir = Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)
        command = torchrun_command(
            [*_program(), *_config_args(sweep_config)],
            overrides,
            run_dir=run_dir.resolve(),
            nproc_per_node=self.nproc_per_node,
            torchrun_args=self.torchrun_args,
        )
        log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides)))
        # One run id per trial, derived from the sweep's: run.id in the trial's resolved config
        # then names the sweep it belongs to rather than the moment torchrun started.
        env = (
            {**os.environ, "SDNET_RUN_ID": f"{sweep_config.run.id}_{num}"}
            if "run" in sweep_config
            else None
        )
        returncode = subprocess.run(command, env=env).returncode
        write_trial(run_dir, num=num, overrides=overrides, command=command, returncode=returncode)
        metrics = read_final_metrics(run_dir)
        return self._job_return(sweep_config, overrides, run_dir, num, returncode, metrics)

    def _job_return(
        self,
        sweep_config: DictConfig,
        overrides: list[str],
        run_dir: Path,
        num: int,
        returncode: int,
        metrics: dict[str, float],
    ) -> JobReturn:
        task_cfg = copy.deepcopy(sweep_config)
        with read_write(task_cfg), open_dict(task_cfg):
            del task_cfg["hydra"]
        ret = JobReturn(
            overrides=overrides,
            cfg=task_cfg,
            # HydraConfig annotates cfg as HydraConf, but set_config stores the DictConfig that
            # OmegaConf.masked_copy returns.
            hydra_cfg=cast("DictConfig | None", copy.deepcopy(HydraConfig.instance().cfg)),
            working_dir=os.getcwd(),
            task_name=JobRuntime.instance().get("name"),
        )
        if returncode != 0:
            ret.status = JobStatus.FAILED
            ret.return_value = TrialFailed(
                f"trial #{num} exited with code {returncode}; see {run_dir / 'train.log'}"
            )
        elif self.objective is not None and self.objective not in metrics:
            ret.status = JobStatus.FAILED
            ret.return_value = TrialFailed(
                f"hydra.launcher.objective={self.objective!r}: trial #{num} has no such final "
                f"metric (it has {sorted(metrics)})"
            )
        else:
            ret.status = JobStatus.COMPLETED
            ret.return_value = metrics[self.objective] if self.objective is not None else metrics
        return ret


def _program() -> list[str]:
    """What a trial runs: ``-m sdnet_trainer`` for the package's own CLI (``python -m
    sdnet_trainer`` or ``sdnet-train``), otherwise the user's script that called ``launch``."""
    import sdnet_trainer

    main_file = Path(sys.argv[0]).resolve()
    package_main = Path(sdnet_trainer.__file__).parent.resolve() / "__main__.py"
    if main_file == package_main or main_file.name == "sdnet-train":
        return ["-m", "sdnet_trainer"]
    return [str(main_file)]


def _config_args(config: DictConfig) -> list[str]:
    """The sweep's --config-name and --config-dir, which trials need to compose the same config."""
    args = [f"--config-name={config.hydra.job.config_name}"]
    for source in config.hydra.runtime.config_sources:
        if source.provider == "command-line" and source.schema == "file":
            args.append(f"--config-dir={source.path}")
    return args


def _checked_nproc(value: Any) -> int | str:
    """torchrun's --nproc_per_node values, checked before the first trial rather than by every
    trial."""
    from sdnet_trainer.errors import ConfigError

    if str(value) in ("gpu", "cpu", "auto"):
        return str(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ConfigError(
        f"hydra.launcher.nproc_per_node={value!r}: expected a positive integer, gpu, cpu or auto"
    )


def _plain(value: Any) -> list[Any]:
    plain: Any = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return list(plain)
