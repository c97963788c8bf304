"""Every command line of README.md and docs/*.md that runs the trainer works as written.

A command is a line of a fenced code block (``\\`` continuations joined) that runs
``python -m sdnet_trainer ...`` or ``torchrun ... -m sdnet_trainer ...``, ``--plan``, ``--dry-run``
and Hydra's ``-m`` sweeps included; other programs (export, serve, scripts/) are other tests'.
Each is taken as the command line takes it, in this process: ``check_overrides``, ``compose``,
``validate_switched_keys`` on the keys it gives, then ``preflight.validate`` at its world size
(torchrun's ``--nproc_per_node`` x ``--nnodes``, at each node count of an elastic range;
``world_size=N`` of ``--plan`` and ``--dry-run``, the dry run's config as it builds it; a sweep's
``hydra.launcher`` processes). What needs what this machine lacks (a GPU, an optional extra, a
Hugging Face checkpoint) is composed but not validated, the skip naming why; ``parallel=auto`` is
composed and its figures read (``plan/hardware.py``), and planned where the model is small
(``PLANNED``). A block whose opening fence follows a ``<!-- quick -->`` line trains to the end:
its commands run on the CPU for a few steps (``QUICK_RUN``).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from sdnet_trainer.config import Config, compose
from sdnet_trainer.config.guards import given_keys, validate_switched_keys
from sdnet_trainer.config.synonyms import check_overrides
from sdnet_trainer.distributed.mesh import parallel_dims
from sdnet_trainer.observability.prometheus import prometheus_enabled
from sdnet_trainer.observability.trackers import EXTRAS as TRACKER_EXTRAS
from sdnet_trainer.plan.auto import check_auto_keys, plan_layout
from sdnet_trainer.plan.cli import parse_args
from sdnet_trainer.plan.dry_run import buildable
from sdnet_trainer.plan.hardware import DEFAULT_RANKS_PER_NODE, hardware
from sdnet_trainer.preflight import validate
from tests.support import REPO, run_cli

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The line before a fenced block whose commands run to the end here (an HTML comment: the page
# shows nothing).
QUICK = "<!-- quick -->"
# What a quick command gets after its own overrides: the CPU, and a few steps of a small run.
QUICK_RUN = [
    "dist.device=cpu",
    "loop.max_steps=4",
    "loop.eval_every_n_steps=4",
    "data.train_size=256",
    "data.val_size=64",
    "logging.log_every_n_steps=2",
]
# Placeholders the pages write where a user puts their own, and what each stands for here
# ({tmp}: a folder of this module's; llama/config.json there is a small Llama's Hugging Face
# config). Regular expressions, replaced in order in the line as written.
PLACEHOLDERS: list[tuple[str, str]] = [
    (r"\+recipe=NAME\b", "+recipe=quickstart"),
    (r"(?<!\S)key=value(?!\S)", ""),
    (r"(?<!\S)\.\.\.(?!\S)", ""),  # more torchrun options or overrides
    (r"\[torchrun_args\]", ""),
    (r"<the trial's overrides>", ""),
    (r"<trial dir>", "{tmp}/trial"),
    (r"=N\b", "=2"),  # --nproc_per_node=N, --nnodes=N
    (r"\$g\b", "0"),  # the replica group of a fault-tolerant launch
    (r"/models/Llama-3\.2-1B/config\.json", "{tmp}/llama/config.json"),
    (r"model\.hf_config=PATH\b", "model.hf_config={tmp}/llama"),
]
# The models whose parallel=auto plan takes a few seconds (an 8B model's takes a minute): the
# others' commands are composed, and their figures read, without the plan.
PLANNED = {"simple_cnn", "gpt_tiny", "llama3_debug", "moe_debug"}
# Llama 3.2 1B's Hugging Face config.json with its layers made small: the vocabulary, the context
# and the rope scaling a command meets are the real ones.
SMALL_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


@dataclass(frozen=True)
class DocCommand:
    where: str  # page:line of its first line
    line: str  # as the page writes it, continuations joined
    quick: bool


@dataclass
class Launch:
    """What the command line makes of a command."""

    command: str  # train, --plan or --dry-run
    overrides: list[str]
    world_sizes: list[int]
    multirun: bool = False
    hydra: list[str] = field(default_factory=list)  # hydra/... and hydra.* overrides


def doc_commands() -> Iterator[DocCommand]:
    for page in PAGES:
        fenced, quick, start, joined = False, False, 0, ""
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                quick = fenced and number > 1 and lines[number - 2].strip() == QUICK
                joined = ""
                continue
            if not fenced:
                continue
            if not joined:
                start = number
            joined += " " + line.strip()
            if joined.endswith("\\"):
                joined = joined[:-1].rstrip()
                continue
            text, joined = joined.strip(), ""
            if re.search(r"-m sdnet_trainer(\s|$)", text) and not text.startswith("#"):
                where = f"{page.relative_to(REPO)}:{start}"
                yield DocCommand(where, text, quick)


COMMANDS = list(doc_commands())


def _trainer_words(line: str, tmp: Path) -> tuple[list[str], list[str]]:
    """(the launcher's words, the trainer's arguments) of the command in ``line``."""
    for pattern, value in PLACEHOLDERS:
        line = re.sub(pattern, value.replace("{tmp}", str(tmp)), line)
    words = shlex.split(line.removeprefix("$ "), comments=True)
    # The command among others joined by && or ; (an install before it).
    segments: list[list[str]] = [[]]
    for word in words:
        if word in ("&&", "||", ";", "|"):
            segments.append([])
        else:
            segments[-1].append(word)
    for segment in segments:
        for i in range(len(segment) - 1):
            if segment[i : i + 2] == ["-m", "sdnet_trainer"]:
                return segment[:i], segment[i + 2 :]
    raise AssertionError(f"no -m sdnet_trainer in {line!r}")


def _torchrun_world(launcher: list[str]) -> list[int]:
    """The world sizes torchrun's options give (``--nnodes=1:4``: each node count an elastic
    launch may run on); 1 without torchrun."""
    if not any(Path(w).name == "torchrun" or w == "torch.distributed.run" for w in launcher):
        return [1]
    options = dict(w.lstrip("-").replace("-", "_").split("=", 1) for w in launcher if "=" in w)
    nproc = int(options.get("nproc_per_node", 1))
    least, _, most = options.get("nnodes", "1").partition(":")
    return [nproc * n for n in range(int(least), int(most or least) + 1)]


def parse(line: str, tmp: Path) -> Launch:
    launcher, args = _trainer_words(line, tmp)
    for command in ("--plan", "--dry-run"):
        if command in args:  # cli.main: the planning commands take the rest as theirs
            world_size, _, _, overrides = parse_args([a for a in args if a != command], command)
            return Launch(command, overrides, [world_size])
    multirun = "-m" in args or "--multirun" in args
    overrides, hydra = [], []
    for arg in args:
        if arg in ("-m", "--multirun"):
            continue
        if arg.startswith("--config-name"):
            # @hydra.main's own config: another name would be another program.
            assert arg.split("=", 1)[-1] == "config", arg
        elif arg.startswith(("hydra/", "hydra.")):
            hydra.append(arg)
        else:
            overrides.append(arg)
    world = _torchrun_world(launcher)
    options = dict(h.split("=", 1) for h in hydra if h.startswith("hydra.launcher."))
    if "hydra.launcher.nproc_per_node" in options:  # hydra/launcher=torchrun: a trial's world
        world = [int(options["hydra.launcher.nproc_per_node"])]
    elif "hydra.launcher.nodes" in options:  # hydra/launcher=slurm: a task per GPU
        world = [
            int(options["hydra.launcher.nodes"])
            * int(options.get("hydra.launcher.gpus_per_node", 8))
        ]
    return Launch("train", overrides, world, multirun, hydra)


def _first_of_each_sweep(overrides: list[str]) -> list[str]:
    """A sweep's first trial: each swept key at its first value (an interval at its start)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = []
    for text, parsed in zip(
        overrides, OverridesParser.create().parse_overrides(overrides), strict=True
    ):
        if not parsed.is_sweep_override():
            out.append(text)
        elif parsed.is_interval_sweep():
            out.append(f"{parsed.get_key_element()}={parsed.value().start}")
        else:
            first = next(iter(parsed.sweep_string_iterator()))
            out.append(f"{parsed.get_key_element()}={first}")
    return out


