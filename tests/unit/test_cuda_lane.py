"""The CUDA lane's glue, checked on the CPU: the ``cuda`` marker and its skip, the CPU tests' pin
to the CPU, scripts/gpu_check.sh's syntax and scripts/bench_gpu.py without a GPU."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sdnet_trainer import compose
from tests.support import REPO, TINY, run_command

SCRIPTS = REPO / "scripts"

# Run by a pytest in a subprocess, with tests/conftest.py loaded as a plugin: one CUDA test, one
# CPU test that reports what it saw.
MARKED = """
    import os

    import pytest
    import torch


    @pytest.mark.cuda
    def test_needs_a_gpu():
        assert torch.cuda.is_available()


    def test_cpu_side():
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
        assert torch.cuda.is_available() is False
"""


def _inner_pytest(tmp_path, *args: str):
    test_file = tmp_path / "test_lane.py"
    test_file.write_text(textwrap.dedent(MARKED))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(REPO / "pyproject.toml"),  # the markers and --strict-markers
        f"--rootdir={tmp_path}",
        "-p",
        "tests.conftest",
        "-p",
        "no:cacheprovider",
        "-rs",
        *args,
        str(test_file),
    ]
    return run_command(cmd, cwd=tmp_path, timeout=120)


def test_the_cuda_marker_is_registered(pytestconfig):
    markers = [line.split(":", 1)[0] for line in pytestconfig.getini("markers")]
    assert "cuda" in markers
    assert "--strict-markers" in pytestconfig.getini("addopts")


def test_a_cuda_test_skips_without_a_device_saying_so(tmp_path):
    launch = _inner_pytest(tmp_path)
    assert launch.returncode == 0, launch.output
    assert "SKIPPED [1]" in launch.output and "no CUDA device" in launch.output, launch.output
    assert "1 passed, 1 skipped" in launch.output, launch.output


def test_pytest_m_cuda_selects_only_the_cuda_tests(tmp_path):
    launch = _inner_pytest(tmp_path, "-m", "cuda")
    assert launch.returncode == 0, launch.output
    assert "1 skipped, 1 deselected" in launch.output, launch.output


@pytest.fixture(scope="module")
def seen_by_a_module_fixture():
    """Module fixtures start training runs too: they must see the GPUs hidden as well."""
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()


def test_cpu_tests_see_no_gpu_in_this_process_nor_in_the_ones_they_start(
    seen_by_a_module_fixture, tmp_path
):
    assert seen_by_a_module_fixture == ("", False)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and torch.cuda.is_available() is False
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.stdout.strip() == "''"
    assert compose(TINY).dist.device == "cpu"


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_gpu_scripts_parse(script):
    result = subprocess.run(
        ["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr


def test_bench_gpu_quick_is_the_short_profile(bench_gpu, monkeypatch):
    """gpu_check.sh's default benchmark: ResNet-50 (one round of each side) and gpt_1b, fewer
    steps, 90 s per launch; sections given explicitly still win."""
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--quick"])
    args = bench_gpu.parse_args()
    assert args.sections == ["resnet50", "gpt_1b"]
    assert (args.rounds, args.warmup, args.steps, args.gpt_steps) == (1, 10, 30, 15)
    assert args.timeout == 90.0
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--quick", "--sections", "gpt_1b"])
    assert bench_gpu.parse_args().sections == ["gpt_1b"]
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py"])
    full = bench_gpu.parse_args()
    assert full.sections == ["resnet50", "gpt_1b", "loader"] and full.rounds == 3


@pytest.mark.full  # seconds: out of the quick tier
def test_bench_gpu_without_cuda_exits_2_with_its_message(tmp_path):
    launch = run_command(
        [sys.executable, str(SCRIPTS / "bench_gpu.py"), "--out", str(tmp_path / "out")],
        cwd=tmp_path,
        timeout=120,
    )
    assert launch.returncode == 2, launch.output
    assert "bench_gpu: no CUDA device" in launch.output and "nothing was measured" in launch.output
    assert not (tmp_path / "out").exists()  # it stops before it starts anything


@pytest.fixture
def bench_gpu(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("bench_gpu")


def _config_keys(keys: list[str]) -> list[str]:
    return [key for key in keys if not key.startswith("hydra.")]  # the launch's, not the config's


def test_bench_gpu_runs_compose_as_described(bench_gpu, tmp_path):
    """The benchmark's Trainer launches are valid configs that say what its table claims."""
    spec = bench_gpu.ResNetSpec(batch=256, warmup=15, steps=40, workers=6, out="x.json")
    resnet = compose(_config_keys(bench_gpu.resnet_keys(spec, tmp_path)))
    assert (resnet.model.name, resnet.model.num_classes) == ("resnet50", 1000)
    assert resnet.model.channels_last and resnet.precision.dtype == "bf16"
    assert not resnet.compile.enabled and resnet.dist.device == "cuda"
    assert resnet.data.image_size == 224 and resnet.data.num_workers == 6
    assert resnet.data.train_size >= 256 * (15 + 40 + 1)  # the whole launch in one epoch
    assert resnet.loop.max_steps == 56 and resnet.loop.global_batch_size == 256
    assert resnet.trainer._target_ == "bench_gpu.GpuBenchTrainer"
    from sdnet_trainer.training.trainer import resolve_trainer_class

    assert resolve_trainer_class(resnet.trainer._target_) is bench_gpu.GpuBenchTrainer

    args = argparse.Namespace(gpt_batch=8, gpt_micro=4, gpt_steps=25, gpt_compile=False)
    gpt = compose(_config_keys(bench_gpu.gpt_keys(args, tmp_path)))
    assert gpt.model.gpt.n_layers == 18 and gpt.model.gpt.dim == 2048  # configs/model/gpt_1b
    assert gpt.data.name == "tokens" and gpt.precision.dtype == "bf16"
    assert gpt.loop.global_batch_size == 8 and gpt.loop.grad_accum_steps == 2
    assert gpt.logging.flops  # MFU comes from the Trainer's own FLOP count


