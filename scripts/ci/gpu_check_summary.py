"""scripts/ci/gpu_check.sh's closing table: the CUDA tests' counts, failures and slowest tests (its
JUnit report), the benchmark's figures (scripts/bench/bench_gpu.py's --json) with each throughput's
achieved TFLOP/s beside the bf16 matmul measured in the same run, the time each part took and the
verdict.

    python scripts/ci/gpu_check_summary.py FOLDER PYTEST_RC BENCH_RC STATUS VERDICT \\
        SETUP_S TESTS_S BENCH_S TOTAL_S [SHOWN [COMMAND]]

FOLDER holds torch.txt, cuda_tests.xml and bench.json; SHOWN is the folder the header names
(where the check's files end up; default FOLDER); COMMAND is which of the check's commands ran
(first, second or full; default first). A return code of -1 means the part did not run. The
table goes to stdout; its last part names, for every GPU claim of the docs (CLAIMS), whether this
run measured it.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
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
    # The second command's sections (bench_gpu.py --second): a row per variant, against the one
    # it is compared with.
    for section in figures.get("variant_sections", ()):
        rows_of = figures[section]["rows"]
        for row in rows_of.values():
            rows.append((f"{section}: {row['label']}", variant_cell(row, rows_of)))
        if figures[section].get("float8_not_run"):
            rows.append((f"{section}: float8", f"not run: {figures[section]['float8_not_run']}"))
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
    if figures.get("cut"):
        rows.append(("not finished in its share", ", ".join(figures["cut"])))
    return rows


# ---------------------------------------------------------------------------- the claims
# Every GPU claim docs/gpu.md and the README make, with the command that measures it and its
# evidence: bench.json's figures (a section, or variants of one) or CUDA tests that passed (a
# JUnit classname's module, optionally a test name's start). docs/gpu.md lists the same claims
# (tests/unit/test_gpu_check.py holds the two together).


@dataclass(frozen=True)
class Claim:
    text: str
    command: str  # first | second | full: the command of the check that measures it
    bench: str | None = None  # a bench.json section
    variants: tuple[str, ...] = ()  # of that section: these variants' rows
    tests: str | None = None  # tests/cuda module (and ::name start) whose tests must pass
    file: str | None = None  # a file the check writes beside the table where it measured it


CLAIMS = (
    Claim("bf16 matmul, sustained (the practical peak)", "first", bench="matmul"),
    Claim("ResNet-50 through the Trainer against a hand-written loop", "first", bench="resnet50"),
    Claim("gpt_1b tokens/s and MFU on one GPU", "first", bench="gpt_1b"),
    Claim("llama3_1b tokens/s and MFU on one GPU", "first", bench="llama3_1b"),
    Claim(
        "float8 rowwise and tensorwise against bf16 on llama3_1b, eager",
        "second",
        bench="llama3_1b_variants",
        variants=("float8_rowwise_eager", "float8_tensorwise_eager"),
    ),
    Claim(
        "float8 rowwise and tensorwise against bf16 on llama3_1b, compiled",
        "second",
        bench="llama3_1b_variants",
        variants=("float8_rowwise_compiled", "float8_tensorwise_compiled"),
    ),
    Claim(
        "FSDP2 on one GPU against the plain model (llama3_1b)",
        "second",
        bench="llama3_1b_variants",
        variants=("fsdp2_eager",),
    ),
    Claim(
        "the MoE's grouped matmul in bf16 against the loop over experts",
        "second",
        bench="moe",
        variants=("loop",),
    ),
    Claim(
        "ring attention against the K/V all-gather and one process",
        "second",
        bench="cp",
        variants=("ring", "allgather"),
    ),
    Claim(
        "float8 training on the float8 kernels, FSDP2's float8 all-gather",
        "second",
        tests="test_float8_cuda",
    ),
    Claim(
        "context parallel (ring, all-gather) trains as one process",
        "second",
        tests="test_context_parallel_cuda",
    ),
    Claim("the MoE's grouped matmul equals the loop over experts", "second", tests="test_moe_cuda"),
    Claim(
        "replica groups on torchft's NCCL group: a killed NCCL subprocess loses only its step",
        "second",
        tests="test_ft_cuda",
    ),
    Claim(
        "one-GPU fits: bf16, channels_last, compile, profiler, memory snapshot",
        "first",
        tests="test_fit_cuda::test_one_gpu_fit",
    ),
    Claim(
        "DDP, FSDP2 and ZeRO-1 on a one-rank NCCL group",
        "first",
        tests="test_fit_cuda::test_one_rank_nccl",
    ),
    Claim(
        "DDP's CUDA wrapper on two ranks trains as one process",
        "first",
        tests="test_two_ranks_cuda",
    ),
    Claim("no host synchronisation on a non-log step", "first", tests="test_verdict_cuda"),
    Claim(
        "checkpoints: pinned staging reused, resume bitwise with dropout",
        "first",
        tests="test_checkpoint_cuda",
    ),
    Claim(
        "the loader's pinned side-stream copies and GPU decode", "first", tests="test_loader_cuda"
    ),
    Claim("the loader's JPEG images/s per core", "full", bench="loader"),
    Claim(
        "parallel=auto's constants measured on this GPU (calibration.json)",
        "first",
        file="calibration.json",
    ),
)


def _test_outcomes(out: Path) -> dict[str, str]:
    """Each CUDA test's outcome by ``module::name``: passed, failed or skipped."""
    report = out / "cuda_tests.xml"
    if not report.exists():
        return {}
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kind = next((k for k in ("failure", "error", "skipped") if case.find(k) is not None), None)
        outcome = {None: "passed", "skipped": "skipped"}.get(kind, "failed")
        outcomes[_case_name(case)] = outcome
    return outcomes


