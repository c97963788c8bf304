"""scripts/ci/gpu_check.sh on a simulated GPU image, offline, on the CPU.

The image's Python is this environment's packages less what GPU images lack (Hydra, OmegaConf,
the ANTLR runtime, the serve extra, the linters, the project itself: tests.support.
gpu_image_python); the wheel folder holds what scripts/ci/gpu_wheels.sh downloads, packed here from
the installed distributions (no index is reached). pip is pointed at no index and HTTP goes to a
dead proxy, so a check that tried the network fails here. Without a GPU the check must get
through its install and the collection of every CUDA test and exit 2 ("no CUDA device"), not 1.
Whatever happens, the output folder must come back from an offline node whole: at most 8 plain
files (no folder), each at most 16 MiB, named in letters, digits, '.', '_' and '-', with
summary.txt among them; checked after a complete run, a part stopped by its share of the budget
and a SIGTERM part way (what the node's own time limit sends). The closing table's benchmark rows
(scripts/ci/gpu_check_summary.py) are checked on a bench.json made here from
scripts/bench/bench_gpu.py's own summaries.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

from tests.support import REPO, gpu_image_python, run_command, start_command

SCRIPT = REPO / "scripts" / "ci" / "gpu_check.sh"
# What scripts/ci/gpu_lane_requirements.txt names: the wheels a GPU node gets from the folder.
LANE = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "torchao")
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
    lists them, a fresh RECORD): what scripts/ci/gpu_wheels.sh would download, without the index."""
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


# What can come back from the node's output folder (the device's limits).
MAX_FILES, MAX_BYTES = 8, 16 * 2**20
NAME = re.compile(r"[A-Za-z0-9._-]+")


def assert_fits_the_way_back(out: Path) -> None:
    entries = sorted(out.iterdir())
    assert len(entries) <= MAX_FILES, [e.name for e in entries]
    for entry in entries:
        assert entry.is_file() and not entry.is_symlink(), f"{entry.name}: not a plain file"
        assert NAME.fullmatch(entry.name), entry.name
        assert entry.stat().st_size <= MAX_BYTES, (entry.name, entry.stat().st_size)
    assert (out / "summary.txt").exists(), [e.name for e in entries]


def processes_of(tmp_path: Path) -> list[int]:
    """Processes whose environment names ``tmp_path`` as TMPDIR: what a check started there."""
    mark = f"TMPDIR={tmp_path}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue  # gone, or not ours to read
    return found


