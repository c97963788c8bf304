"""``uv pip install ARGS`` into this interpreter's environment, from where pip would install.

scripts/ci/test.sh installs the project with uv rather than pip: the same resolution, but uv
unpacks wheels in parallel, and torch's CUDA libraries are gigabytes of them (the two installs'
times: docs/testing.md). uv reads none of pip's
configuration, so pip's own settings (``pip config list``: its configuration files and PIP_*
variables) are handed to uv as the equivalent UV_* variables: the same indexes, local wheel
folders, constraints (a machine's cap on the torch release, say), certificate and timeout.

    python scripts/ci/uv_pip_install.py -e '.[test]'
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

# pip's setting -> (uv's variable, how uv separates several values).
SETTINGS = {
    "index-url": ("UV_DEFAULT_INDEX", None),
    "extra-index-url": ("UV_INDEX", " "),
    "find-links": ("UV_FIND_LINKS", ","),
    "constraint": ("UV_CONSTRAINT", " "),
    "cert": ("SSL_CERT_FILE", None),
    "timeout": ("UV_HTTP_TIMEOUT", None),
    "default-timeout": ("UV_HTTP_TIMEOUT", None),
}
# pip's sections, lowest precedence first: the ``install`` command's over ``global``, and PIP_*
# variables (``:env:``) over both.
SECTIONS = ("global", "install", ":env:")


def pip_settings() -> dict[str, str]:
    """pip's effective value of each setting in SETTINGS, as ``pip config list`` prints them."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: dict[tuple[int, str], str] = {}
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if sep and section in SECTIONS and name in SETTINGS:
            found[SECTIONS.index(section), name] = ast.literal_eval(value)
    return {name: value for (_, name), value in sorted(found.items())}


def uv_environment(settings: dict[str, str]) -> dict[str, str]:
    # pip takes the best version from all its indexes together; uv's default stops at the first
    # index that has the package.
    env = {"UV_INDEX_STRATEGY": "unsafe-best-match"}
    for name, value in settings.items():
        variable, separator = SETTINGS[name]
        values = value.split()
        env[variable] = separator.join(values) if separator else value
    if "UV_CONSTRAINT" in env:  # pip applies its constraints to build environments too
        env["UV_BUILD_CONSTRAINT"] = env["UV_CONSTRAINT"]
    return env


def main(argv: list[str]) -> int:
    uv = shutil.which("uv", path=os.path.dirname(sys.executable))
    if uv is None:
        print(f"uv is not installed beside {sys.executable}: pip install uv", file=sys.stderr)
        return 2
    env = {**os.environ, **uv_environment(pip_settings())}
    command = [uv, "pip", "install", "--python", sys.executable, *argv]
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
