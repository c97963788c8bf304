"""The CUDA lane's glue, checked on the CPU: the ``cuda`` marker and its skip, the CPU tests' pin
to the CPU, scripts/ci/gpu_check.sh's syntax and scripts/bench/bench_gpu.py without a GPU."""

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
from sdnet_trainer.errors import ConfigError
from tests.support import REPO, TINY, bench_main_in_process, run_command

CI, BENCH = REPO / "scripts" / "ci", REPO / "scripts" / "bench"

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
        ["bash", "-n", str(CI / script)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr


def test_bench_gpu_quick_is_the_short_profile(bench_gpu, monkeypatch):
    """gpu_check.sh's default benchmark: the matmul roofline, ResNet-50 (one round of each
    side), gpt_1b and llama3_1b, fewer steps, 120 s per launch; sections given explicitly still
    win."""
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--quick"])
    args = bench_gpu.parse_args()
    assert args.sections == ["matmul", "resnet50", "gpt_1b", "llama3_1b"]
    assert (args.rounds, args.warmup, args.steps, args.gpt_steps) == (1, 10, 30, 15)
    assert args.llama_steps == 10  # about a minute on one H100, start-up included
    assert args.timeout == 120.0 and args.matmul_size == 8192 and args.budget_s is None
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--quick", "--sections", "gpt_1b"])
    assert bench_gpu.parse_args().sections == ["gpt_1b"]
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--sections", "llama3_1b,loader"])
    assert bench_gpu.parse_args().sections == ["llama3_1b", "loader"]
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py"])
    full = bench_gpu.parse_args()
    assert full.sections == list(
        bench_gpu.SECTIONS
    )  # every section, the loader included    assert full.rounds == 3
    assert (full.gpt_steps, full.llama_steps) == (25, 20)
    # No 1B decoder on a CPU.
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--cpu-smoke"])
    assert bench_gpu.parse_args().sections == [
        "matmul",
        "resnet50",
        "loader",
        "moe",
        "cp",
        "llama3_1b_variants",
    ]
    # The GPU check's second command: the variants, cheapest first, with --quick's steps.
    second = bench_gpu.parse_args(["--second"])
    assert second.sections == ["matmul", "llama3_1b_variants", "moe", "cp"]
    assert (second.llama_steps, second.timeout) == (10, 120.0)
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--second", "--quick"])


def test_bench_gpu_loader_workers_fit_in_dev_shm(bench_gpu, monkeypatch):
    """Each worker holds two float32 batches in shared memory (256 x 3 x 224 x 224 x 4 bytes:
    154 MB each): a container's 64 MB /dev/shm gets no worker, 16 GiB the cores' share."""
    batch_bytes = 256 * 3 * 224 * 224 * 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert bench_gpu.default_workers(batch=256, shm_bytes=64 * 2**20) == 0
    assert bench_gpu.default_workers(batch=256, shm_bytes=16 * 2**30) == 12
    # Three quarters of 1 GiB hold 5 batches: 2 workers of 2.
    assert 2 * 2 * batch_bytes <= 0.75 * 2**30 < 3 * 2 * batch_bytes
    assert bench_gpu.default_workers(batch=256, shm_bytes=2**30) == 2


def test_bench_gpu_budget_cuts_timeouts_and_skips_what_does_not_fit(bench_gpu, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(bench_gpu.time, "monotonic", lambda: clock[0])
    assert bench_gpu.Budget(None).timeout(420.0, "anything") == 420.0
    budget = bench_gpu.Budget(100.0)
    assert budget.timeout(120.0, "resnet50 round 1 trainer") == 100.0
    clock[0] += 70
    assert budget.timeout(120.0, "gpt_1b") == 30.0
    clock[0] += 15
    assert budget.timeout(120.0, "llama3_1b") is None  # 15 s left: under MIN_LAUNCH_S
    assert budget.skipped == ["llama3_1b"]
    # A launch leaves what the launches after it need: 100 s left, 50 kept back.
    budget = bench_gpu.Budget(100.0)
    assert budget.timeout(420.0, "llama3_1b_variants", reserve=50.0) == 50.0
    assert budget.timeout(420.0, "too much kept back", reserve=90.0) is None


def test_bench_gpu_decoder_options_are_per_section(bench_gpu, monkeypatch):
    """Each decoder section reads its own options; a batch that micro-batches do not divide is
    refused with the section's option names."""
    argv = ["bench_gpu.py", "--llama-batch", "12", "--llama-micro", "3", "--llama-compile"]
    monkeypatch.setattr(sys, "argv", argv)
    args = bench_gpu.parse_args()
    gpt, llama = (bench_gpu.DecoderRun.from_args(args, dec) for dec in bench_gpu.DECODERS)
    assert (gpt.decoder.section, gpt.batch, gpt.micro, gpt.steps, gpt.compile) == (
        "gpt_1b",
        8,
        4,
        25,
        False,
    )
    assert (llama.decoder.section, llama.batch, llama.micro, llama.steps, llama.compile) == (
        "llama3_1b",
        12,
        3,
        20,
        True,
    )
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--llama-batch", "6"])
    with pytest.raises(SystemExit):
        bench_gpu.parse_args()


def test_bench_gpu_without_cuda_exits_2_with_its_message(bench_gpu, tmp_path, monkeypatch, capsys):
    """Its main in this process (the script's exit code is main's return value)."""
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--out", str(tmp_path / "out")])
    assert bench_gpu.main() == 2
    output = capsys.readouterr().err
    assert "bench_gpu: no CUDA device" in output and "nothing was measured" in output
    assert not (tmp_path / "out").exists()  # it stops before it starts anything


@pytest.fixture
def bench_gpu(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
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
    from sdnet_trainer.training.classes import resolve_trainer_class

    assert resolve_trainer_class(resnet.trainer._target_) is bench_gpu.GpuBenchTrainer

    args = argparse.Namespace(gpt_batch=8, gpt_micro=4, gpt_steps=25, gpt_compile=False)
    gpt_run = bench_gpu.DecoderRun.from_args(args, bench_gpu.DECODERS[0])
    gpt = compose(_config_keys(bench_gpu.decoder_keys(gpt_run, tmp_path)))
    assert gpt.model.gpt.n_layers == 18 and gpt.model.gpt.dim == 2048  # configs/model/gpt_1b
    assert gpt.data.name == "tokens" and gpt.precision.dtype == "bf16"
    assert (gpt.data.vocab_size, gpt.data.seq_len) == (32000, 2048)
    assert gpt.loop.global_batch_size == 8 and gpt.loop.grad_accum_steps == 2
    assert gpt.logging.flops  # MFU comes from the Trainer's own FLOP count


def test_bench_gpu_llama3_1b_launch_passes_preflight_for_one_gpu(bench_gpu, tmp_path, monkeypatch):
    """The llama3_1b launch is configs/model/llama3_1b on data=tokens with the model's vocabulary
    and a 2,048-token context, and the whole-config validation the CLI runs before start accepts
    it (and gpt_1b's) for one process on a machine with a GPU."""
    from sdnet_trainer.preflight import validate

    args = argparse.Namespace(llama_batch=8, llama_micro=4, llama_steps=10, llama_compile=False)
    llama = bench_gpu.DECODERS[1]
    keys = bench_gpu.decoder_keys(bench_gpu.DecoderRun.from_args(args, llama), tmp_path)
    assert f"hydra.run.dir={tmp_path}" in keys
    cfg = compose(_config_keys(keys))
    sizes = cfg.model.llama
    assert cfg.model.name == "llama" and (sizes.dim, sizes.n_layers) == (2048, 16)
    assert (sizes.n_heads, sizes.n_kv_heads, sizes.hidden_dim) == (32, 8, 8192)
    assert sizes.tie_embeddings and sizes.rope_scaling.rope_type == "llama3"
    assert (cfg.data.name, cfg.data.vocab_size, cfg.data.seq_len) == ("tokens", 128256, 2048)
    assert cfg.data.train_size == 8 * 11  # every step inside one epoch
    assert cfg.precision.dtype == "bf16" and not cfg.compile.enabled
    assert cfg.optim.name == "AdamW" and cfg.dist.device == "cuda"
    assert (cfg.loop.global_batch_size, cfg.loop.grad_accum_steps, cfg.loop.max_steps) == (8, 2, 10)
    assert cfg.logging.log_every_n_steps == 2 and cfg.logging.flops
    # Without a GPU the validation refuses dist.device=cuda: it does run the device checks.
    with pytest.raises(ConfigError, match="dist.device=cuda"):
        validate(cfg, world_size=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    validate(cfg, world_size=1)
    gpt_args = argparse.Namespace(gpt_batch=8, gpt_micro=4, gpt_steps=15, gpt_compile=False)
    gpt_run = bench_gpu.DecoderRun.from_args(gpt_args, bench_gpu.DECODERS[0])
    validate(compose(_config_keys(bench_gpu.decoder_keys(gpt_run, tmp_path))), world_size=1)


@pytest.mark.full  # seconds: out of the quick tier
def test_bench_gpu_machinery_runs_on_the_cpu(tmp_path, monkeypatch, capfd):
    """--cpu-smoke: both ResNet sides launched and timed (a ResNet-18 at 32x32, fp32), the loader
    section on generated JPEGs, the table and the JSON that gpu_check.sh reads. The driver's main
    runs in this process (the launches are processes of their own, as on the GPU node)."""
    figures_file = tmp_path / "figures.json"
    argv = ["--cpu-smoke", "--out", str(tmp_path / "out"), "--json", str(figures_file)]
    code, output = bench_main_in_process(
        "bench_gpu", argv, cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd
    )
    assert code == 0, output
    figures = json.loads(figures_file.read_text())
    assert figures["matmul"]["tflops_per_s"] > 0 and figures["matmul"]["size"] == 64
    resnet = figures["resnet50"]
    for side in ("trainer", "hand"):
        assert resnet[side]["failed"] is None and resnet[side]["images_per_s"] > 0, resnet
        # Both sides' TFLOP/s from the Trainer's own count per image (the same model).
        assert resnet[side]["tflops_per_s"] == pytest.approx(
            resnet[side]["images_per_s"] * resnet["flops_per_image"] / 1e12
        )
    assert resnet["flops_per_image"] > 0
    assert figures["skipped"] == []
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
    assert figures["decoders"] == []  # no 1B decoder on a CPU
    assert "gpt_1b" not in figures and "llama3_1b" not in figures
    assert "2,470 images/s" in output and "trainer / hand" in output


@pytest.mark.full  # a minute of launches: out of the quick tier
def test_bench_gpu_second_command_machinery_runs_on_the_cpu(tmp_path, monkeypatch, capfd):
    """--second --cpu-smoke: the variants worker's launches as on the node (one process; torchrun
    of one for FSDP2's group; two ranks for context parallel), on the debug models. Each variant
    ran as named (the worker's record), the later variants started from the first's weights (the
    same losses as it, to rounding), and the table and JSON gpu_check.sh reads are written."""
    figures_file = tmp_path / "figures.json"
    argv = ["--second", "--cpu-smoke", "--sections", "moe,cp,llama3_1b_variants"]
    argv += ["--out", str(tmp_path / "out"), "--json", str(figures_file)]
    code, output = bench_main_in_process(
        "bench_gpu", argv, cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd
    )
    assert code == 0, output
    figures = json.loads(figures_file.read_text())
    assert figures["variant_sections"] == ["llama3_1b_variants", "moe", "cp"]
    rows = {s: figures[s]["rows"] for s in figures["variant_sections"]}
    for section in rows.values():
        for name, row in section.items():
            assert row["failed"] is None and row["tokens_per_s"] > 0, (name, row)
            assert row["log_points"] >= 2, (name, row)
    moe, cp, llama = rows["moe"], rows["cp"], rows["llama3_1b_variants"]
    # The grouped matmul ran in one and not in the other: the loop is really the loop.
    assert moe["grouped"]["built"]["grouped_mm_calls"] > 0
    assert moe["loop"]["built"]["grouped_mm_calls"] == 0
    assert moe["loop"]["versus"] == "grouped" and moe["loop"]["loss_gap"] < 1e-2
    # Context parallel against one process (the ring is CUDA's: not on the CPU).
    assert list(cp) == ["one_process", "allgather"]
    assert cp["allgather"]["versus"] == "one_process" and cp["allgather"]["loss_gap"] < 1e-3
    # FSDP2 sharded the copy of the plain run's initial model, and trained it alike.
    assert llama["bf16_eager"]["built"]["fsdp"] is False
    assert llama["fsdp2_eager"]["built"]["fsdp"] is True
    first = llama["bf16_eager"]["losses"][0]
    assert llama["fsdp2_eager"]["losses"][0] == pytest.approx(first, rel=1e-4)  # bf16 rounding
    assert llama["fsdp2_eager"]["loss_gap"] < 1e-3 and llama["fsdp2_eager"]["ratio"] > 0
    assert "float8 kernels are the GPU's" in figures["llama3_1b_variants"]["float8_not_run"]
    # A later variant's FLOP count is the meta build's, as the first's: not a real forward and
    # backward of a CPU copy (minutes for a 1B model), and the same count.
    log = tmp_path / "out" / "llama3_1b_variants" / "llama3_1b_variants" / "train.log"
    assert "world size 1 on cpu" in log.read_text()  # the Trainer's own log, both runs
    assert "CPU copy" not in log.read_text()
    assert llama["fsdp2_eager"]["tflops_per_s"] / llama["fsdp2_eager"]["tokens_per_s"] == (
        pytest.approx(llama["bf16_eager"]["tflops_per_s"] / llama["bf16_eager"]["tokens_per_s"])
    )
    assert "FSDP2 bf16 eager" in output and "x bf16 eager" in output
