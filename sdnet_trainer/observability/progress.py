"""The rank-0 progress bar: step, loss, lr, img/s and ETA, quiet when stderr is not a terminal."""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_enabled(mode: str, *, is_main: bool) -> bool:
    if not is_main or mode == "off":
        return False
    return mode == "on" or sys.stderr.isatty()


class ProgressBar:
    def __init__(self, *, total: int, initial: int, enabled: bool) -> None:
        self._bar = (
            tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)
            if enabled
            else None
        )

    def update(self, step: int, postfix: dict[str, str] | None = None) -> None:
        if self._bar is None:
            return
        self._bar.update(step - self._bar.n)
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
