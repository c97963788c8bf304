"""``hydra/launcher=torchrun``: every job of a multirun is one ``torchrun --standalone`` launch.

Registered in Hydra's ConfigStore when Hydra scans the plugin namespace, so the choice exists
wherever sdnet_trainer is installed, without a YAML file on the config search path.
"""

# No ``from __future__ import annotations`` here: Hydra executes plugin modules without entering
# them in sys.modules, and dataclasses cannot resolve string annotations of such a module.
# OmegaConf reads these annotations: typing's List stays, as in sdnet_trainer/config/schema.py.
from dataclasses import dataclass, field
from typing import Any, List, Optional  # noqa: UP035

from hydra.core.config_store import ConfigStore


@dataclass
class TorchrunLauncherConf:
    _target_: str = "hydra_plugins.sdnet_trainer_plugins.torchrun_launcher.TorchrunLauncher"
    # Processes per trial: an int, or torchrun's "gpu", "cpu" or "auto".
    nproc_per_node: Any = 1
    # More torchrun options for every trial, e.g. ["--max-restarts=2"].
    torchrun_args: List[str] = field(default_factory=list)  # noqa: UP006
    # Metric columns of summary.csv / summary.md; null: train/loss and every val/ metric.
    summary_metrics: Optional[List[str]] = None  # noqa: UP006
    # A metric name such as val/loss: each job then returns that number alone (what Optuna's
    # sweeper optimises) instead of the dict of final metrics.
    objective: Optional[str] = None


ConfigStore.instance().store(
    group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf, provider="sdnet_trainer"
)
