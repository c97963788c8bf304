"""Compatibility path: the hooks live in ``sdnet_trainer.training.hooks``.

``from sdnet_trainer.hooks import HookBase`` is how subclasses have imported the hook base, so it
keeps working; new code imports ``sdnet_trainer.HookBase``.
"""

from sdnet_trainer.training.hooks import (
    EvalHook,
    HeartbeatHook,
    HookBase,
    MetricsHook,
    ProfilerHook,
    WatchdogHook,
)

__all__ = ["EvalHook", "HeartbeatHook", "HookBase", "MetricsHook", "ProfilerHook", "WatchdogHook"]
