"""A run that needs no torchvision never imports it, and importing the CLI imports neither it nor
torch._dynamo (which torchvision and torch's pipelining bring): each launch, ``--help``, dry run
and worker would pay about a CPU-second of start-up for them (see sdnet_trainer/lazy.py). Training
imports torch._dynamo all the same: torch's optimizers import it when the first one is built.

The garbage collector's share of a start-up: no collection runs while the package imports, the
collector is on again after, and the run's process has frozen what it imported."""

from __future__ import annotations

import gc
import json
from typing import Any

import pytest

from sdnet_trainer.lazy import freeze_imports
from tests.support import TINY, checkpoint_names, run_cli

# What importing the CLI must not import, and what the tiny run must not import (torchao: only a
# run with precision.float8 needs it).
AT_IMPORT = ("torchvision", "torch._dynamo")
IN_THE_RUN = ("torchvision", "torchao")

# Imports the CLI, then trains in this same process; reports the modules of AT_IMPORT imported
# with the CLI and those of IN_THE_RUN imported by the end, each with the stack of the import
# statement that first asked for it.
PROBE = """
import gc
import importlib.abc
import json
import sys
import traceback

AT_IMPORT, IN_THE_RUN = {at_import!r}, {in_the_run!r}
first_import = {{}}


def imported(names):
    return {{name: first_import.get(name, "?") for name in names if name in sys.modules}}


class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        stack = traceback.extract_stack()
        # An import, not a look-up such as importlib.util.find_spec (the diagnostic only: the
        # test asserts on sys.modules).
        loading = stack[-3].name == "_find_and_load_unlocked"
        if name in AT_IMPORT + IN_THE_RUN and name not in first_import and loading:
            frames = [f for f in stack if "importlib" not in f.filename]
            first_import[name] = "".join(traceback.format_list(frames[:-1]))
        return None  # the usual finders import it


def collections():
    return [generation["collections"] for generation in gc.get_stats()]


sys.meta_path.insert(0, Watch())
before = collections()
import sdnet_trainer.cli  # noqa: E402

print("AT_IMPORT " + json.dumps(imported(AT_IMPORT)))
print("GC " + json.dumps({{"before": before, "after": collections(), "on": gc.isenabled()}}))
sys.argv = ["sdnet_trainer", *sys.argv[1:]]
sdnet_trainer.cli.main()
print("IN_THE_RUN " + json.dumps(imported(IN_THE_RUN)))
print("FROZEN " + json.dumps(gc.get_freeze_count()))
"""


def _reported(output: str, key: str) -> Any:
    lines = [line for line in output.splitlines() if line.startswith(f"{key} ")]
    assert len(lines) == 1, output[-3000:]
    return json.loads(lines[0].removeprefix(f"{key} "))


def _chains(imported: dict[str, str]) -> str:
    return "\n".join(f"{name}, first imported from:\n{stack}" for name, stack in imported.items())


@pytest.mark.full  # seconds: out of the quick tier
def test_the_cli_and_a_tiny_run_leave_out_what_they_do_not_use(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.format(at_import=AT_IMPORT, in_the_run=IN_THE_RUN))
    run_dir = tmp_path / "run"
    args = [*TINY, "loop.max_steps=2", f"hydra.run.dir={run_dir}"]
    # A fresh interpreter (fork=False): a forked one would start with the fork server's imports
    # (tests/forked.py preloads the CLI and what training imports anyway, torch._dynamo included).
    launch = run_cli(args, cwd=tmp_path, script=probe, timeout=240, fork=False)
    assert launch.returncode == 0, launch.output[-3000:]
    assert checkpoint_names(run_dir / "checkpoints") == {"step_00000002"}, launch.output[-3000:]
    at_import = _reported(launch.output, "AT_IMPORT")
    assert not at_import, _chains(at_import)
    in_the_run = _reported(launch.output, "IN_THE_RUN")
    assert not in_the_run, _chains(in_the_run)
    # Collections per generation: without the pause, importing the CLI ran about 660 young, 60
    # middle and 5 full ones. One young collection may run while the package's module loads,
    # before its first line.
    collector = _reported(launch.output, "GC")
    ran = [a - b for a, b in zip(collector["after"], collector["before"], strict=True)]
    assert ran[0] <= 1 and ran[1:] == [0, 0] and collector["on"], collector
    # torch alone is hundreds of thousands of objects: the imports, not a handful, were frozen.
    assert _reported(launch.output, "FROZEN") > 100_000


def test_imports_are_frozen_once_per_process():
    """A second call (cli.run after cli.main, each trial of an in-process multirun) freezes
    nothing: what the process created since, a trial's garbage included, stays collectable."""
    # This worker froze what its collection imported (tests/conftest.py): from nothing frozen,
    # without the earlier tests' garbage. The first call leaves the worker frozen as it was.
    gc.unfreeze()
    gc.collect()
    freeze_imports()
    frozen = gc.get_freeze_count()
    assert frozen > 100_000  # torch and the project, imported by this process
    created_since = [[] for _ in range(1000)]  # noqa: F841 (alive across the call)
    freeze_imports()
    # Not equal: a frozen object whose last reference goes is still freed (and uncounted).
    assert gc.get_freeze_count() <= frozen