@functools.cache
def _composed(overrides: tuple[str, ...]) -> Config:
    check_overrides(overrides)
    cfg = compose(overrides)
    validate_switched_keys(cfg, given_keys(overrides))
    return cfg


def _has(*modules: str) -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except ModuleNotFoundError:  # a parent package missing
        return False


# Hydra's plugins a sweep asks for, and their extras.
HYDRA_PLUGINS = {
    "hydra/sweeper=sdnet_optuna": ("hydra_plugins.hydra_optuna_sweeper", "sweep"),
    "hydra/launcher=slurm": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
}
# What a config may need beyond the CPU and the core install: (whether it does, what, whether it
# is here). The first one missing skips the command's validation, naming it.
NEEDS: list[tuple[Callable[[Config], bool], str, Callable[[], bool]]] = [
    (lambda c: c.dist.device == "cuda", "a GPU (dist.device=cuda)", torch.cuda.is_available),
    (lambda c: c.precision.float8 is not None, "the float8 extra", lambda: _has("torchao")),
    (lambda c: c.fault_tolerance.enabled, "the ft extra (torchft)", lambda: _has("torchft")),
    (lambda c: c.model.lora.enabled, "the lora extra (peft)", lambda: _has("peft")),
    (
        lambda c: any(
            t in TRACKER_EXTRAS and not _has(TRACKER_EXTRAS[t][0]) for t in c.logging.trackers
        ),
        "a tracker's package (logging.trackers)",
        lambda: False,
    ),
    (
        lambda c: prometheus_enabled(c.logging.prometheus),
        "the monitor extra (logging.prometheus)",
        lambda: _has("prometheus_client", "psutil"),
    ),
    (
        lambda c: str(c.checkpoint.dir or "").startswith("s3://"),
        "the s3 extra (s3fs)",
        lambda: _has("s3fs"),
    ),
    (
        lambda c: c.model.hf_config is not None or c.data.tokenizer is not None,
        "the llm extra (transformers)",
        lambda: _has("transformers"),
    ),
    (
        lambda c: str(c.model.weights or "").startswith("hf:"),
        "a Hugging Face checkpoint (model.weights: the shapes of its tensors are read)",
        lambda: False,
    ),
]


