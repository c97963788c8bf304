"""The one exception for a request the server refuses, and refusals in one line."""

from __future__ import annotations

from typing import Any


class InputError(ValueError):
    """A request the model cannot take: answered with ``status`` (a 4xx) and the one-line
    ``reason``, never a traceback."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class ModelError(RuntimeError):
    """The model itself failed on a request: answered with 500 and this one line (the
    traceback goes to the log where it is caught)."""

    @classmethod
    def of(cls, err: BaseException) -> ModelError:
        return cls(f"the model failed: {type(err).__name__}: {first_line(err)}")


def first_line(err: BaseException) -> str:
    """An exception's message cut to its first line (its type's name when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def one_line(errors: list[Any]) -> tuple[int, str]:
    """A pydantic / FastAPI validation failure as (status, one line): malformed JSON is 400,
    JSON of the wrong form 422, naming the first field at fault."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        error = (first.get("ctx") or {}).get("error", "")
        return 400, f"the body is not valid JSON{f' ({error})' if error else ''}"
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or "body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return 422, f"{where}: {first.get('msg', 'invalid')}{more}"
