"""scripts/ci/gpu_check.sh's closing table: the CUDA tests' counts, failures and slowest tests (its
JUnit report), the benchmark's figures (scripts/bench/bench_gpu.py's --json) with each throughput's
achieved TFLOP/s beside the bf16 matmul measured in the same run, the time each part took and the
verdict.

    python scripts/ci/gpu_check_summary.py FOLDER PYTEST_RC BENCH_RC STATUS VERDICT \\
        SETUP_S TESTS_S BENCH_S TOTAL_S [SHOWN]

FOLDER holds torch.txt, cuda_tests.xml and bench.json; SHOWN is the folder the header names
(where the check's files end up; default FOLDER). A return code of -1 means the part did not run.
The table goes to stdout.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# NVIDIA's published ResNet-50 v1.5 AMP training figure for one A100 80GB (bench_gpu.py's
# A100_AMP_IMAGES_PER_S), quoted for context.
A100_AMP_IMAGES_PER_S = "2,470"
# Failed tests named one per row, at most; the rest are counted (pytest.log has them all).
MAX_FAILURE_ROWS = 8
SLOWEST = 3


def num(value: float | None, fmt: str = "{:,.0f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _case_name(case: ET.Element) -> str:
    module = case.get("classname", "").rsplit(".", 1)[-1]
    return f"{module}::{case.get('name', '?')}"


def test_rows(out: Path, pytest_rc: int) -> list[tuple[str, str]]:
    report = out / "cuda_tests.xml"
    if not report.exists():
        said = "did not run" if pytest_rc == -1 else f"pytest exit code {pytest_rc}"
        return [("cuda tests", f"no report ({said})")]
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    rows = [
        (
            "cuda tests",
            f"{passed} passed, {count['failures']} failed, {count['errors']} errors, "
            f"{count['skipped']} skipped",
        )
    ]
    # What failed, by name and the first line of its message: the console keeps only the end.
    cases = list(root.iter("testcase"))
    failed = []
    for case in cases:
        for kind in ("failure", "error"):
            problem = case.find(kind)
            if problem is not None:
                message = (problem.get("message") or problem.text or "").strip().splitlines()
                failed.append((f"{kind}: {_case_name(case)}", (message or ["?"])[0][:160]))
    rows += failed[:MAX_FAILURE_ROWS]
    if len(failed) > MAX_FAILURE_ROWS:
        rows.append(("more failures", f"{len(failed) - MAX_FAILURE_ROWS} (see pytest.log)"))
    ran = [c for c in cases if c.find("skipped") is None]
    for case in sorted(ran, key=lambda c: -float(c.get("time", 0)))[:SLOWEST]:
        rows.append((f"slow: {_case_name(case)}", f"{float(case.get('time', 0)):.0f} s"))
    return rows


def tflops_text(tflops: float) -> str:
    """Whole TFLOP/s from 100 up (a GPU's range), three significant digits below."""
    return f"{tflops:,.0f}" if tflops >= 100 else f"{tflops:.3g}"


def achieved(tflops: float | None, peak: float | None) -> str:
    """``tflops`` and its share of the measured matmul peak."""
    if tflops is None:
        return ""
    share = f", {tflops / peak:.0%} of the matmul" if peak else ""
    return f" ({tflops_text(tflops)} TFLOP/s{share})"


def bench_rows(figures: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("device", figures.get("device", "?"))]
    matmul = figures.get("matmul")
    peak = matmul["tflops_per_s"] if matmul else None
    if matmul:
        rows.append(
            (
                f"matmul {matmul['dtype']} {matmul['size']}^3 (practical peak)",
                f"{tflops_text(matmul['tflops_per_s'])} TFLOP/s",
            )
        )
    resnet = figures.get("resnet50")
    if resnet:
        for side in ("trainer", "hand"):
            cell = resnet[side]
            if cell["failed"] or cell["images_per_s"] is None:
                value = cell["failed"] or "not run: the budget ran out"
            else:
                value = num(cell["images_per_s"]) + achieved(cell.get("tflops_per_s"), peak)
            rows.append((f"resnet50 bf16 channels_last images/s, {side}", value))
        rows.append(("resnet50 trainer / hand (paired)", num(resnet["ratio"], "{:.3f}")))
        rows.append(("resnet50 A100 AMP, NVIDIA (context)", A100_AMP_IMAGES_PER_S))
    # The decoder sections bench_gpu.py ran (gpt_1b, llama3_1b), in its order.
    for name in figures.get("decoders", ()):
        cell = figures[name]
        value = cell.get("failed") or num(cell.get("tokens_per_s"))
        if not cell.get("failed"):
            value += achieved(cell.get("tflops_per_s"), peak)
        rows.append((f"{name} tokens/s", value))
        rows.append((f"{name} MFU (datasheet peak)", num(cell.get("mfu"), "{:.1%}")))
        # The same launch with float8 matmuls (bench_gpu.py's float8 sections): tokens/s compare,
        # the MFU would count its FLOPs against the bf16 peak.
        float8 = cell.get("float8")
        if float8:
            value = float8.get("failed") or (
                f"{num(float8['tokens_per_s'])} ({float8['speedup']:.2f}x bf16)"
            )
            rows.append((f"{name} float8 {float8['recipe']} tokens/s", value))
    loader = figures.get("loader")
    if loader:
        rows.append(("loader JPEG images/s per core", num(loader["images_per_s_per_core"])))
        rows.append(
            (
                "cores to feed the Trainer's resnet50",
                num(loader.get("cores_for_trainer_rate"), "{:.1f}"),
            )
        )
    if figures.get("skipped"):
        rows.append(("benchmark left out (budget)", ", ".join(figures["skipped"])))
    return rows


def no_bench_row(bench_rc: int) -> tuple[str, str]:
    if bench_rc == -1:
        return ("benchmarks", "not run: no CUDA device, or GPU_CHECK_BENCH=0")
    if bench_rc == 2:
        return ("benchmarks", "not run: no CUDA device")
    if bench_rc in (124, 137):
        return ("benchmarks", "did not finish in time; see bench.log")
    if bench_rc:
        return ("benchmarks", f"failed (exit code {bench_rc}); see bench.log")
    return ("benchmarks", "no figures written")


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    pytest_rc, bench_rc, status = map(int, argv[1:4])
    verdict = argv[4]
    setup_s, tests_s, bench_s, total_s = map(int, argv[5:9])
    shown = argv[9] if len(argv) > 9 else str(out)
    # Written by the check's machine step (this table does not import torch: seconds, on every
    # path, and a node whose torch is broken still gets its table).
    torch_file = out / "torch.txt"
    rows = [("torch", torch_file.read_text().strip() if torch_file.exists() else "not read")]
    rows += test_rows(out, pytest_rc)
    bench = out / "bench.json"
    if bench.exists():
        rows += bench_rows(json.loads(bench.read_text()))
        if bench_rc in (124, 137):
            rows.append(("benchmarks", "stopped at the end of its share: the figures it finished"))
    else:
        rows.append(no_bench_row(bench_rc))
    rows.append(
        ("seconds: setup, tests, benchmark, all", f"{setup_s}, {tests_s}, {bench_s}, {total_s}")
    )
    rows.append(("result", f"{verdict} (exit code {status})"))
    width = max(len(name) for name, _ in rows)
    print(f"== gpu_check summary (outputs in {shown})")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
