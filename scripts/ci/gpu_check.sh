#!/usr/bin/env bash
# The GPU check in one command, on a node with one NVIDIA GPU, its own torch and no network
# (docs/gpu.md). Written for a node lent for minutes, once: the whole command keeps to a time
# budget of its own, every part is stopped when its share runs out, and the table is written
# whatever happens, a timeout or a signal included.
#
# It uses the node's Python as it is: a throwaway venv on top of it (--system-site-packages: the
# node's torch, torchvision, pytest, ...), the packages the node lacks installed there from a
# wheel folder made beforehand by scripts/ci/gpu_wheels.sh (pip never reads an index), and the
# project installed in place without dependencies. Then it shows the machine (nvidia-smi, torch,
# CUDA, cuDNN, NCCL, /dev/shm, the host name), runs the CUDA tests (tests/cuda, -m cuda; the
# cold-compile tests last), runs scripts/bench/bench_gpu.py (a bf16 matmul first: the practical
# peak the table compares every throughput with), measures parallel=auto's constants where the
# benchmark left a minute (sdnet_trainer.plan.calibrate: calibration.json in the archive), and
# prints one table, last, which ends with a row per GPU claim of the docs: measured or not, why.
#   bash scripts/ci/gpu_wheels.sh gpu_wheels          # beforehand, where the package index is reached
#   GPU_CHECK_OUT=$PWD/out bash scripts/ci/gpu_check.sh   # on the node: at most GPU_CHECK_BUDGET_S
#   bash scripts/ci/gpu_check.sh -k fit               # extra arguments go to pytest
#   GPU_CHECK_SECOND=1 GPU_CHECK_OUT=$PWD/out2 bash scripts/ci/gpu_check.sh
#                                                  # the second command (at most 450 s): the CUDA
#                                                  # tests marked gpu_second (float8, context
#                                                  # parallel, the MoE's grouped matmul) and
#                                                  # bench_gpu.py --second (MoE, ring attention,
#                                                  # float8 and FSDP2 against bf16 on llama3_1b)
#   GPU_CHECK_FULL=1 bash scripts/ci/gpu_check.sh     # the long version: every CUDA test, 3 rounds
#                                                  # of the benchmark, every section of it
#
# What comes back fits what an offline node can hand back: the output folder gets at most 8
# plain files, no folder: summary.txt (the table), machine.txt, setup.log, pytest.log (its tail:
# the failures, the durations, the counts), cuda_tests.xml (JUnit), bench.json, bench.log (its
# tail), and gpu_check.tar.gz (everything else: each benchmark launch's log, metrics and config).
# Each file is at most 8 MiB (logs keep their tail), the archive at most 15 MiB.
#
# Environment:
#   PYTHON                    the node's Python, with its torch (default python3)
#   GPU_CHECK_WHEELS=DIR      the wheel folder (default ./gpu_wheels)
#   GPU_CHECK_OUT=DIR         the 8 files above (default: a new temporary folder)
#   GPU_CHECK_VENV=DIR        keep the venv there and reuse it on the next run (default: a
#                             temporary one, removed at the end)
#   GPU_CHECK_SECOND=1        the second command (the first leaves its parts out)
#   GPU_CHECK_BUDGET_S=S      the whole command, setup to table (default 500; 450 with SECOND;
#                             3000 with FULL)
#   GPU_CHECK_TEST_S=S        at most this much of it for pytest (default 230; 170 with SECOND;
#                             2400 with FULL)
#   GPU_CHECK_BENCH_S=S       at most this much for the benchmark (default: what is left)
#   GPU_CHECK_BENCH_ARGS="…"  bench_gpu.py's arguments (default --quick; --second with SECOND;
#                             "" with FULL)
#   GPU_CHECK_BENCH=0         the tests only
#   GPU_CHECK_TEST_TIMEOUT=S  seconds per CUDA test (default 200)
# A part whose share runs out gets SIGINT (pytest then writes its report and its summary, and each
# test's launches are killed as the test ends), 15 s of grace, then SIGKILL for its process group;
# anything it started in a session of its own is found by a mark in its environment and killed.
# Exit status: 1 if the setup failed, a CUDA test failed or errored, pytest could not run or
# collect, or a benchmark launch failed; else 2 without a CUDA device (the setup and the
# collection done, the tests skipped, nothing measured); else 3 if a part did not finish in its
# share (what it finished passed: the budget was too short, not the code wrong); else 0. A signal
# or the whole budget running out ends it with 124, the table written.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
REPO=$(pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-$REPO/gpu_wheels}
FULL=${GPU_CHECK_FULL:-0}
SECOND=${GPU_CHECK_SECOND:-0}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-200}
# Each command's tests (-m) and benchmark. The node is lent for minutes: the first command
# checks the GPU lane (the CUDA tests but those marked gpu_second, the quick benchmark); the
# second measures what the project claims beyond it (tests marked gpu_second: float8, context
# parallel, the MoE's grouped matmul; bench_gpu.py --second), on the same node or the next.
if [ "$FULL" = "1" ]; then
    COMMAND="full"
    BUDGET=${GPU_CHECK_BUDGET_S:-3000}
    TEST_S=${GPU_CHECK_TEST_S:-2400}
    SELECT=(-m cuda)
    BENCH_ARGS=${GPU_CHECK_BENCH_ARGS-}
