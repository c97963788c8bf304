#!/usr/bin/env bash
# Install the project with its test extras into ./.venv (created if missing), check lint, format
# and types (ruff, mypy; settings in pyproject.toml), build the docs site, and run the tests.
#   bash scripts/ci/test.sh            # the whole suite: unit, distributed (gloo), end-to-end CLI
#   bash scripts/ci/test.sh -k ddp     # extra arguments go to pytest
#   bash scripts/ci/test.sh --quick    # while editing: the quick tier (the unit tests but the slowest;
#                                   # tests/conftest.py), after the same install, lint and types
#   SDNET_TEST_WORKERS=1 bash scripts/ci/test.sh    # one pytest process instead of one per core
set -euo pipefail
cd "$(dirname "$0")/../.."
tier=()
if [ "${1:-}" = "--quick" ]; then
    tier=(-m quick)
    shift
fi
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# The project with its test extras, installed by uv from where pip would install them
# (scripts/ci/uv_pip_install.py): pip unpacks torch's gigabytes of wheels on one core (the two
# installs' times: docs/testing.md).
.venv/bin/python -m pip install --quiet 'uv>=0.9,<1'
.venv/bin/python scripts/ci/uv_pip_install.py --quiet -e '.[test]'
# Byte-code: the install leaves it out (compiling torch's thousands of modules takes a minute of
# one core), and each module is compiled when a process first imports it, written beside it and
# read by every later process. Where PYTHONDONTWRITEBYTECODE is set, nothing would be written and
# each of the suite's hundreds of launches would compile the same modules again (seconds each): it
# is unset here, for this command only.
unset PYTHONDONTWRITEBYTECODE
# Lint and formatting first: seconds, and a failure names the file and line.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Types (mypy) and the docs site (mkdocs.yml: --strict fails on a broken link or anchor, or a page
# not in the nav) take a minute or two of one core on a fresh clone: they run beside the tests,
# and their output and verdict come after the tests'. The command fails if any of them fails.
site_dir=$(mktemp -d)
checks_log=$(mktemp)
trap 'rm -rf "$site_dir" "$checks_log"' EXIT
(
    .venv/bin/mypy &&
        NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site_dir"
) >"$checks_log" 2>&1 &
checks=$!
# One thread per process: the distributed tests run 2 processes on small machines.
export OMP_NUM_THREADS=1
# pytest-xdist workers, one per core up to 4: the multi-process tests spend much of their time
# waiting (process starts, rendezvous, signals, timeouts), and a second worker computes meanwhile.
# Whole files go to one worker (their module fixtures, such as the layout suite's shared launch,
# run once), in collection order: the distributed and end-to-end files first, then the many short
# unit files that fill the gaps at the end.
# (getconf, not nproc: nproc answers OMP_NUM_THREADS, set to 1 above.)
cores=$(getconf _NPROCESSORS_ONLN)
workers=${SDNET_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
xdist=()
if [ "$workers" -gt 1 ]; then
    xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
tests=0
.venv/bin/python -m pytest -q ${xdist[@]+"${xdist[@]}"} ${tier[@]+"${tier[@]}"} "$@" || tests=$?
status=0
wait "$checks" || status=$?
cat "$checks_log"
if [ "$status" -ne 0 ]; then
    echo "scripts/ci/test.sh: mypy or the docs build failed (above)" >&2
    exit "$status"
fi
exit "$tests"
