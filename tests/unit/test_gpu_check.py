"""scripts/gpu_check.sh on a simulated GPU image, offline, on the CPU.

The image's Python is this environment's packages less what GPU images lack (Hydra, OmegaConf,
the ANTLR runtime, the serve extra, the linters, the project itself: tests.support.
gpu_image_python); the wheel folder holds what scripts/gpu_wheels.sh downloads, packed here from
the installed distributions (no index is reached). pip is pointed at no index and HTTP goes to a
dead proxy, so a check that tried the network fails here. Without a GPU the check must get
through its install and the collection of every CUDA test and exit 2 ("no CUDA device"), not 1.
The closing table's benchmark rows (scripts/gpu_check_summary.py) are checked on a bench.json
made here from scripts/bench_gpu.py's own summaries.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.metadata
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

from tests.support import REPO, gpu_image_python, run_command

SCRIPT = REPO / "scripts" / "gpu_check.sh"
# What scripts/gpu_lane_requirements.txt names: the wheels a GPU node gets from the folder.
LANE = ("hydra-core", "omegaconf", "antlr4-python3-runtime")
DEAD = "http://127.0.0.1:9"  # the discard port: nothing answers there
OFFLINE = {
    "PIP_NO_INDEX": "1",
    "PIP_INDEX_URL": f"{DEAD}/simple",
    "http_proxy": DEAD,
    "https_proxy": DEAD,
    "HTTP_PROXY": DEAD,
    "HTTPS_PROXY": DEAD,
}


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def wheel_from_installed(name: str, out_dir: Path) -> Path:
    """The installed distribution ``name`` packed as a pure-Python wheel (its files as RECORD
    lists them, a fresh RECORD): what scripts/gpu_wheels.sh would download, without the index."""
    dist = importlib.metadata.distribution(name)
    files = [f for f in dist.files or () if "__pycache__" not in f.parts]
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    skip = {f"{info}/{n}" for n in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")}
    stem = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}"
    wheel = out_dir / f"{stem}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in files:
            arcname = path.as_posix()
            if arcname in skip or arcname.startswith(".."):
                continue
            data = Path(dist.locate_file(path)).read_bytes()
            zf.writestr(arcname, data)
            record.append(f"{arcname},{_record_hash(data)},{len(data)}")
        record.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


# The tests that run the whole check (an install and a collection) are out of the quick tier.
whole_check = pytest.mark.full


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> tuple[Path, Path]:
    """(the image's Python, the wheel folder)."""
    root = tmp_path_factory.mktemp("gpu_image")
    python = gpu_image_python(root)
    hidden = subprocess.run(
        [str(python), "-c", "import hydra"], cwd=root, capture_output=True, timeout=60
    )
    assert hidden.returncode != 0, "the simulated image still has Hydra"
    wheels = root / "wheels"
    wheels.mkdir()
    for name in LANE:
        wheel_from_installed(name, wheels)
    return python, wheels


def _gpu_check(tmp_path: Path, python: Path, wheels: Path, *args: str, **env: str):
    out = tmp_path / "out"
    launch = run_command(
        ["bash", str(SCRIPT), *args],
        cwd=tmp_path,
        timeout=420,  # about 40 s on an idle machine; the CPU is shared
        env={
            **OFFLINE,
            "PYTHON": str(python),
            "GPU_CHECK_WHEELS": str(wheels),
            "GPU_CHECK_OUT": str(out),
            "TMPDIR": str(tmp_path),
            **env,
        },
    )
    return launch, out


@whole_check
def test_gpu_check_installs_offline_collects_every_cuda_test_and_exits_2_without_a_gpu(
    tmp_path, image
):
    python, wheels = image
    launch, out = _gpu_check(tmp_path, python, wheels)
    assert launch.returncode == 2, launch.output
    setup = (out / "setup.log").read_text()
    # What the image lacked came from the folder, and pip read no index.
    installed = next(line for line in setup.splitlines() if line.startswith("Successfully"))
    for name in LANE:
        assert name in installed, installed
    assert "Looking in indexes" not in setup and DEAD not in setup, setup
    assert "Successfully installed sdnet_trainer" in setup or "sdnet-trainer" in setup, setup
    # Every CUDA test collected and skipped for the reason, none errored.
    suite = ET.parse(out / "cuda_tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else next(suite.iter("testsuite"))
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "errors", "failures", "skipped")}
    assert counts["tests"] >= 30 and counts["skipped"] == counts["tests"], counts
    assert counts["errors"] == counts["failures"] == 0, counts
    assert "no CUDA device" in (out / "pytest.log").read_text()
    # The table comes last, with the verdict.
    summary = (out / "summary.txt").read_text().strip().splitlines()
    assert launch.output.strip().splitlines()[-len(summary) :] == summary
    assert summary[-1].startswith("result") and "no CUDA device" in summary[-1], summary
    assert "(exit code 2)" in summary[-1]
    assert "benchmarks" in "\n".join(summary) and "no CUDA device" in "\n".join(summary)