elif [ "$SECOND" = "1" ]; then
    COMMAND="second"
    BUDGET=${GPU_CHECK_BUDGET_S:-450}
    TEST_S=${GPU_CHECK_TEST_S:-170}
    SELECT=(-m "cuda and gpu_second")
    BENCH_ARGS=${GPU_CHECK_BENCH_ARGS---second}
else
    COMMAND="first"
    BUDGET=${GPU_CHECK_BUDGET_S:-500}
    TEST_S=${GPU_CHECK_TEST_S:-230}
    # Two tests that others cover: the compiled gpt_tiny fit (the resnet18 one covers compile,
    # bf16 and the profiler through the CLI), FSDP2 over gloo on two ranks sharing the GPU (DDP
    # covers two ranks, FSDP2 its one-rank NCCL group).
    SELECT=(-m "cuda and not gpu_second"
        -k "not (compiled_and_profiled and gpt_tiny) and not fsdp_over_gloo")
    BENCH_ARGS=${GPU_CHECK_BENCH_ARGS---quick}
fi
BENCH_S=${GPU_CHECK_BENCH_S:-}
GRACE=15   # SIGINT to SIGKILL
RESERVE=15 # kept back for the table and the archive
MB=$((1024 * 1024))
STARTED=$SECONDS

OUT=${GPU_CHECK_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
# Everything is written to a scratch folder first; finish() puts the 8 files into OUT.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX") || exit 1
SETUP_LOG=$WORK/setup.log
: >"$SETUP_LOG"
VENV=${GPU_CHECK_VENV:-}
OWN_VENV=0
if [ -z "$VENV" ]; then
    VENV=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_venv.XXXXXX") || exit 1
    OWN_VENV=1
fi
VPY=$VENV/bin/python

# What the parts did, for the table: exit codes (empty: did not run) and seconds.
SETUP_S=0 TESTS_S=0 BENCH_RUN_S=0
pytest_rc="" bench_rc="" cuda=0 interrupted=""
SETUP_FAILED=""

# Never the network: pip reads no index and no configuration that could name one.
export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export PYTHONUNBUFFERED=1

left() { # seconds of the budget left, less the reserve for the table
    echo $((BUDGET - (SECONDS - STARTED) - RESERVE))
}

reap() { # kill every process whose environment holds GPU_CHECK_PART=$1: what a part started,
    # also in sessions of its own (the tests' launches, torchrun's workers)
    local proc pid pids=()
    for proc in /proc/[0-9]*; do
        pid=${proc#/proc/}
        [ "$pid" = "$$" ] && continue
        if { tr '\0' '\n' <"$proc/environ"; } 2>/dev/null | grep -qxF "GPU_CHECK_PART=$1"; then
            pids+=("$pid")
        fi
    done
    if [ ${#pids[@]} -gt 0 ]; then
        kill -KILL "${pids[@]}" 2>/dev/null
    fi
    return 0
}

PART_PID="" PART_MARK=""
SIGINT_DEFAULT='import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])'
SETSID=$(command -v setsid || true) # a session of its own where the node has setsid
run_part() { # NAME SECONDS LOG CMD...: run CMD in a session of its own for at most SECONDS,
    # its output in LOG and on the console; sets part_rc (124: stopped at its share's end)
    local name=$1 seconds=$2 log=$3
    shift 3
    PART_MARK="$name-$$-$RANDOM"
    # A background job of a script starts with SIGINT ignored, and an ignored signal stays
    # ignored across exec: Python would never raise KeyboardInterrupt. The wrapper restores
    # the default before it becomes CMD, so pytest can end on SIGINT with its report written.
    GPU_CHECK_PART=$PART_MARK $SETSID "$VPY" -c "$SIGINT_DEFAULT" "$@" >"$log" 2>&1 </dev/null &
    PART_PID=$!
    tail -n +1 --pid="$PART_PID" -f "$log" 2>/dev/null &
    local tailer=$! deadline=$((SECONDS + seconds)) stopped=0
    while kill -0 "$PART_PID" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 1
    done
    if kill -0 "$PART_PID" 2>/dev/null; then
        stopped=1
        echo "gpu_check: $name: its ${seconds} s share ran out: SIGINT, then SIGKILL after ${GRACE} s" |
            tee -a "$log" >&2
        end_part "$GRACE"
    fi
    wait "$PART_PID"
    part_rc=$?
    [ "$stopped" = 1 ] && part_rc=124
    reap "$PART_MARK"
    wait "$tailer" 2>/dev/null
    PART_PID="" PART_MARK=""
}

end_part() { # SECONDS: SIGINT to the part in flight, at most SECONDS to end, then SIGKILL for its
    # process group and whatever it started elsewhere
    [ -n "$PART_PID" ] || return 0
    kill -INT "$PART_PID" 2>/dev/null
    local deadline=$((SECONDS + $1))
    while kill -0 "$PART_PID" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 1
    done
    kill -KILL -- "-$PART_PID" "$PART_PID" 2>/dev/null
    reap "$PART_MARK"
}

FINISHED=0
finish() { # the verdict, the table (printed last, kept as summary.txt) and the 8 files in OUT
    [ "$FINISHED" = 1 ] && return
    FINISHED=1
    local status verdict tests_failed=0 pytest_cut=0 bench_cut=0
    [ "${pytest_rc:-0}" -eq 124 ] && pytest_cut=1
    # Whether a CUDA test failed or errored, from the JUnit report (a pytest stopped by its share
    # writes one too, with the tests it finished). Where the share's SIGINT landed while pytest
    # was still collecting, the modules it interrupted are reported as collection errors whose
    # cause is that KeyboardInterrupt: the cut, not a failure of the code.
    if [ -f "$WORK/cuda_tests.xml" ]; then
        "$PYTHON" -c 'import sys, xml.etree.ElementTree as ET
cut = sys.argv[2] == "1"
def failed(case):
    for kind in ("failure", "error"):
        for report in case.iter(kind):
            said = (report.get("message") or "") + (report.text or "")
            if not (cut and kind == "error" and "KeyboardInterrupt" in said):
                return True
    return False
sys.exit(any(failed(c) for c in ET.parse(sys.argv[1]).getroot().iter("testcase")))' \
            "$WORK/cuda_tests.xml" "$pytest_cut" 2>/dev/null || tests_failed=1
    fi
    case "${bench_rc:-0}" in 3 | 124) bench_cut=1 ;; esac
    if [ -n "$interrupted" ]; then
        status=124
        verdict="STOPPED: $interrupted"
    elif [ -n "$SETUP_FAILED" ]; then
        status=1
        verdict="FAILED: setup: $SETUP_FAILED"
    elif [ "$tests_failed" = 1 ]; then
        status=1
        verdict="FAILED: a CUDA test failed or errored (the rows above; pytest.log)"
    elif [ "${pytest_rc:-0}" -ne 0 ] && [ "$pytest_cut" = 0 ]; then
        status=1
        case "$pytest_rc" in
            5) verdict="FAILED: pytest collected no CUDA test" ;;
            *) verdict="FAILED: pytest exit code $pytest_rc" ;;
        esac
    elif [ "$cuda" -eq 0 ]; then
        status=2
        verdict="no CUDA device: the setup and the collection ran, the CUDA tests skipped, nothing was measured"
        if [ "$pytest_cut" = 1 ]; then
            verdict="$verdict (pytest not finished in its ${TEST_SHARE:-?} s share)"
        fi
    elif [ "${bench_rc:-0}" -ne 0 ] && [ "$bench_cut" = 0 ]; then
        status=1
        verdict="FAILED: a benchmark launch failed (exit code $bench_rc; bench.log)"
    elif [ "$pytest_cut" = 1 ] || [ "$bench_cut" = 1 ]; then
        status=3
        local parts=()
        [ "$pytest_cut" = 1 ] && parts+=("pytest, in its ${TEST_SHARE:-?} s share")
        [ "$bench_cut" = 1 ] && parts+=("the benchmark (the rows say which)")
        verdict="not finished in its share: $(IFS=';'; echo "${parts[*]}"); what ran passed"
    else
        status=0
        verdict="passed"
    fi
    local summary=$WORK/summary.txt
    echo
    "$PYTHON" scripts/ci/gpu_check_summary.py "$WORK" "${pytest_rc:--1}" "${bench_rc:--1}" "$status" \
        "$verdict" "$SETUP_S" "$TESTS_S" "$BENCH_RUN_S" "$((SECONDS - STARTED))" "$OUT" "$COMMAND" \
        >"$summary" 2>"$WORK/summary.err" ||
        {
            # The table's own failure must not lose the verdict.
            echo "== gpu_check summary (the table failed: $(tail -n 1 "$WORK/summary.err"))"
            echo "result  $verdict (exit code $status)"
        } >"$summary"
    # The 8 files, each at most 8 MiB (a log keeps its end); the archive holds the rest.
    local f
    for f in summary.txt machine.txt setup.log pytest.log cuda_tests.xml bench.json bench.log; do
        [ -f "$WORK/$f" ] && tail -c $((8 * MB)) "$WORK/$f" >"$OUT/$f"
    done
    local archive=$OUT/gpu_check.tar.gz
    tar -czf "$archive" -C "$WORK" --exclude=summary.err . 2>/dev/null
    if [ -f "$archive" ] && [ "$(stat -c %s "$archive")" -gt $((15 * MB)) ]; then
        # Too large to come back whole: the text files only (logs, metrics, configs, results).
        (cd "$WORK" && find . -type f \( -name '*.log' -o -name '*.json' -o -name '*.jsonl' \
            -o -name '*.yaml' -o -name '*.txt' -o -name '*.xml' \) -size -2M -print0 |
            tar -czf "$archive" --null -T -) 2>/dev/null
    fi
    cat "$summary"
    rm -rf "$WORK"
    [ "$OWN_VENV" = 1 ] && rm -rf "$VENV"
    exit "$status"
}

on_signal() { # a signal or the budget: the part in flight gets 2 s, then the table
    interrupted="${1} received after $((SECONDS - STARTED)) s"
    end_part 2
    finish
}
trap 'on_signal SIGTERM' TERM
trap 'on_signal SIGINT' INT
trap 'on_signal SIGHUP' HUP
# The whole budget, whatever a part does: a watchdog that sends this shell SIGTERM (the trap
# above stops the part in flight and writes the table). Reserve seconds are its margin.
# It sleeps a second at a time, so that once killed it leaves no sleep behind for long.
(
    end=$((STARTED + BUDGET - RESERVE / 2))
    while [ "$SECONDS" -lt "$end" ]; do sleep 1; done
    kill -TERM $$ 2>/dev/null
) </dev/null >/dev/null 2>&1 &
WATCHDOG=$!
trap 'kill $WATCHDOG 2>/dev/null; finish' EXIT

setup_fail() {
    SETUP_FAILED=$*
    echo "gpu_check: $*" >&2
    echo "gpu_check: setup log: setup.log (in the output folder)" >&2
    SETUP_S=$((SECONDS - STARTED))
    exit 1
}

echo "== setup: the $COMMAND command (budget ${BUDGET} s in all; output folder $OUT)"
# The torch this project supports, as pyproject.toml declares it, against the node's.
need=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml | head -n 1)
if ! torch_line=$("$PYTHON" - "$need" 2>&1 <<'EOF'
import re
import sys

need = sys.argv[1]
# The installed distribution's version, without importing torch (seconds with its CUDA
# libraries, and the import check below imports it anyway); a torch without package metadata
# (built in place) is imported for its version.
try:
    from importlib.metadata import PackageNotFoundError, version

    have_version = version("torch")
except PackageNotFoundError:
    try:
        import torch
    except Exception as exc:
        sys.exit(f"{sys.executable} cannot import torch ({exc}): set PYTHON to the node's "
                 "Python with torch")
    have_version = torch.__version__
have = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", have_version).groups())
if have < tuple(int(v) for v in need.split(".")[:2]):
    sys.exit(f"this project needs torch>={need} (pyproject.toml); {sys.executable} "
             f"has torch {have_version}")
print(f"{sys.executable}: Python {sys.version.split()[0]}, torch {have_version}")
EOF
); then
    setup_fail "$torch_line"