def assert_nothing_left(tmp_path: Path) -> None:
    """The check's watchdog sleeps a second at a time: give it that long to go."""
    deadline = time.monotonic() + 5
    while processes_of(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_of(tmp_path)


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


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """One venv for the module's checks (GPU_CHECK_VENV): the first check makes it, the others
    reuse it and skip most of the setup."""
    return tmp_path_factory.mktemp("gpu_check_venv")


def _check_env(tmp_path: Path, python: Path, wheels: Path, **env: str) -> dict[str, str]:
    return {
        **OFFLINE,
        "PYTHON": str(python),
        "GPU_CHECK_WHEELS": str(wheels),
        "GPU_CHECK_OUT": str(tmp_path / "out"),
        "TMPDIR": str(tmp_path),
        **env,
    }


def _gpu_check(tmp_path: Path, python: Path, wheels: Path, *args: str, **env: str):
    launch = run_command(
        ["bash", str(SCRIPT), *args],
        cwd=tmp_path,
        timeout=420,  # about 40 s on an idle machine; the CPU is shared
        env=_check_env(tmp_path, python, wheels, **env),
    )
    return launch, tmp_path / "out"


@whole_check
def test_gpu_check_installs_offline_collects_every_cuda_test_and_exits_2_without_a_gpu(
    tmp_path, image, venv
):
    python, wheels = image
    kept = (venv / ".gpu_check_installed").exists()  # another test of this module ran first
    launch, out = _gpu_check(tmp_path, python, wheels, GPU_CHECK_VENV=str(venv))
    assert launch.returncode == 2, launch.output
    assert_fits_the_way_back(out)
    assert sorted(p.name for p in out.iterdir()) == [
        "cuda_tests.xml",
        "gpu_check.tar.gz",
        "machine.txt",
        "pytest.log",
        "setup.log",
        "summary.txt",
    ]
    with tarfile.open(out / "gpu_check.tar.gz") as archive:
        assert "./pytest.log" in archive.getnames(), archive.getnames()
    assert_nothing_left(tmp_path)
    setup = (out / "setup.log").read_text()
    if kept:  # the kept venv's install is reused, and said so
        assert "holds this tree's install: kept as it is" in launch.output, launch.output
    else:
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
    # The cold compile runs last (tests/cuda/conftest.py): a share that runs out loses only it.
    order = [case.get("name") for case in suite.iter("testcase")]
    assert order[-1] == "test_one_gpu_fit_bf16_compiled_and_profiled[resnet18]", order
    # The second command's tests are not the first's.
    modules = {case.get("classname", "").rsplit(".", 1)[-1] for case in suite.iter("testcase")}
    assert not modules & {
        "test_float8_cuda",
        "test_context_parallel_cuda",
        "test_moe_cuda",
        "test_ft_cuda",
    }
    assert "test_one_rank_nccl_process_group[zero1]" in order  # in the default profile now
    pytest_log = (out / "pytest.log").read_text()
    assert "no CUDA device" in pytest_log and "slowest durations" in pytest_log, pytest_log
    machine = (out / "machine.txt").read_text()
    assert "/dev/shm:" in machine and "host name" in machine, machine
    # The table comes last, with the verdict.
    summary = (out / "summary.txt").read_text().strip().splitlines()
    assert launch.output.strip().splitlines()[-len(summary) :] == summary
    assert summary[-1].startswith("result") and "no CUDA device" in summary[-1], summary
    assert "(exit code 2)" in summary[-1]
    assert "benchmarks" in "\n".join(summary) and "no CUDA device" in "\n".join(summary)


@whole_check
def test_gpu_check_stops_pytest_at_the_end_of_its_share_and_still_reports(tmp_path, image, venv):
    """A 3 s share for the tests: pytest gets SIGINT part way, the check goes on to its table."""
    python, wheels = image
    launch, out = _gpu_check(
        tmp_path, python, wheels, GPU_CHECK_VENV=str(venv), GPU_CHECK_TEST_S="3"
    )
    # Not a failure of the code under test: without a GPU, still "no CUDA device".
    assert launch.returncode == 2, launch.output
    assert "pytest: its 3 s share ran out: SIGINT" in launch.output, launch.output
    assert_fits_the_way_back(out)
    summary = (out / "summary.txt").read_text()
    assert "(pytest not finished in its 3 s share) (exit code 2)" in summary, summary
    assert "FAILED" not in summary, summary
    assert launch.output.rstrip().endswith(summary.rstrip())
    assert_nothing_left(tmp_path)


@whole_check
@pytest.mark.parametrize("share", [None, "3"], ids=["whole", "stopped_by_its_share"])
def test_the_second_command_collects_its_tests_and_exits_2_without_a_gpu(
    tmp_path, image, venv, share
):
    """GPU_CHECK_SECOND=1: the CUDA tests marked gpu_second and bench_gpu.py --second; on the
    CPU it installs, collects those tests alone and exits 2, whole or stopped by its share, with
    what an offline node hands back."""
    python, wheels = image
    env = {"GPU_CHECK_VENV": str(venv), "GPU_CHECK_SECOND": "1"}
    if share is not None:
        env["GPU_CHECK_TEST_S"] = share
    launch, out = _gpu_check(tmp_path, python, wheels, **env)
    assert launch.returncode == 2, launch.output
    assert "the second command (budget 450 s in all" in launch.output, launch.output
    assert_fits_the_way_back(out)
    summary = (out / "summary.txt").read_text()
    assert "no CUDA device" in summary and "(exit code 2)" in summary, summary
    assert re.search(r"^command +second$", summary, re.M), summary
    # Every GPU claim has its row: the first command's are said to be that command's.
    assert "claim: float8 rowwise and tensorwise against bf16 on llama3_1b, eager" in summary
    assert re.search(r"claim: gpt_1b tokens/s .* not measured: the first command's", summary)
    if share is None:
        suite = ET.parse(out / "cuda_tests.xml").getroot()
        names = {case.get("classname", "").rsplit(".", 1)[-1] for case in suite.iter("testcase")}
        assert names == {
            "test_float8_cuda",
            "test_context_parallel_cuda",
            "test_moe_cuda",
            "test_ft_cuda",
        }, names
    else:
        assert "(pytest not finished in its 3 s share)" in summary, summary
    assert_nothing_left(tmp_path)


@whole_check
def test_gpu_check_killed_part_way_still_writes_its_table(tmp_path, image, venv):
    """SIGTERM while pytest runs (what the node's time limit, or the check's own watchdog, sends):
    the part is stopped, the table and the files are there, nothing the check started is left."""
    python, wheels = image
    log = tmp_path / "check.log"
    env = _check_env(tmp_path, python, wheels, GPU_CHECK_VENV=str(venv))
    proc = start_command(["bash", str(SCRIPT)], cwd=tmp_path, log=log, env=env)
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("gpu_check_work.*/pytest.log")):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        time.sleep(1)  # pytest is starting up
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 124, log.read_text()
    out = tmp_path / "out"
    assert_fits_the_way_back(out)
    summary = (out / "summary.txt").read_text()
    assert "STOPPED: SIGTERM received after" in summary and "(exit code 124)" in summary, summary
    assert not list(tmp_path.glob("gpu_check_work.*")), "the scratch folder was left behind"
    assert_nothing_left(tmp_path)


