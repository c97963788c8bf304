"""Planning a launch on this machine: the dry run of a layout (``dry_run.py``) and the layout
chosen for ``parallel=auto`` (``auto.py``, from ``model_stats.py``, ``estimate.py`` and
``hardware.py``); their commands, ``--dry-run`` and ``--plan``, in ``cli.py``."""

from sdnet_trainer.plan.cli import dry_run, plan
from sdnet_trainer.plan.dry_run import plan_rank
from sdnet_trainer.plan.model_stats import saved_for_backward

__all__ = ["dry_run", "plan", "plan_rank", "saved_for_backward"]