fi
echo "$torch_line"

if [ ! -x "$VPY" ]; then
    "$PYTHON" -m venv --system-site-packages --without-pip "$VENV" >>"$SETUP_LOG" 2>&1 ||
        setup_fail "'$PYTHON -m venv --system-site-packages' failed"
    # --system-site-packages shows the base interpreter's packages; where PYTHON is itself a venv
    # or a conda environment, its own site folders (and the user's) are added as well.
    purelib=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') ||
        setup_fail "the venv's Python does not run"
    "$PYTHON" - >"$purelib/_gpu_check_base.pth" <<'EOF' || setup_fail "cannot read $PYTHON's site folders"
import site

folders = list(site.getsitepackages())
if site.ENABLE_USER_SITE:
    folders.append(site.getusersitepackages())
print("import site; " + "; ".join(f"site.addsitedir({folder!r})" for folder in folders))
EOF
fi
if ! "$VPY" -m pip --version >>"$SETUP_LOG" 2>&1; then
    "$VPY" -m ensurepip --default-pip >>"$SETUP_LOG" 2>&1 || setup_fail "no pip for $VPY"
fi
pip_install() {
    "$VPY" -m pip install --no-index --find-links "$WHEELS" "$@" >>"$SETUP_LOG" 2>&1
}
# A venv kept by GPU_CHECK_VENV that already holds this tree's install (same place, same
# pyproject.toml and lane requirements) skips both installs: a second try on the node starts in
# seconds. The import check below still runs.
STAMP_FILE=$VENV/.gpu_check_installed
STAMP="$REPO $(cat pyproject.toml scripts/ci/gpu_lane_requirements.txt | cksum)"
if [ "$(cat "$STAMP_FILE" 2>/dev/null)" = "$STAMP" ]; then
    echo "the venv $VENV holds this tree's install: kept as it is"
