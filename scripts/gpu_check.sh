#!/usr/bin/env bash
# The GPU check in one command, on a machine with one NVIDIA GPU: install the project with its
# test extras into ./.venv (created if missing), show the machine (nvidia-smi, torch, CUDA,
# cuDNN, NCCL), run the CUDA tests (pytest -m cuda, tests/cuda/), run scripts/bench_gpu.py, and
# print one table: the tests' pass/fail counts and the benchmark figures.
#   bash scripts/gpu_check.sh                     # about 15 minutes on one H100
#   bash scripts/gpu_check.sh -k fit              # extra arguments go to pytest
#   GPU_CHECK_BENCH=0 bash scripts/gpu_check.sh   # the tests only
#   GPU_CHECK_OUT=/tmp/gpu bash scripts/gpu_check.sh   # keep the outputs there (default: a temp dir)
#   GPU_CHECK_INSTALL=0 bash scripts/gpu_check.sh # use .venv as it is (no pip install)
# Exit status: 1 if a CUDA test failed or errored (or pytest could not run), else 2 without a CUDA
# device (the tests skip and nothing is measured), else 3 if the benchmark failed, else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$OUT"

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv || exit 1
fi
# GPU machines are often offline: with the project and the test tools already in .venv, a failed
# install is a warning, not the end of the check.
if [ "${GPU_CHECK_INSTALL:-1}" != "0" ] && ! .venv/bin/python -m pip install --quiet -e '.[test]'; then
    echo "gpu_check: installing '.[test]' failed (offline?); trying the .venv as it is" >&2
fi
if ! .venv/bin/python -c 'import sdnet_trainer, pytest, pytest_timeout' 2>/dev/null; then
    echo "gpu_check: .venv lacks the project or its test tools: pip install -e '.[test]'" >&2
    exit 1
fi

echo "== machine"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi
else
    echo "nvidia-smi: not found"
fi
.venv/bin/python - <<'EOF'
import torch
import torch.distributed as dist

print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, compute {p.major}.{p.minor}")
    print(f"cuDNN {torch.backends.cudnn.version()}, NCCL "
          f"{'.'.join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else 'none'}")
else:
    print("torch.cuda.is_available() is False: the CUDA tests will skip")
EOF

echo
echo "== pytest -m cuda -rs"
.venv/bin/python -m pytest -m cuda -rs --junitxml="$OUT/cuda_tests.xml" "$@" 2>&1 | tee "$OUT/pytest.log"
pytest_rc=${PIPESTATUS[0]}

bench_rc=0
if [ "${GPU_CHECK_BENCH:-1}" != "0" ]; then
    echo
    echo "== scripts/bench_gpu.py"
    .venv/bin/python scripts/bench_gpu.py --json "$OUT/bench.json" --out "$OUT/bench" 2>&1 \
        | tee "$OUT/bench.log"
    bench_rc=${PIPESTATUS[0]}
fi

echo
.venv/bin/python - "$OUT" "$pytest_rc" "$bench_rc" <<'EOF'
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, pytest_rc, bench_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rows = []
report = out / "cuda_tests.xml"
if report.exists():
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    rows.append(("cuda tests", f"{passed} passed, {count['failures']} failed, "
                               f"{count['errors']} errors, {count['skipped']} skipped"))
else:
    rows.append(("cuda tests", f"no report (pytest exit code {pytest_rc})"))


def num(value, fmt="{:,.0f}"):
    return "n/a" if value is None else fmt.format(value)


bench = out / "bench.json"
if bench.exists():
    figures = json.loads(bench.read_text())
    rows.append(("device", figures.get("device", "?")))
    resnet = figures.get("resnet50")
    if resnet:
        for side in ("trainer", "hand"):
            cell = resnet[side]
            rows.append((f"resnet50 bf16 images/s, {side}",
                         cell["failed"] or num(cell["images_per_s"])))
        rows.append(("resnet50 trainer / hand", num(resnet["ratio"], "{:.3f}")))
        rows.append(("resnet50 A100 AMP, NVIDIA (context)", "2,470"))
    gpt = figures.get("gpt_1b")
    if gpt:
        rows.append(("gpt_1b tokens/s", gpt.get("failed") or num(gpt.get("tokens_per_s"))))
        rows.append(("gpt_1b MFU", num(gpt.get("mfu"), "{:.1%}")))
    loader = figures.get("loader")
    if loader:
        rows.append(("loader JPEG images/s per core", num(loader["images_per_s_per_core"])))
        rows.append(("cores to feed the Trainer's resnet50",
                     num(loader.get("cores_for_trainer_rate"), "{:.1f}")))
elif bench_rc == 2:
    rows.append(("benchmarks", "not run: no CUDA device"))
elif bench_rc:
    rows.append(("benchmarks", f"failed (exit code {bench_rc}); see {out / 'bench.log'}"))
else:
    rows.append(("benchmarks", "skipped (GPU_CHECK_BENCH=0)"))

width = max(len(name) for name, _ in rows)
print(f"== gpu_check summary (outputs in {out})")
for name, value in rows:
    print(f"{name:<{width}}  {value}")
EOF

# pytest's 5 (nothing collected) means the CUDA tests are missing: a failure here as well.
if [ "$pytest_rc" -ne 0 ]; then
    exit 1
fi
if ! .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device: the CUDA tests skipped and nothing was measured" >&2
    exit 2
fi
if [ "$bench_rc" -ne 0 ]; then
    exit 3
fi
exit 0
