#!/usr/bin/env bash
# The GPU check in one command, on a node with one NVIDIA GPU, its own torch and no network
# (docs/gpu.md). It uses the node's Python as it is: a throwaway venv on top of it
# (--system-site-packages: the node's torch, torchvision, pytest, ...), the packages the node lacks
# installed there from a wheel folder made beforehand by scripts/gpu_wheels.sh (pip never reads an
# index), and the project installed in place without dependencies. Then it shows the machine
# (nvidia-smi, torch, CUDA, cuDNN, NCCL), runs the CUDA tests (tests/cuda only, -m cuda), runs a
# short scripts/bench_gpu.py, and prints one table, last: the tests' counts, the benchmark figures
# and the time each part took.
#   bash scripts/gpu_wheels.sh gpu_wheels          # beforehand, where the package index is reached
#   bash scripts/gpu_check.sh                      # on the node: at most about 9 minutes on one H100
#   bash scripts/gpu_check.sh -k fit               # extra arguments go to pytest
#   GPU_CHECK_FULL=1 bash scripts/gpu_check.sh     # the long version: every CUDA test, 3 rounds
#                                                  # of the benchmark and its loader section
# The default profile leaves out three slow CUDA tests that others cover (the compiled and
# profiled gpt_tiny fit, ZeRO-1 on the one-rank NCCL group, FSDP2 over gloo on two ranks) and runs
# bench_gpu.py --quick; a -k of your own replaces that selection.
# Environment:
#   PYTHON                    the node's Python, with its torch (default python3)
#   GPU_CHECK_WHEELS=DIR      the wheel folder (default ./gpu_wheels)
#   GPU_CHECK_OUT=DIR         the table (summary.txt), logs, JUnit report, benchmark results
#                             (default: a new temporary folder)
#   GPU_CHECK_VENV=DIR        keep the venv there and reuse it on the next run (default: a
#                             temporary one, removed at the end)
#   GPU_CHECK_BENCH=0         the tests only
#   GPU_CHECK_TEST_TIMEOUT=S  seconds per CUDA test (default 240)
#   GPU_CHECK_PYTEST_TIMEOUT=S  seconds for the whole pytest step (default 270; 2400 with FULL)
# Exit status: 1 if the setup failed, a CUDA test failed or errored, or pytest could not run,
# collect or finish in time; else 2 without a CUDA device (the setup and the collection done, the
# tests skipped, nothing measured); else 3 if the benchmark failed; else 0.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-$REPO/gpu_wheels}
FULL=${GPU_CHECK_FULL:-0}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-240}
if [ "$FULL" = "1" ]; then
    PYTEST_TIMEOUT=${GPU_CHECK_PYTEST_TIMEOUT:-2400}
    SELECT=()
    BENCH_ARGS=()
    BENCH_TIMEOUT=2400
else
    PYTEST_TIMEOUT=${GPU_CHECK_PYTEST_TIMEOUT:-270}
    SELECT=(-k "not (compiled_and_profiled and gpt_tiny) and not (nccl_process_group and zero1) and not fsdp_over_gloo")
    BENCH_ARGS=(--quick)
    BENCH_TIMEOUT=240
fi
OUT=${GPU_CHECK_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
SETUP_LOG=$OUT/setup.log
: >"$SETUP_LOG"
STARTED=$SECONDS

# Never the network: pip reads no index and no configuration that could name one.
export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

fail() {
    echo "gpu_check: $*" >&2
    echo "gpu_check: setup log: $SETUP_LOG" >&2
    exit 1
}

echo "== setup (log: $SETUP_LOG)"
# The torch this project supports, as pyproject.toml declares it, against the node's.
need=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml | head -n 1)
"$PYTHON" - "$need" <<'EOF' || exit 1
import re
import sys

need = sys.argv[1]
try:
    import torch
except Exception as exc:
    sys.exit(f"gpu_check: {sys.executable} cannot import torch ({exc}): set PYTHON to the node's "
             "Python with torch")
have = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
if have < tuple(int(v) for v in need.split(".")[:2]):
    sys.exit(f"gpu_check: this project needs torch>={need} (pyproject.toml); {sys.executable} "
             f"has torch {torch.__version__}")
print(f"{sys.executable}: Python {sys.version.split()[0]}, torch {torch.__version__}")
EOF

VENV=${GPU_CHECK_VENV:-}
if [ -z "$VENV" ]; then
    VENV=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_venv.XXXXXX") || exit 1
    trap 'rm -rf "$VENV"' EXIT
fi
VPY=$VENV/bin/python
if [ ! -x "$VPY" ]; then
    "$PYTHON" -m venv --system-site-packages --without-pip "$VENV" >>"$SETUP_LOG" 2>&1 ||
        fail "'$PYTHON -m venv --system-site-packages' failed"
    # --system-site-packages shows the base interpreter's packages; where PYTHON is itself a venv
    # or a conda environment, its own site folders (and the user's) are added as well.
    purelib=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || exit 1
    "$PYTHON" - >"$purelib/_gpu_check_base.pth" <<'EOF' || exit 1
import site

folders = list(site.getsitepackages())
if site.ENABLE_USER_SITE:
    folders.append(site.getusersitepackages())
print("import site; " + "; ".join(f"site.addsitedir({folder!r})" for folder in folders))
EOF
fi
if ! "$VPY" -m pip --version >>"$SETUP_LOG" 2>&1; then
    "$VPY" -m ensurepip --default-pip >>"$SETUP_LOG" 2>&1 || fail "no pip for $VPY"
