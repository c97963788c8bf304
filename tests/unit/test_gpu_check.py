"""scripts/gpu_check.sh on a simulated GPU image, offline, on the CPU.

The image's Python is this environment's packages less what GPU images lack (Hydra, OmegaConf,
the ANTLR runtime, the serve extra, the linters, the project itself: tests.support.
gpu_image_python); the wheel folder holds what scripts/gpu_wheels.sh downloads, packed here from
the installed distributions (no index is reached). pip is pointed at no index and HTTP goes to a
dead proxy, so a check that tried the network fails here. Without a GPU the check must get
through its install and the collection of every CUDA test and exit 2 ("no CUDA device"), not 1.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

from tests.support import REPO, gpu_image_python, run_command

# Each test runs the whole check (an install and a collection): out of the quick tier.
pytestmark = pytest.mark.full

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


def test_gpu_check_without_the_wheel_folder_says_how_to_make_it(tmp_path, image):
    python, _ = image
    launch, out = _gpu_check(tmp_path, python, tmp_path / "no_wheels")
    assert launch.returncode == 1, launch.output
    assert "bash scripts/gpu_wheels.sh DIR" in launch.output, launch.output
    assert "Looking in indexes" not in (out / "setup.log").read_text()


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
