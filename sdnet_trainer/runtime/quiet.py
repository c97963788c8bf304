"""Third-party notices a run's console should not show, silenced where they arise.

Recent torch (2.14 here) logs a deprecation notice at WARNING when a library registers an
``Enum`` subclass as a pytree constant; torchao does so for ``KernelPreference`` (on
``import torchao``) and ``ScaleCalculationMode`` (its mx configs, which peft imports). The
notices are meant for torchao's authors, fire once per process on every float8 or LoRA run, and
nothing a user of this project can do changes them. :func:`torchao_import_quieted` drops exactly
those two, and only while the import that triggers them runs: the torch logger gets a filter for
the length of the ``with``, and a ``warnings`` filter (for a torch that raises them as
DeprecationWarnings instead) lives only inside ``catch_warnings``. Every other notice of torch or
torchao still shows.
"""

from __future__ import annotations

import importlib
import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

# torch/utils/_pytree.py: "<enum 'KernelPreference'> is an Enum subclass and is now natively
# supported by torch.compile as an opaque value type. Calling register_constant() on Enum
# subclasses is deprecated ..."
TORCHAO_ENUM_NOTICE = r"(KernelPreference|ScaleCalculationMode)'?>? is an Enum subclass"
_NOTICE = re.compile(TORCHAO_ENUM_NOTICE)
PYTREE_LOGGER = "torch.utils._pytree"


class _DropTorchaoEnumNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _NOTICE.search(record.getMessage()) is None


@contextmanager
def torchao_import_quieted() -> Iterator[None]:
    """Within: torch's notices about torchao's two Enum pytree constants are dropped."""
    torch_logger = logging.getLogger(PYTREE_LOGGER)
    drop = _DropTorchaoEnumNotices()
    torch_logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=f".*{TORCHAO_ENUM_NOTICE}")
            yield
    finally:
        torch_logger.removeFilter(drop)


def import_quietly(name: str) -> ModuleType:
    """``importlib.import_module(name)`` for a module that imports torchao (torchao itself,
    peft), without torch's notices about torchao's Enums; ImportError passes through."""
    with torchao_import_quieted():
        return importlib.import_module(name)


__all__ = ["TORCHAO_ENUM_NOTICE", "import_quietly", "torchao_import_quieted"]