@whole_check
def test_gpu_check_without_the_wheel_folder_says_how_to_make_it(tmp_path, image):
    python, _ = image
    launch, out = _gpu_check(tmp_path, python, tmp_path / "no_wheels")
    assert launch.returncode == 1, launch.output
    assert "bash scripts/ci/gpu_wheels.sh DIR" in launch.output, launch.output
    assert "Looking in indexes" not in (out / "setup.log").read_text()
    assert_fits_the_way_back(out)
    assert "FAILED: setup: cannot install" in (out / "summary.txt").read_text()


@whole_check
@pytest.mark.parametrize("found_by", ["metadata", "import"])
def test_gpu_check_names_the_torch_it_needs(tmp_path, found_by):
    """A Python whose torch is older than pyproject.toml's minimum: one line, before any setup.
    The version comes from the installed package's metadata, or, for a torch without any (built
    in place), from importing it: here a Python without its site folders, whose only torch is
    the fake one."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    flags = ""
    if found_by == "metadata":  # found before the real torch's, which comes later on the path
        info = fake / "torch-2.10.0+cu128.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: torch\nVersion: 2.10.0+cu128\n"
        )
        module = 'raise ImportError("the version check imported torch")\n'
    else:
        module = '__version__ = "2.10.0+cu128"\n'
        flags = "-S "
    (fake / "torch" / "__init__.py").write_text(module)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} {flags}"$@"\n')
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
    """(bench_gpu, gpu_check_summary) as gpu_check.sh runs them, from scripts/bench and
    scripts/ci."""
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "bench"))
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "ci"))
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
    figures_llama = bench_gpu.decoder_summary(rows, run=run, seconds=50.0, other=0.1)
    assert figures_llama["tokens_per_s"] == 31250.0 and figures_llama["mfu"] == 0.415
    assert figures_llama["log_points"] == 4 and figures_llama["peak_memory_mb"] == 40005.0
    assert "31,250 tokens/s  MFU 41.5%" in capsys.readouterr().out  # bench_gpu's own line
    figures = {
        "device": "NVIDIA H100 80GB HBM3",
        "decoders": [gpt.section, llama.section],
        gpt.section: {"failed": "FAILED (log in out/gpt_1b.log)"},
        llama.section: figures_llama,
        # The roofline: the matmul measured in the same run (bench_gpu.bench_matmul's keys).
        "matmul": {"tflops_per_s": 800.0, "size": 8192, "dtype": "bfloat16"},
    }
    (tmp_path / "bench.json").write_text(json.dumps(figures))
    argv = [str(tmp_path), "0", "0", "0", "passed", "20", "200", "210", "430", "/node/out"]
    assert summary.main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "== gpu_check summary (outputs in /node/out)"
    cells = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in table[1:])
    # One column of values, after the longest name and two spaces.
    starts = {line.index(value, len(name)) for line, (name, value) in zip(table[1:], cells.items())}
    assert starts == {max(map(len, cells)) + 2}, table
    assert cells["device"] == "NVIDIA H100 80GB HBM3"
    assert cells["matmul bfloat16 8192^3 (practical peak)"] == "800 TFLOP/s"
    assert cells["gpt_1b tokens/s"] == "FAILED (log in out/gpt_1b.log)"
    assert cells["gpt_1b MFU (datasheet peak)"] == "n/a"
    # 0.415 x 989.4 = 410.6 TFLOP/s, 51 % of the 800 measured.
    assert cells["llama3_1b tokens/s"] == "31,250 (411 TFLOP/s, 51% of the matmul)"
    assert cells["llama3_1b MFU (datasheet peak)"] == "41.5%"
    names = list(cells)
    assert names.index("gpt_1b MFU (datasheet peak)") < names.index("llama3_1b tokens/s")
    assert names[-2:] == ["seconds: setup, tests, benchmark, all", "result"]
    assert cells["result"] == "passed (exit code 0)"
    assert "no report (pytest exit code 0)" in cells["cuda tests"]  # no cuda_tests.xml here


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5" time="300">
<testcase classname="tests.cuda.test_fit_cuda" name="test_a" time="120.5"/>
<testcase classname="tests.cuda.test_fit_cuda" name="test_b" time="3.0">
<failure message="AssertionError: loss went up&#10;second line">trace</failure></testcase>
<testcase classname="tests.cuda.test_verdict_cuda" name="test_c" time="40.0">
<error message="RuntimeError: called a synchronizing CUDA operation">trace</error></testcase>
<testcase classname="tests.cuda.test_loader_cuda" name="test_d" time="0.1">
<skipped message="no CUDA device"/></testcase>
<testcase classname="tests.cuda.test_loader_cuda" name="test_e" time="7.0"/>
</testsuite></testsuites>
"""


