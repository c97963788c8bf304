"""The planning commands: a launch checked, or chosen, on this machine without its GPUs.

    python -m sdnet_trainer --dry-run world_size=N [ranks=0,256|all] [json=PATH] key=value ...
    python -m sdnet_trainer --plan world_size=N [json=PATH] key=value ...

``--dry-run`` builds the layout the config names, rank by rank, on the fake process group and
the meta device, and prints a line naming context parallel, float8 and activation checkpointing,
then each rank's bytes (activations: an estimate), its start (initialisation and a Hugging Face
load, ``plan/start_cost.py``) and collectives (``plan/dry_run.py``); with
``parallel=auto`` it first chooses the layout as a launch would. ``--plan`` prints the planner's
table for the config (``plan/auto.py``) whatever ``parallel`` says, and the keys of its choice.
Both print a config error as the launch would, with exit code 2.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from sdnet_trainer.config import Config, compose
from sdnet_trainer.config.guards import given_keys, validate_switched_keys
from sdnet_trainer.data import resolve_num_classes
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.distributed.mesh import ParallelDims, parallel_dims
from sdnet_trainer.errors import EXIT_CONFIG_ERROR, ConfigError
from sdnet_trainer.plan.auto import (
    Plan,
    check_auto_keys,
    layout_overrides,
    plan_layout,
    table,
    with_layout,
)
from sdnet_trainer.plan.dry_run import (
    Collective,
    RankPlan,
    buildable,
    cp_attention,
    plan_rank,
)
from sdnet_trainer.plan.hardware import DEFAULT_RANKS_PER_NODE, hardware
from sdnet_trainer.plan.start_cost import StartCost
from sdnet_trainer.preflight import validate
from sdnet_trainer.training.classes import resolve_trainer_class


def parse_args(argv: list[str], command: str) -> tuple[int, str | None, Path | None, list[str]]:
    """``world_size=N``, ``ranks=...`` and ``json=PATH`` are the command's; the rest is config."""
    world_size, ranks, out, overrides = None, None, None, []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "world_size":
            world_size = int(value)
        elif key == "ranks" and command == "--dry-run":
            ranks = value
        elif key == "json":
            out = Path(value)
        else:
            overrides.append(arg)
    if world_size is None or world_size < 1:
        raise ConfigError(f"{command} needs world_size=N (N >= 1): the launch's number of ranks")
    return world_size, ranks, out, overrides


