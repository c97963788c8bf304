"""Imports deferred to the first use, and class checks that import nothing.

Importing torchvision costs a process about a CPU-second (it brings torch._dynamo, sympy and
more), paid by every launch, ``--help``, dry run and worker, while most runs (language models,
synthetic images) never build a torchvision object. So the modules that build such objects (the
image data sets, transforms, torchvision's models) are imported where one is first built: by name
through :func:`resolve`, or by an import inside the function that builds it. Code that only asks
whether an object is of one of their classes uses :func:`loaded_types`, which imports nothing.
torch's pipelining, which imports torch._dynamo too, is imported where a pipeline is checked or
built (``parallel.pp > 1``). A process that trains imports torch._dynamo all the same (torch's
optimizers import it when the first one is built); the rest (launchers, ``--help``, loader workers,
export) do not. tests/unit/test_lazy_imports.py keeps it so.

What a process has imported it keeps to the end, and Python's cyclic garbage collector would walk
it all again at every full collection: :func:`freeze_imports` sets it aside once the process has
started (the package's own ``__init__`` keeps the collector off while it imports).
"""

from __future__ import annotations

import gc
import importlib
import sys
from typing import Any


def resolve(target: str) -> Any:
    """The object ``"package.module:attribute"`` names, its module imported now."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def loaded_types(module: str, *names: str) -> tuple[type[Any], ...]:
    """The classes ``names`` of ``module`` when that module is imported already, else ``()``
    (which ``isinstance`` accepts and which matches nothing). An object of a class, or of a
    subclass, cannot exist before the class's module has run, so ``isinstance(x,
    loaded_types(...))`` answers as the check against the classes would, without importing them.
    """
    found = sys.modules.get(module)
    if found is None:
        return ()
    # A module still being imported may not define them yet; no instance exists then either.
    return tuple(getattr(found, name) for name in names if hasattr(found, name))


def freeze_imports() -> None:
    """Move every object alive now (in a process just started: the modules it imported, about a
    million objects with torch) into the collector's permanent generation, which it never walks;
    once per process: with something frozen already, nothing more is.

    For a process's entry point, once its imports are done. A full collection then walks what
    the run itself created, not the imports again: in a short training run those walks were a
    quarter of its CPU time, the import of torch._dynamo by the first optimizer included. Forked
    DataLoader workers inherit the frozen generation, so their collections do not touch (and copy)
    the parent's pages: the use Python's documentation gives for ``gc.freeze``. Nothing frozen is
    ever freed, hence once: the entry points call this again at each run (``cli.run``, every trial
    of an in-process multirun), where it would freeze the garbage of the trials before. A caller
    that is not a fresh process (a test calling ``main`` in its own process) undoes it with
    ``gc.unfreeze()``.
    """
    if gc.get_freeze_count() == 0:
        gc.freeze()