def claim_status(
    claim: Claim, figures: dict[str, Any], outcomes: dict[str, str], command: str, out: Path
) -> str:
    """Whether this run measured ``claim``, and if not, why not."""
    if claim.file is not None:
        if (out / claim.file).exists():
            return "measured"
    elif claim.tests is not None:
        found = [v for k, v in outcomes.items() if k.startswith(claim.tests)]
        if found and all(v == "passed" for v in found):
            return f"measured ({len(found)} tests passed)"
        if "failed" in found:
            return "FAILED (a test failed)"
        if found and "passed" in found:
            return f"partly ({found.count('passed')} of {len(found)} tests passed)"
        if found:
            return "not measured (skipped)"
    else:
        cell = figures.get(claim.bench or "")
        if claim.variants and cell:
            rows = [cell["rows"].get(v) for v in claim.variants]
            done = [r for r in rows if r is not None and not r.get("failed")]
            if len(done) == len(rows):
                return "measured"
            if done:
                return f"partly ({len(done)} of {len(rows)})"
            reasons = {str(r["failed"]) for r in rows if r is not None}
            if not reasons:  # float8's rows, where float8 could not run here
                reasons = {str(cell.get("float8_not_run") or "not run")}
            return f"not measured ({'; '.join(sorted(reasons))})"
        if cell and not claim.variants:
            failed = cell.get("failed") if isinstance(cell, dict) else None
            return f"not measured ({failed})" if failed else "measured"
    if command != claim.command and command != "full":
        return f"not measured: the {claim.command} command's"
    return "not measured (not run)"


def claim_rows(figures: dict[str, Any], out: Path, command: str) -> list[tuple[str, str]]:
    outcomes = _test_outcomes(out)
    return [
        (f"claim: {claim.text}", claim_status(claim, figures, outcomes, command, out))
        for claim in CLAIMS
    ]


def variant_cell(row: dict[str, Any], rows: dict[str, dict[str, Any]]) -> str:
    """tokens/s of a variant and, against its reference, the ratio and the largest relative gap
    between their losses at the log points; or why there are none."""
    if row.get("failed"):
        return str(row["failed"])
    text = f"{num(row['tokens_per_s'])} tokens/s"
    if row.get("ratio") is not None:
        versus = rows[row["versus"]]["label"]
        text += f" ({row['ratio']:.2f}x {versus}; losses within {row['loss_gap']:.1e})"
    return text


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
    command = argv[10] if len(argv) > 10 else "first"
    # Written by the check's machine step (this table does not import torch: seconds, on every
    # path, and a node whose torch is broken still gets its table).
    torch_file = out / "torch.txt"
    rows = [("torch", torch_file.read_text().strip() if torch_file.exists() else "not read")]
    rows.append(("command", command))
    rows += test_rows(out, pytest_rc)
    bench = out / "bench.json"
    figures: dict[str, Any] = {}
    if bench.exists():
        figures = json.loads(bench.read_text())
        rows += bench_rows(figures)
        if bench_rc in (124, 137):
            rows.append(("benchmarks", "stopped at the end of its share: the figures it finished"))
    else:
        rows.append(no_bench_row(bench_rc))
    rows += claim_rows(figures, out, command)
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