fi
pip_install() {
    "$VPY" -m pip install --no-index --find-links "$WHEELS" "$@" >>"$SETUP_LOG" 2>&1
}

# What the node lacks (Hydra, OmegaConf, the ANTLR runtime), from the wheel folder; pip leaves
# what the node already has as it is.
if ! pip_install -r scripts/gpu_lane_requirements.txt; then
    tail -n 5 "$SETUP_LOG" >&2
    fail "cannot install scripts/gpu_lane_requirements.txt from the wheel folder $WHEELS: make it" \
        "with 'bash scripts/gpu_wheels.sh DIR' on a machine that reaches the package index, bring" \
        "it along and set GPU_CHECK_WHEELS=DIR"
fi
grep -h "^Successfully installed" "$SETUP_LOG" | sed 's/^/installed from the wheel folder: /'
# The project in place (edits made on the node take effect at once), without dependencies; it
# needs setuptools >= 70.1, from the wheel folder where the node's is missing or older.
if ! "$VPY" -c 'import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split(".")[:2])) < (70, 1))' 2>/dev/null; then
    pip_install "setuptools>=70.1" || fail "setuptools>=70.1 is neither on the node nor in $WHEELS"
fi
"$VPY" -m pip install --no-index --no-deps --no-build-isolation -e . >>"$SETUP_LOG" 2>&1 ||
    fail "installing the project (pip install --no-deps --no-build-isolation -e .) failed"
"$VPY" - "$REPO" <<'EOF' || fail "the venv lacks what the CUDA tests need"
import sys
from pathlib import Path

missing = []
for module in ("pytest", "pytest_timeout", "hydra", "omegaconf", "sdnet_trainer"):
    try:
        __import__(module)
    except ImportError as exc:
        missing.append(f"{module} ({exc})")
if missing:
    sys.exit(f"gpu_check: cannot import {', '.join(missing)}")
import sdnet_trainer

if not Path(sdnet_trainer.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()):
    sys.exit(f"gpu_check: sdnet_trainer comes from {sdnet_trainer.__file__}, not {sys.argv[1]}")
EOF
SETUP_S=$((SECONDS - STARTED))

echo
echo "== machine"
{
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi
    else
        echo "nvidia-smi: not found"
    fi
    "$VPY" - "$OUT/cuda_available" <<'EOF'
import sys
from pathlib import Path

import torch
import torch.distributed as dist

print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}")
Path(sys.argv[1]).write_text("1" if torch.cuda.is_available() else "0")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, compute {p.major}.{p.minor}")
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
    print(f"cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}")
else:
    print("torch.cuda.is_available() is False: the CUDA tests will skip")
EOF
} 2>&1 | tee "$OUT/machine.txt"

echo
echo "== pytest tests/cuda -m cuda (${TEST_TIMEOUT} s per test, ${PYTEST_TIMEOUT} s in all)"
tests_started=$SECONDS
timeout -k 10 "$PYTEST_TIMEOUT" "$VPY" -m pytest tests/cuda -m cuda -rs -p no:cacheprovider \
    --timeout="$TEST_TIMEOUT" --junitxml="$OUT/cuda_tests.xml" ${SELECT[@]+"${SELECT[@]}"} "$@" 2>&1 |
    tee "$OUT/pytest.log"
pytest_rc=${PIPESTATUS[0]}
TESTS_S=$((SECONDS - tests_started))
cuda=$(cat "$OUT/cuda_available" 2>/dev/null || echo 0)

bench_rc=0
BENCH_S=0
if [ "${GPU_CHECK_BENCH:-1}" != "0" ]; then
    echo
    echo "== scripts/bench_gpu.py ${BENCH_ARGS[*]:-(full)}"
    bench_started=$SECONDS
    timeout -k 10 "$BENCH_TIMEOUT" "$VPY" scripts/bench_gpu.py ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} \
        --json "$OUT/bench.json" --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
    bench_rc=${PIPESTATUS[0]}
    BENCH_S=$((SECONDS - bench_started))
fi

# The verdict, then the table (scripts/gpu_check_summary.py: printed last, kept as summary.txt).
if [ "$pytest_rc" -ne 0 ]; then
    status=1
    if [ "$pytest_rc" -eq 124 ] || [ "$pytest_rc" -eq 137 ]; then
        verdict="FAILED: pytest did not finish within ${PYTEST_TIMEOUT} s"
    elif [ "$pytest_rc" -eq 5 ]; then
        verdict="FAILED: pytest collected no CUDA test"
    else
        verdict="FAILED: pytest exit code $pytest_rc"
    fi
elif [ "$cuda" -eq 0 ]; then
    status=2
    verdict="no CUDA device: the setup and the collection ran, the CUDA tests skipped, nothing was measured"
elif [ "$bench_rc" -ne 0 ]; then
    status=3
    verdict="the CUDA tests passed; the benchmark FAILED (exit code $bench_rc, see bench.log)"
else
    status=0
    verdict="passed"
fi

echo
"$VPY" scripts/gpu_check_summary.py "$OUT" "$pytest_rc" "$bench_rc" "$status" "$verdict" \
    "$SETUP_S" "$TESTS_S" "$BENCH_S" "$((SECONDS - STARTED))" | tee "$OUT/summary.txt"
exit "$status"