else

    rm -f "$STAMP_FILE"
    # What the node lacks (Hydra, OmegaConf, the ANTLR runtime), from the wheel folder; pip
    # leaves what the node already has as it is.
    if ! pip_install -r scripts/ci/gpu_lane_requirements.txt; then
        tail -n 5 "$SETUP_LOG" >&2
        setup_fail "cannot install scripts/ci/gpu_lane_requirements.txt from the wheel folder" \
            "$WHEELS: make it with 'bash scripts/ci/gpu_wheels.sh DIR' on a machine that reaches" \
            "the package index, bring it along and set GPU_CHECK_WHEELS=DIR"
    fi
    grep -h "^Successfully installed" "$SETUP_LOG" | sed 's/^/installed from the wheel folder: /'
    # The project in place (edits made on the node take effect at once), without dependencies;
    # it needs setuptools >= 70.1, from the wheel folder where the node's is missing or older.
    if ! "$VPY" -c 'import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split(".")[:2])) < (70, 1))' 2>/dev/null; then
        pip_install "setuptools>=70.1" || setup_fail "setuptools>=70.1 is neither on the node nor in $WHEELS"
    fi
    "$VPY" -m pip install --no-index --no-deps --no-build-isolation -e . >>"$SETUP_LOG" 2>&1 ||
        setup_fail "installing the project (pip install --no-deps --no-build-isolation -e .) failed"