def test_the_table_names_what_failed_and_what_was_slow(scripts, tmp_path, capsys):
    """The console keeps only its end: the table itself says which tests failed and why, the
    slowest ones, and the ResNet-50 sides' TFLOP/s beside the matmul."""
    bench_gpu, summary = scripts
    (tmp_path / "cuda_tests.xml").write_text(JUNIT)
    figures = {
        "device": "NVIDIA H200",
        "decoders": [],
        "matmul": {"tflops_per_s": 790.0, "size": 8192, "dtype": "bfloat16"},
        "resnet50": {
            "trainer": {"images_per_s": 3000.0, "tflops_per_s": 36.9, "failed": None},
            "hand": {"images_per_s": None, "tflops_per_s": None, "failed": None},
            "ratio": None,
        },
        "skipped": ["llama3_1b"],
    }
    (tmp_path / "bench.json").write_text(json.dumps(figures))
    summary.main([str(tmp_path), "1", "3", "1", "FAILED: pytest exit code 1", "1", "2", "3", "6"])
    table = capsys.readouterr().out.splitlines()
    cells = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in table[1:])
    assert cells["cuda tests"] == "2 passed, 1 failed, 1 errors, 1 skipped"
    assert cells["failure: test_fit_cuda::test_b"] == "AssertionError: loss went up"
    assert cells["error: test_verdict_cuda::test_c"] == (
        "RuntimeError: called a synchronizing CUDA operation"
    )
    slow = [name for name in cells if name.startswith("slow: ")]
    assert slow == [
        "slow: test_fit_cuda::test_a",
        "slow: test_verdict_cuda::test_c",
        "slow: test_loader_cuda::test_e",
    ]
    assert cells["slow: test_fit_cuda::test_a"] == "120 s"
    assert cells["resnet50 bf16 channels_last images/s, trainer"] == (
        "3,000 (36.9 TFLOP/s, 5% of the matmul)"
    )
    assert cells["resnet50 bf16 channels_last images/s, hand"] == "not run: the budget ran out"
    assert cells["benchmark left out (budget)"] == "llama3_1b"