def _missing(cfg: Config) -> str | None:
    return next((what for needs, what, here in NEEDS if needs(cfg) and not here()), None)


def _named_models(overrides: list[str]) -> set[str]:
    """The recipe and the model a command names (``+recipe=X``, ``model=X``)."""
    return {o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] in ("+recipe", "model")}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("doc_commands")
    (folder / "llama").mkdir()
    (folder / "llama" / "config.json").write_text(json.dumps(SMALL_LLAMA))
    return folder


def _id(command: DocCommand) -> str:
    return command.where


def test_the_pages_show_the_commands_checked_here():
    """The extraction finds what a reader sees: the quickstart, a plan, a dry run, a sweep, a
    multi-node launch and the quick blocks."""
    lines = [c.line for c in COMMANDS]
    assert len(COMMANDS) >= 35
    assert any("--nproc_per_node=2 -m sdnet_trainer +recipe=quickstart" in t for t in lines)
    assert any("--plan world_size=" in t for t in lines)
    assert any("--dry-run world_size=" in t for t in lines)
    assert any(" -m sdnet_trainer -m " in t for t in lines)
    assert any("--nnodes=2" in t for t in lines)
    assert len([c for c in COMMANDS if c.quick]) >= 2


@pytest.mark.parametrize("doc", COMMANDS, ids=_id)
def test_the_command_composes_and_validates(doc: DocCommand, tmp: Path):
    launch = parse(doc.line, tmp)
    overrides = _first_of_each_sweep(launch.overrides) if launch.multirun else launch.overrides
    if launch.command == "--plan":
        overrides = [*overrides, "parallel.strategy=auto"]  # as plan/cli.py's plan
    absent = [HYDRA_PLUGINS[h] for h in launch.hydra if h in HYDRA_PLUGINS]
    absent = [(module, extra) for module, extra in absent if not _has(module)]
    # Without the plugin Hydra cannot compose its keys: the trainer's config alone.
    hydra = [] if absent else launch.hydra
    cfg = copy.deepcopy(_composed(tuple([*hydra, *overrides])))
    missing = f"the {absent[0][1]} extra (Hydra's plugin)" if absent else _missing(cfg)
    if missing is not None:
        pytest.skip(f"{doc.where}: composed; not validated: it needs {missing}")
    for world_size in launch.world_sizes:
        if cfg.parallel.strategy == "auto":
            check_auto_keys(cfg)
            hw = hardware(cfg, torch.device("cpu"), ranks_per_node=DEFAULT_RANKS_PER_NODE)
            if not PLANNED & _named_models(overrides):
                pytest.skip(
                    f"{doc.where}: composed, its figures read ({hw.memory_source}; "
                    f"{hw.flops_source}); not planned: a large model's plan takes a minute"
                )
            plan_layout(cfg, world_size, hw)
            continue
        if launch.command == "--dry-run":
            cfg = buildable(cfg, parallel_dims(cfg.parallel, world_size))
        validate(cfg, world_size=world_size)


QUICK_COMMANDS = [c for c in COMMANDS if c.quick]


@pytest.mark.parametrize("doc", QUICK_COMMANDS, ids=_id)
def test_a_quick_command_trains_to_the_end(doc: DocCommand, tmp: Path):
    launch = parse(doc.line, tmp)
    assert launch.command == "train" and not launch.multirun, doc.where
    (world_size,) = launch.world_sizes
    run_dir = tmp / re.sub(r"\W", "_", doc.where)
    ran = run_cli(
        [*launch.overrides, *QUICK_RUN, f"hydra.run.dir={run_dir}"],
        cwd=tmp,
        nproc=world_size if world_size > 1 else None,
        timeout=120,
    )
    assert ran.returncode == 0, f"{doc.where}: {doc.line}\n{ran.output[-3000:]}"
    assert "done: 4 steps" in ran.output, ran.output[-3000:]
