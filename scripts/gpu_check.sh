#!/usr/bin/env bash
# The path the team's runbook names; the script is scripts/ci/gpu_check.sh (its header says how to run it).
exec bash "$(dirname "$0")/ci/gpu_check.sh" "$@"