def chosen_ranks(spec: str | None, dims: ParallelDims, world_size: int) -> list[int]:
    if spec == "all":
        return list(range(world_size))
    if spec:
        ranks = [int(r) for r in spec.split(",")]
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise ConfigError(f"ranks={spec}: {bad} not in 0..{world_size - 1}")
        return ranks
    # Row-major over (pp, dp_replicate, dp_shard, cp, tp): the first rank of each stage.
    return [s * (world_size // dims.pp) for s in range(dims.pp)]


def merged(collectives: list[Collective]) -> list[Collective]:
    """Identical collectives (one per block) counted together, in order of first appearance."""
    out: dict[tuple[str, str, int], Collective] = {}
    for c in collectives:
        key = (c.kind, c.over, c.bytes_each)
        if key in out:
            out[key].count += c.count
        else:
            out[key] = Collective(c.kind, c.over, c.count, c.bytes_each)
    return list(out.values())


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def settings(cfg: Config, dims: ParallelDims, plans: list[RankPlan]) -> str:
    """The settings that change what a rank keeps and sends, in one line: ``cp 8 (allgather) ·
    float8 rowwise (112 of 113 Linear layers) · activation checkpointing selective``."""
    parts = [f"cp {dims.cp} ({cp_attention(cfg)})" if dims.cp > 1 else "cp 1"]
    recipe = cfg.precision.float8
    if recipe is None:
        parts.append("float8 off")
    else:
        converted = f" ({plans[0].float8_layers} of {plans[0].linear_layers} Linear layers)"
        parts.append(f"float8 {recipe}{converted if plans else ''}")
    mode = cfg.parallel.activation_checkpointing
    every = cfg.parallel.activation_checkpointing_every
    parts.append(
        f"activation checkpointing {mode}" + (f" (every {every} blocks)" if every > 1 else "")
    )
    return " · ".join(parts)


def report(plan: RankPlan) -> str:
    lines = [
        f"rank {plan.rank} {plan.coordinates}",
        f"  parameters {_mb(plan.params)}  gradients {_mb(plan.grads)}  "
        f"optimizer {_mb(plan.optim)}  activations ~{_mb(plan.activations)} (estimate)",
    ]
    if plan.expert_params:
        lines.append(
            f"  of which experts: parameters {_mb(plan.expert_params)}  "
            f"optimizer {_mb(plan.expert_optim)}"
        )
    if plan.start is not None:
        lines += start_lines(plan.start)
    for c in merged(plan.collectives):
        lines.append(f"  {c.kind:<46} over {c.over:<16} x{c.count:<5} {_mb(c.bytes_each)} each")
    return "\n".join(lines)


def _size(n: int) -> str:
    """Bytes in the largest unit that keeps a whole number in front: the start's figures run
    from a few hundred bytes (rotary frequencies) to the gigabytes of a shard."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def start_lines(start: StartCost) -> list[str]:
    """The rank's start (``plan/start_cost.py``): initialisation from scratch, or a Hugging
    Face load, each as the code path a launch runs would touch and allocate."""
    lines = []
    init, load = start.init, start.load
    if init is not None:
        # Under FSDP's CPU offload the parameters, and so their fills' scratch, are on the host.
        offloaded = f" + parameters {_size(init.host_params)}" if init.host_params else ""
        scratch = "host scratch" if init.host_params else "device scratch"
        lines.append(
            f"  start, init: device {_size(init.device)} (parameters, buffers)  "
            f"values {init.values:,} ({init.draws} draws)  {scratch} {_size(init.scratch)}  "
            f"host {_size(init.host)} ({init.replayed} replayed steps){offloaded}"
        )
    if load is not None:
        lines.append(
            f"  start, Hugging Face load: reads {_size(load.read)} in {load.reads} items  "
            f"largest {_size(load.largest)}  host {_size(load.host)}"
        )
    if start.note:
        lines.append(f"  start: {start.note}")
    return lines


def _planning_device() -> torch.device:
    """This machine's GPU if it has one (its memory is read where no key says), else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _composed(overrides: list[str], world_size: int) -> tuple[Config, Plan | None]:
    cfg = compose(overrides)
    validate_switched_keys(cfg, given_keys(overrides))  # a key given whose switch is off
    # The data decides the class count the model is built with, as in Trainer.setup (and a
    # missing data folder is an error a launch would hit).
    probe = resolve_trainer_class(cfg.trainer._target_)(cfg, env=DistEnv())
    resolve_num_classes(cfg, probe.build_datasets()[0])
    if cfg.parallel.strategy != "auto":
        return cfg, None
    check_auto_keys(cfg)
    # No launcher here says how many ranks share a node: the command plans a launch on nodes of
    # DEFAULT_RANKS_PER_NODE unless parallel.auto.ranks_per_node says otherwise.
    hw = hardware(cfg, _planning_device(), ranks_per_node=DEFAULT_RANKS_PER_NODE)
    chosen = plan_layout(cfg, world_size, hw)
    print(table(chosen, cfg))
    return with_layout(cfg, chosen.layout), chosen


def dry_run(argv: list[str]) -> int:
    try:
        world_size, spec, out, overrides = parse_args(argv, "--dry-run")
        cfg, _ = _composed(overrides, world_size)
        dims = parallel_dims(cfg.parallel, world_size)
        validate(buildable(cfg, dims), world_size=world_size)
        print(f"world size {world_size}: {dims.describe()} ({cfg.parallel.strategy})")
        plans = [plan_rank(cfg, r, world_size) for r in chosen_ranks(spec, dims, world_size)]
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(settings(cfg, dims, plans))
    measured = plans[0].activation_dtype if plans else "fp32"
    print(
        "activations: an estimate, the bytes one forward of a micro-batch keeps for backward, "
        f"measured on the meta model ({measured}) with these settings (docs/parallel.md)"
    )
    print(
        "start: per rank, what allocating and initialising its shards, or reading them from a "
        "Hugging Face folder (bf16), would touch and allocate (docs/parallel.md)"
    )
    for p in plans:
        print(report(p))
    if out is not None:
        out.write_text(json.dumps([asdict(p) for p in plans], indent=1))
    return 0


def plan(argv: list[str]) -> int:
    try:
        world_size, _, out, overrides = parse_args(argv, "--plan")
        _, chosen = _composed([*overrides, "parallel.strategy=auto"], world_size)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    assert chosen is not None
    if out is not None:
        record = {
            "world_size": world_size,
            "hardware": asdict(chosen.hardware),
            "considered": chosen.considered,
            "fitting": chosen.fitting,
            "shown": [
                {
                    "layout": asdict(e.layout),
                    "describe": e.layout.describe(),
                    "overrides": layout_overrides(e.layout),
                    "bytes": e.bytes,
                    "seconds": e.seconds,
                    "step_seconds": e.step_seconds,
                }
                for e in chosen.shown
            ],
            "dry_run": [asdict(p) for p in chosen.checked],
        }
        out.write_text(json.dumps(record, indent=1))
    return 0


__all__ = ["dry_run", "plan"]
