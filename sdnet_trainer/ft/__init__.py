"""Per-step fault tolerance across replica groups, on torchft (the ``[ft]`` extra).

Each replica group is an ordinary launch of this CLI (one process, or a torchrun launch with DDP,
or FSDP2 in sync mode: HSDP across the groups; every group runs the same number of ranks). The
training loop calls this room at fixed points (see ``room.FaultTolerance``): the quorum before the
step (a joining group copies the live state from a healthy peer there), the gradients' average
across the quorum's groups after backward (``fault_tolerance.mode=sync``), and the commit vote that
gates the update. ``local_sgd`` and ``diloco`` hand the optimizer to ``torchft.local_sgd``.
``checks.py`` validates the config before launch, ``shards.py`` carries FSDP2's sharded state to a
joining group, ``data.py`` divides each step's global batch among the quorum's groups, ``hooks.py``
reports the metrics, ``lighthouse.py`` starts the lighthouse
(``python -m sdnet_trainer.ft.lighthouse``).

Nothing here imports torchft at module level: without the extra, only an enabled config fails,
with an error naming the extra.
"""

from sdnet_trainer.ft.checks import check_lighthouse, require_torchft, validate_ft

__all__ = ["check_lighthouse", "require_torchft", "validate_ft"]
