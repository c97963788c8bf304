"""The one exception for a request the server refuses."""

from __future__ import annotations


class InputError(ValueError):
    """A request the model cannot take: answered with ``status`` (a 4xx) and the one-line
    ``reason``, never a traceback."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def first_line(err: BaseException) -> str:
    """An exception's message cut to its first line (its type's name when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