fi
# Everything the CUDA tests and the benchmark import, before any of them runs: tensorboard is a
# default logger, torchvision the ResNets' source. The same process, torch imported, writes what
# the machine section shows of torch and the devices (one interpreter start less on the node).
imports=$("$VPY" - "$REPO" "$WORK" 2>&1 <<'EOF'
import sys
from pathlib import Path

missing = []
for module in ("pytest", "pytest_timeout", "hydra", "omegaconf", "torchvision", "tensorboard",
               "sdnet_trainer"):
    try:
        __import__(module)
    except ImportError as exc:
        missing.append(f"{module} ({exc})")
if missing:
    sys.exit(f"cannot import {', '.join(missing)}")
import sdnet_trainer

if not Path(sdnet_trainer.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()):
    sys.exit(f"sdnet_trainer comes from {sdnet_trainer.__file__}, not {sys.argv[1]}")

import torch
import torch.distributed as dist

work = Path(sys.argv[2])
lines = [f"torch {torch.__version__}, built for CUDA {torch.version.cuda}"]
(work / "cuda_available").write_text("1" if torch.cuda.is_available() else "0")
(work / "torch.txt").write_text(f"{torch.__version__} (CUDA {torch.version.cuda})")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(
            f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, compute {p.major}.{p.minor}"
        )
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
    lines.append(f"cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}")
else:
    lines.append("torch.cuda.is_available() is False: the CUDA tests will skip")
(work / "torch_devices.txt").write_text("\n".join(lines) + "\n")
EOF
) || setup_fail "the venv lacks what the CUDA tests need: $imports"
echo "$STAMP" >"$STAMP_FILE"
SETUP_S=$((SECONDS - STARTED))