@pytest.mark.full  # seconds: out of the quick tier
def test_bench_gpu_machinery_runs_on_the_cpu(tmp_path):
    """--cpu-smoke: both ResNet sides launched and timed (a ResNet-18 at 32x32, fp32), the loader
    section on generated JPEGs, the table and the JSON that gpu_check.sh reads."""
    figures_file = tmp_path / "figures.json"
    cmd = [sys.executable, str(SCRIPTS / "bench_gpu.py"), "--cpu-smoke"]
    cmd += ["--out", str(tmp_path / "out"), "--json", str(figures_file)]
    launch = run_command(cmd, cwd=tmp_path, timeout=600)
    assert launch.returncode == 0, launch.output
    figures = json.loads(figures_file.read_text())
    resnet = figures["resnet50"]
    for side in ("trainer", "hand"):
        assert resnet[side]["failed"] is None and resnet[side]["images_per_s"] > 0, resnet
    assert resnet["ratio"] == pytest.approx(
        resnet["trainer"]["images_per_s"] / resnet["hand"]["images_per_s"]
    )
    # The Trainer side ran the pinned run through the real CLI, with its own logging.
    config = (tmp_path / "out" / "resnet50" / "r1_trainer" / ".hydra" / "config.yaml").read_text()
    assert "name: resnet18" in config and "_target_: bench_gpu.GpuBenchTrainer" in config
    assert (tmp_path / "out" / "resnet50" / "r1_trainer" / "metrics.jsonl").exists()
    loader = figures["loader"]
    assert len(list((tmp_path / "out" / "jpegs" / "train").rglob("*.jpg"))) == 8
    assert loader["images_per_s_per_core"] > 0 and loader["images_per_s_workers"] > 0
    assert loader["cores_for_trainer_rate"] == pytest.approx(
        resnet["trainer"]["images_per_s"] / loader["images_per_s_per_core"]
    )
    assert "gpt_1b" not in figures  # not on a CPU
    assert "2,470 images/s" in launch.output and "trainer / hand" in launch.output