@whole_check
def test_gpu_check_without_the_wheel_folder_says_how_to_make_it(tmp_path, image):
    python, _ = image
    launch, out = _gpu_check(tmp_path, python, tmp_path / "no_wheels")
    assert launch.returncode == 1, launch.output
    assert "bash scripts/gpu_wheels.sh DIR" in launch.output, launch.output
    assert "Looking in indexes" not in (out / "setup.log").read_text()


@whole_check
def test_gpu_check_names_the_torch_it_needs(tmp_path):
    """A Python whose torch is older than pyproject.toml's minimum: one line, before any setup."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text('__version__ = "2.10.0+cu128"\n')
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    launch, out = _gpu_check(tmp_path, python, tmp_path)
    assert launch.returncode == 1, launch.output
    lines = [line for line in launch.output.splitlines() if line.startswith("gpu_check:")]
    assert lines[0] == (
        f"gpu_check: this project needs torch>=2.11 (pyproject.toml); {sys.executable} "
        "has torch 2.10.0+cu128"
    ), launch.output
    assert not (out / "cuda_tests.xml").exists()


@pytest.fixture
def scripts(monkeypatch):
    """(bench_gpu, gpu_check_summary) as gpu_check.sh runs them, from scripts/."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    return importlib.import_module("bench_gpu"), importlib.import_module("gpu_check_summary")


def _metrics(tokens_per_s: list[float], mfu: list[float]) -> list[dict]:
    """metrics.jsonl rows as the Trainer writes them: a log point per entry, a row without."""
    rows: list[dict] = [{"step": 0, "train/loss": 11.8}]
    for step, (tokens, share) in enumerate(zip(tokens_per_s, mfu, strict=True), start=1):
        rows.append(
            {
                "step": 2 * step,
                "perf/tokens_per_s": tokens,
                "perf/mfu": share,
                "perf/tflops_per_s": share * 989.4,
                "perf/peak_memory_mb": 40000.0 + step,
            }
        )
    return rows


def test_the_table_has_a_row_for_each_decoder_section(scripts, tmp_path, capsys):
    bench_gpu, summary = scripts
    gpt, llama = bench_gpu.DECODERS
    run = bench_gpu.DecoderRun(llama, batch=8, micro=4, steps=10, compile=False)
    # The first log point (the first step's allocations) is left out; the median of the rest.
    rows = _metrics([9000.0, 31000.0, 30000.0, 32000.0, 31500.0], [0.1, 0.41, 0.40, 0.43, 0.42])
    figures_llama = bench_gpu.decoder_summary(
        rows, run=run, seconds=50.0, other=0.1, source=tmp_path
    )
    assert figures_llama["tokens_per_s"] == 31250.0 and figures_llama["mfu"] == 0.415
    assert figures_llama["log_points"] == 4 and figures_llama["peak_memory_mb"] == 40005.0
    assert "31,250 tokens/s  MFU 41.5%" in capsys.readouterr().out  # bench_gpu's own line
    figures = {
        "device": "NVIDIA H100 80GB HBM3",
        "decoders": [gpt.section, llama.section],
        gpt.section: {"failed": "FAILED (log in out/gpt_1b.log)"},
        llama.section: figures_llama,
    }
    (tmp_path / "bench.json").write_text(json.dumps(figures))
    argv = [str(tmp_path), "0", "0", "0", "passed", "20", "200", "210", "430"]
    assert summary.main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == f"== gpu_check summary (outputs in {tmp_path})"
    cells = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in table[1:])
    # One column of values, after the longest name and two spaces.
    starts = {line.index(value, len(name)) for line, (name, value) in zip(table[1:], cells.items())}
    assert starts == {len("seconds: setup, tests, benchmark, all") + 2}, table
    assert cells["device"] == "NVIDIA H100 80GB HBM3"
    assert cells["gpt_1b tokens/s"] == "FAILED (log in out/gpt_1b.log)"
    assert cells["gpt_1b MFU"] == "n/a"
    assert cells["llama3_1b tokens/s"] == "31,250"
    assert cells["llama3_1b MFU"] == "41.5%"
    names = list(cells)
    assert names.index("gpt_1b MFU") < names.index("llama3_1b tokens/s")  # bench_gpu's order
    assert names[-2:] == ["seconds: setup, tests, benchmark, all", "result"]
    assert cells["result"] == "passed (exit code 0)"
    assert "no report (pytest exit code 0)" in cells["cuda tests"]  # no cuda_tests.xml here


def test_the_table_lists_only_the_decoders_that_ran(scripts, tmp_path, capsys):
    _, summary = scripts
    figures = {"device": "NVIDIA H100 80GB HBM3", "decoders": []}
    (tmp_path / "bench.json").write_text(json.dumps(figures))
    summary.main([str(tmp_path), "0", "0", "0", "passed", "1", "2", "3", "6"])
    out = capsys.readouterr().out
    assert "tokens/s" not in out and "MFU" not in out
    assert "device" in out and "NVIDIA H100 80GB HBM3" in out
