"""scripts/gpu_check.sh's closing table: the CUDA tests' counts (its JUnit report), the benchmark's
figures (scripts/bench_gpu.py's --json), the time each part took and the verdict.

    python scripts/gpu_check_summary.py OUT PYTEST_RC BENCH_RC STATUS VERDICT \\
        SETUP_S TESTS_S BENCH_S TOTAL_S

OUT is the check's output folder (cuda_tests.xml, bench.json); the table goes to stdout.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

# NVIDIA's published ResNet-50 v1.5 AMP training figure for one A100 80GB (bench_gpu.py's
# A100_AMP_IMAGES_PER_S), quoted for context.
A100_AMP_IMAGES_PER_S = "2,470"


def num(value: float | None, fmt: str = "{:,.0f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def test_rows(out: Path, pytest_rc: int) -> list[tuple[str, str]]:
    report = out / "cuda_tests.xml"
    if not report.exists():
        return [("cuda tests", f"no report (pytest exit code {pytest_rc})")]
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    return [
        (
            "cuda tests",
            f"{passed} passed, {count['failures']} failed, {count['errors']} errors, "
            f"{count['skipped']} skipped",
        )
    ]


def bench_rows(figures: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("device", figures.get("device", "?"))]
    resnet = figures.get("resnet50")
    if resnet:
        for side in ("trainer", "hand"):
            cell = resnet[side]
            rows.append(
                (
                    f"resnet50 bf16 channels_last images/s, {side}",
                    cell["failed"] or num(cell["images_per_s"]),
                )
            )
        rows.append(("resnet50 trainer / hand (paired)", num(resnet["ratio"], "{:.3f}")))
        rows.append(("resnet50 A100 AMP, NVIDIA (context)", A100_AMP_IMAGES_PER_S))
    # The decoder sections bench_gpu.py ran (gpt_1b, llama3_1b), in its order.
    for name in figures.get("decoders", ()):
        cell = figures[name]
        rows.append((f"{name} tokens/s", cell.get("failed") or num(cell.get("tokens_per_s"))))
        rows.append((f"{name} MFU", num(cell.get("mfu"), "{:.1%}")))
    loader = figures.get("loader")
    if loader:
        rows.append(("loader JPEG images/s per core", num(loader["images_per_s_per_core"])))
        rows.append(
            (
                "cores to feed the Trainer's resnet50",
                num(loader.get("cores_for_trainer_rate"), "{:.1f}"),
            )
        )
    return rows


def no_bench_row(bench_rc: int) -> tuple[str, str]:
    if bench_rc == 2:
        return ("benchmarks", "not run: no CUDA device")
    if bench_rc in (124, 137):
        return ("benchmarks", "did not finish in time; see bench.log")
    if bench_rc:
        return ("benchmarks", f"failed (exit code {bench_rc}); see bench.log")
    return ("benchmarks", "skipped (GPU_CHECK_BENCH=0)")


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    pytest_rc, bench_rc, status = map(int, argv[1:4])
    verdict = argv[4]
    setup_s, tests_s, bench_s, total_s = map(int, argv[5:9])
    rows = [("torch", f"{torch.__version__} (CUDA {torch.version.cuda})")]
    rows += test_rows(out, pytest_rc)
    bench = out / "bench.json"
    if bench.exists():
        rows += bench_rows(json.loads(bench.read_text()))
    else:
        rows.append(no_bench_row(bench_rc))
    rows.append(
        ("seconds: setup, tests, benchmark, all", f"{setup_s}, {tests_s}, {bench_s}, {total_s}")
    )
    rows.append(("result", f"{verdict} (exit code {status})"))
    width = max(len(name) for name, _ in rows)
    print(f"== gpu_check summary (outputs in {out})")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
