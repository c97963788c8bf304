"""Hydra plugins of sdnet_trainer.

Hydra imports every module under the ``hydra_plugins`` namespace at startup and accepts launcher
classes only from there, so these modules stay light: anything heavy is imported when used.
"""
