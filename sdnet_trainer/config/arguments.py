"""``key=value`` arguments of the package's commands (export, serve) onto their dataclass."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, TypeVar, cast

from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from sdnet_trainer.errors import ConfigError

T = TypeVar("T")


def parse_key_values(schema: type[T], argv: Sequence[str], *, example: str, missing: str) -> T:
    """``argv`` onto an instance of the dataclass ``schema``. A pair that is not ``key=value``
    (``example`` shows one), an unknown key (named, with the closest known one), a value of the
    wrong type or a missing mandatory key (``missing`` says what to pass) is a ConfigError."""
    known = [f.name for f in fields(cast(Any, schema))]
    for arg in argv:
        key, eq, _ = arg.partition("=")
        if not eq:
            raise ConfigError(f"argument {arg!r} is not key=value (e.g. {example})")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"unknown key {key} in {arg!r}: the keys are {', '.join(known)}{hint}"
            )
    try:
        # to_object of a structured config of a dataclass is an instance of it.
        merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_dotlist(list(argv)))
        return cast(T, OmegaConf.to_object(merged))
    except MissingMandatoryValue:
        raise ConfigError(missing) from None
    except OmegaConfBaseException as err:  # a value of the wrong type
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"{key}: {str(err).splitlines()[0]}") from None


__all__ = ["parse_key_values"]
