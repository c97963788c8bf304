"""Small checks every component's validator shares; each message names the key and the value."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from sdnet_trainer.errors import ConfigError


def check_choice(key: str, value: str, choices: Sequence[str]) -> None:
    """``value`` must be one of ``choices``; the message suggests the closest one."""
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}{hint}")


def check_positive(
    key: str, value: float | None, *, allow_none: bool = False, allow_zero: bool = False
) -> None:
    """``value`` must be > 0 (>= 0 with ``allow_zero``); None only with ``allow_none``."""
    if value is None:
        if not allow_none:
            raise ConfigError(f"{key} must be set")
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


__all__ = ["check_choice", "check_positive"]
