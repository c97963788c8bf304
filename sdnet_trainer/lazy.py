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
"""

from __future__ import annotations

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
