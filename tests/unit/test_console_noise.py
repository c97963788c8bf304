"""A normal run's console shows only what the user should read (issue 56, item 7): no WARNING
line (the heartbeat is INFO) and no deprecation text from torch or torchao, whose Enum notices
the project's import sites silence (runtime/quiet.py)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from tests.support import REPO, cli_env, run_cli

_NOISE = re.compile(r"WARNING|\bW\d{4} |deprecat", re.IGNORECASE)


def test_a_quickstart_run_prints_no_warning_or_deprecation(tmp_path):
    launch = run_cli(
        ["+recipe=quickstart", "loop.max_steps=4", "health.heartbeat_s=0.001"],
        cwd=tmp_path,
        fork=False,
    )
    assert launch.returncode == 0, launch.output
    assert "heartbeat rank 0" in launch.output  # the heartbeat ran, at INFO
    noisy = [line for line in launch.output.splitlines() if _NOISE.search(line)]
    assert not noisy, "\n".join(noisy)


@pytest.mark.parametrize(
    "site",
    [
        "from sdnet_trainer.distributed.float8 import _torchao_float8; _torchao_float8('rowwise')",
        "from sdnet_trainer.models.lora_folder import require_peft; require_peft('x')",
    ],
)
def test_the_torchao_import_sites_print_no_deprecation(site):
    package = "torchao" if "float8" in site else "peft"
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    done = subprocess.run(
        [sys.executable, "-c", site],  # warnings filtered as a user gets them
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "Enum subclass" not in output and "DeprecationWarning" not in output, output