def test_the_table_lists_only_the_decoders_that_ran(scripts, tmp_path, capsys):
    _, summary = scripts
    figures = {"device": "NVIDIA H100 80GB HBM3", "decoders": []}
    (tmp_path / "bench.json").write_text(json.dumps(figures))
    summary.main([str(tmp_path), "0", "0", "0", "passed", "1", "2", "3", "6"])
    out = "\n".join(
        line for line in capsys.readouterr().out.splitlines() if not line.startswith("claim:")
    )
    assert "tokens/s" not in out and "MFU" not in out
    assert "device" in out and "NVIDIA H100 80GB HBM3" in out


def test_the_table_says_which_claims_this_run_measured(scripts, tmp_path, capsys):
    """Each claim's row: measured where its figures or its passing tests are in this run's files;
    partly, failed, or not measured with why (another command's, a share's end, float8 not run)."""
    _, summary = scripts
    (tmp_path / "cuda_tests.xml").write_text(JUNIT)
    row = {"label": "x", "versus": None, "failed": None, "tokens_per_s": 1.0, "cut": False}
    figures = {
        "device": "NVIDIA H100 80GB HBM3",
        "decoders": [],
        "matmul": {"tflops_per_s": 790.0, "size": 8192, "dtype": "bfloat16"},
        "variant_sections": ["moe", "cp"],
        "moe": {"rows": {"grouped": row, "loop": row}},
        "cp": {
            "rows": {
                "one_process": row,
                "ring": {**row, "failed": "not finished in its share (80 s)", "cut": True},
                "allgather": row,
            }
        },
    }
    (tmp_path / "bench.json").write_text(json.dumps(figures))
    argv = [str(tmp_path), "1", "3", "1", "FAILED", "1", "2", "3", "6", "/out", "second"]
    summary.main(argv)
    cells = dict(
        re.split(r"\s{2,}", line, maxsplit=1) for line in capsys.readouterr().out.splitlines()[1:]
    )
    claim = {name.removeprefix("claim: "): v for name, v in cells.items() if name[:6] == "claim:"}
    assert list(claim) == [c.text for c in summary.CLAIMS]
    assert claim["bf16 matmul, sustained (the practical peak)"] == "measured"
    assert claim["the MoE's grouped matmul in bf16 against the loop over experts"] == "measured"
    assert claim["ring attention against the K/V all-gather and one process"] == "partly (1 of 2)"
    assert claim["gpt_1b tokens/s and MFU on one GPU"] == "not measured: the first command's"
    assert claim["FSDP2 on one GPU against the plain model (llama3_1b)"] == (
        "not measured (not run)"
    )
    # JUNIT: test_fit_cuda's test_a passed, test_b failed; test_verdict_cuda's only test errored.
    assert claim["no host synchronisation on a non-log step"] == "FAILED (a test failed)"
    loader = "the loader's pinned side-stream copies and GPU decode"
    assert claim[loader] == "partly (1 of 2 tests passed)"


def test_docs_list_every_claim_the_table_names(scripts):
    """docs/gpu.md's table of claims is the table's list (gpu_check_summary.CLAIMS), in order,
    each with the command that measures it."""
    _, summary = scripts
    text = (REPO / "docs" / "gpu.md").read_text()
    section = text[text.index("### What each command measures") :]
    rows = re.findall(r"^\| (.+?) \| (first|second|full) \|", section, re.M)
    assert rows == [(c.text, c.command) for c in summary.CLAIMS]