echo
echo "== machine"
# An offline node's host name may not resolve: torchrun's --standalone, gloo and NCCL then look
# it up and fail. Loopback serves one node.
if ! "$VPY" -c 'import socket; socket.getaddrinfo(socket.gethostname(), None)' 2>/dev/null; then
    export PET_LOCAL_ADDR=127.0.0.1 MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
    HOST_NOTE="host name $(hostname) does not resolve: rendezvous, gloo and NCCL on loopback (127.0.0.1, lo)"
else
    HOST_NOTE="host name $(hostname) resolves"
fi
# Loader workers hand batches over in shared memory: ResNet-50's take several GB, more than a
# container's default 64 MB /dev/shm. Grow it where this process may; else bench_gpu.py sizes its
# workers to what is there (its default_workers).
shm_kb() { df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 { print $2 }'; }
SHM_NOTE="/dev/shm: $(($(shm_kb || echo 0) / 1024)) MiB"
if [ "$(shm_kb || echo 0)" -lt $((8 * 1024 * 1024)) ]; then
    if mount -o remount,size=16g /dev/shm 2>/dev/null; then
        SHM_NOTE="$SHM_NOTE, remounted at $(($(shm_kb) / 1024)) MiB"
    else
        SHM_NOTE="$SHM_NOTE (could not grow it: the benchmark's loader workers are sized to it)"
    fi
fi
{
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi
    else
        echo "nvidia-smi: not found"
    fi
    echo "$HOST_NOTE"
    echo "$SHM_NOTE"
    echo "$(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo) memory"
    cat "$WORK/torch_devices.txt" # written by the import check
} 2>&1 | tee "$WORK/machine.txt"
cuda=$(cat "$WORK/cuda_available" 2>/dev/null || echo 0)

# The shares: pytest gets GPU_CHECK_TEST_S or what is left, whichever is less; the benchmark
# what remains after it (or GPU_CHECK_BENCH_S). Each share leaves the grace period for its end.
TEST_SHARE=$(($(left) - GRACE))
[ "$TEST_S" -lt "$TEST_SHARE" ] && TEST_SHARE=$TEST_S
echo
echo "== pytest tests/cuda ${SELECT[*]} (${TEST_TIMEOUT} s per test, ${TEST_SHARE} s in all)"
tests_started=$SECONDS
if [ "$TEST_SHARE" -lt 1 ]; then
    pytest_rc=124
    echo "gpu_check: no time left for the tests" | tee "$WORK/pytest.log"
else
    run_part pytest "$TEST_SHARE" "$WORK/pytest.log" "$VPY" -m pytest tests/cuda \
        -p no:cacheprovider -rfEs --durations=0 --durations-min=1 --timeout="$TEST_TIMEOUT" \
        --junitxml="$WORK/cuda_tests.xml" ${SELECT[@]+"${SELECT[@]}"} "$@"
    pytest_rc=$part_rc
fi
TESTS_S=$((SECONDS - tests_started))

if [ "${GPU_CHECK_BENCH:-1}" != "0" ] && [ "$cuda" = "1" ]; then
    BENCH_SHARE=$(($(left) - GRACE))
    if [ -n "$BENCH_S" ] && [ "$BENCH_S" -lt "$BENCH_SHARE" ]; then
        BENCH_SHARE=$BENCH_S
    fi
    echo
    echo "== scripts/bench/bench_gpu.py ${BENCH_ARGS:-(full)} (${BENCH_SHARE} s)"
    bench_started=$SECONDS
    if [ "$BENCH_SHARE" -lt 30 ]; then
        bench_rc=124
        echo "gpu_check: ${BENCH_SHARE} s left: not enough for the benchmark" | tee "$WORK/bench.log"
    else
        # bench_gpu.py plans its launches within --budget-s (it skips what would not fit and
        # writes bench.json after each section); the share's end is the backstop.
        # shellcheck disable=SC2086 # BENCH_ARGS is a list of words
        run_part bench "$BENCH_SHARE" "$WORK/bench.log" "$VPY" scripts/bench/bench_gpu.py $BENCH_ARGS \
            --budget-s "$((BENCH_SHARE - 5))" --json "$WORK/bench.json" --out "$WORK/bench"
        bench_rc=$part_rc
    fi
    BENCH_RUN_S=$((SECONDS - bench_started))
fi

if [ "$COMMAND" != "second" ] && [ "$cuda" = "1" ] && [ "$(left)" -gt $((60 + 2 * GRACE)) ]; then
    # parallel=auto's constants measured on this GPU (docs/parallel.md): a minute at most, with
    # what the benchmark left; the file goes back in the archive.
    echo
    echo "== python -m sdnet_trainer.plan.calibrate (60 s at most)"
    run_part calibrate 60 "$WORK/calibrate.log" "$VPY" -m sdnet_trainer.plan.calibrate \
        out="$WORK/calibration.json"
fi
finish
