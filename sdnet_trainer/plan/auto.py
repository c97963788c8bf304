"""``parallel=auto``: the layout chosen from the model, the world size, the memory and the links.

    python -m sdnet_trainer --plan world_size=64 +recipe=llama3_8b parallel.auto.device=cuda \\
        parallel.memory_per_rank_gib=80 parallel.auto.peak_tflops=989   # the table, no launch
    torchrun --nproc_per_node=8 -m sdnet_trainer +recipe=llama3_8b parallel=auto

1. Enumerate what the model allows on ``world_size`` ranks: DDP, ZeRO-1, FSDP and HSDP (a shard
   group of one node) over the data-parallel ranks, every tensor and pipeline degree that divides
   the world (pipeline schedules 1F1B and, with two blocks per stage or more, Interleaved1F1B),
   for a mixture of experts every expert-parallel degree that divides FSDP's shard group and the
   experts (its tensor parallel is refused: ``models/moe``), and for a long sequence every
   context-parallel degree that leaves each rank ``MIN_CONTEXT_TOKENS`` of it at least,
   activation checkpointing off and on, and every micro-batch that splits the global batch.
2. Count each one's bytes per rank and estimate its step time (``plan/estimate.py``) from the
   model's stats (``plan/model_stats.py``) and the machines' figures (``plan/hardware.py``).
3. Keep those whose bytes fit the memory a layout may fill (``memory_fraction`` of the rank's),
   fastest first; the validator of a launch (``preflight.validate``) refuses what it would
   refuse, and the dry run (``plan/dry_run.py``) builds the best one's first and last stage as a
   launch would and must count bytes that fit too, or the next is taken.
4. The choice is set in the run's config (the checkpoints record it): a resume on the same world
   size takes the layout of the checkpoint it resumes; on another world size it plans again.

Every rank plans alone, before the process group exists, from figures all ranks read alike; the
planning is deterministic, so they choose the same layout (``cli`` checks it once the group is up).
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sdnet_trainer.checkpoint.files import Folder
from sdnet_trainer.config import Config
from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.data import is_language_model_data, resolve_num_classes
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.registry import model_family
from sdnet_trainer.plan.dry_run import RankPlan, plan_rank
from sdnet_trainer.plan.estimate import TIME_PARTS, Estimate, Hardware, Layout, estimate
from sdnet_trainer.plan.hardware import hardware
from sdnet_trainer.plan.layouts import recorded_layout
from sdnet_trainer.plan.model_stats import ModelStats, model_stats
from sdnet_trainer.preflight import validate
from sdnet_trainer.training.classes import resolve_trainer_class
from sdnet_trainer.training.fits import in_units

logger = logging.getLogger(__name__)

INTERLEAVED = "Interleaved1F1B"
# A kind of layout (strategy, replicas, tensor and pipeline parallelism, checkpointing) the
# validator refused this often is refused for the rest of the plan: some settings rule a kind out
# whatever its numbers (fp16 outside plain DDP, a DDP comm hook, sync_batchnorm).
_REFUSALS_PER_KIND = 3


@dataclass
class Plan:
    world_size: int
    hardware: Hardware
    considered: int
    fitting: int
    shown: list[Estimate]  # the fastest valid layouts that fit, the chosen first
    refused: list[tuple[Layout, str]] = field(default_factory=list)
    checked: list[RankPlan] = field(default_factory=list)  # the dry run of the chosen layout

    @property
    def chosen(self) -> Estimate:
        return self.shown[0]

    @property
    def layout(self) -> Layout:
        return self.chosen.layout


def resolve_auto(
    cfg: Config, world_size: int, *, checkpoint_dir: Folder | None, device: torch.device
) -> Config:
    """``cfg`` with ``parallel=auto`` replaced by a layout: the resumed checkpoint's on the same
    world size, else the plan's (its table logged)."""
    check_auto_keys(cfg)
    recorded = recorded_layout(cfg, checkpoint_dir, world_size)
    if recorded is not None:
        layout, source = recorded
        resumed = with_layout(cfg, layout)
        try:
            validate(resumed, world_size=world_size)
        except ConfigError as err:
            logger.warning("parallel=auto: the layout of %s is refused (%s): planning", source, err)
        else:
            logger.info("parallel=auto: %s, the layout of %s", layout.describe(), source)
            return resumed
    plan = plan_layout(cfg, world_size, hardware(cfg, device))
    logger.info("%s", table(plan, cfg))
    return with_layout(cfg, plan.chosen.layout)


def check_auto_keys(cfg: Config) -> None:
    """``parallel.auto.*`` and the memory key, before the figures are read."""
    auto = cfg.parallel.auto
    check_positive(
        "parallel.memory_per_rank_gib", cfg.parallel.memory_per_rank_gib, allow_none=True
    )
    optional = ("peak_tflops", "block_overhead_us", "ranks_per_node", "max_tp", "max_pp")
    links = ("intra_node_gbps", "inter_node_gbps", "latency_us")
    for key in (*optional, *links):
        check_positive(f"parallel.auto.{key}", getattr(auto, key), allow_none=True)
    for key in ("memory_fraction", "efficiency", "show"):
        check_positive(f"parallel.auto.{key}", getattr(auto, key))
    check_choice("parallel.auto.device", auto.device, ("auto", "cpu", "cuda"))
    for key in ("ep", "cp"):  # the planner's to choose, as the other degrees
        if getattr(cfg.parallel, key) != 1:
            raise ConfigError(
                f"parallel=auto with parallel.{key}={getattr(cfg.parallel, key)}: the planner "
                f"chooses expert and context parallel as it chooses the other degrees; leave "
                f"parallel.{key} at 1, or set the layout with parallel=fsdp and check it with "
                f"python -m sdnet_trainer --dry-run world_size=N"
            )
    for key in ("memory_fraction", "efficiency"):
        if getattr(auto, key) > 1:
            raise ConfigError(f"parallel.auto.{key}={getattr(auto, key)} must be at most 1")


def plan_layout(cfg: Config, world_size: int, hw: Hardware) -> Plan:
    """The plan of ``cfg``'s model on ``world_size`` ranks with ``hw``; a ConfigError saying what
    would fit when nothing does."""
    _resolve_classes(cfg)
    family = model_family(cfg.model.name)
    if family is not None and family.validate is not None:
        family.validate(cfg, tp=1, pp=1)  # what is wrong whatever the layout, said as such
    stats = model_stats(cfg)
    estimates = _estimates(cfg, stats, world_size, hw)
    fitting = sorted(
        (e for e in estimates if e.total_bytes <= hw.memory),
        key=lambda e: (round(e.step_seconds, 9), e.total_bytes, _complexity(e.layout)),
    )
    plan = Plan(world_size, hw, considered=len(estimates), fitting=len(fitting), shown=[])
    refusals: dict[tuple[object, ...], int] = {}
    for candidate in fitting:
        if len(plan.shown) >= cfg.parallel.auto.show:
            break
        kind = _kind(candidate.layout)
        if refusals.get(kind, 0) >= _REFUSALS_PER_KIND:
            continue
        resolved = with_layout(cfg, candidate.layout)
        try:
            validate(resolved, world_size=world_size)
            if not plan.shown:
                plan.checked = _dry_run(resolved, candidate, world_size, hw)
        except ConfigError as err:
            plan.refused.append((candidate.layout, str(err)))
            refusals[kind] = refusals.get(kind, 0) + 1
            continue
        plan.shown.append(candidate)
    if not plan.shown:
        raise ConfigError(_nothing_fits(cfg, stats, estimates, world_size, hw, plan.refused))
    return plan


def _kind(layout: Layout) -> tuple[object, ...]:
    return (
        layout.strategy,
        layout.dp_replicate > 1,
        layout.tp > 1,
        layout.pp > 1,
        layout.schedule if layout.pp > 1 else "",
        layout.checkpointing,
        layout.ep > 1,
        layout.cp > 1,
    )


def _resolve_classes(cfg: Config) -> None:
    """The class count a classifier is built with comes from the data, as in Trainer.setup (a
    language model's vocabulary is in its config: its data, maybe a corpus, is not read here)."""
    if cfg.model.num_classes is None and not is_language_model_data(cfg.data):
        probe = resolve_trainer_class(cfg.trainer._target_)(cfg, env=DistEnv())
        resolve_num_classes(cfg, probe.build_datasets()[0])


def _estimates(cfg: Config, stats: ModelStats, world_size: int, hw: Hardware) -> list[Estimate]:
    scratch = copy.deepcopy(cfg)
    out = []
    allows = functools.partial(_degrees_allowed, cfg, stats)
    contexts = _context_degrees(cfg, world_size)
    for layout in candidates(stats, world_size, cfg.loop.global_batch_size, allows, contexts):
        # The user's tensor-parallel options, which a layout without TP turns off in the scratch.
        scratch.parallel.tensor_parallel = copy.copy(cfg.parallel.tensor_parallel)
        _set_layout(scratch, layout)
        out.append(estimate(scratch, stats, layout, hw))
    return out


def _degrees_allowed(cfg: Config, stats: ModelStats, tp: int, pp: int) -> bool:
    """Whether ``parallel.auto.max_tp`` / ``max_pp``, the model's tensor-parallel plan (if any)
    and its own validator take these degrees (whole attention heads per tensor-parallel rank,
    blocks enough for the stages)."""
    auto = cfg.parallel.auto
    if (auto.max_tp is not None and tp > auto.max_tp) or (
        auto.max_pp is not None and pp > auto.max_pp
    ):
        return False
    if tp > 1 and not stats.tensor_parallel:
        return False
    family = model_family(cfg.model.name)
    if family is None or family.validate is None:
        return True
    try:
        family.validate(cfg, tp=tp, pp=pp)
    except ConfigError:
        return False
    return True


def candidates(
    stats: ModelStats,
    world_size: int,
    global_batch: int,
    allowed: Callable[[int, int], bool] = lambda tp, pp: True,
    contexts: Sequence[int] = (1,),
) -> Iterator[Layout]:
    """Every layout the batch and ``allowed(tp, pp)`` allow on ``world_size`` ranks, with each
    context-parallel degree of ``contexts`` (module docstring)."""
    checkpointing = (False, True) if stats.checkpointed is not None else (False,)
    for cp in contexts:
        for tp in _divisors(world_size // cp):
            for pp in _divisors(world_size // (cp * tp)):
                if pp > 1 and (pp > stats.n_blocks or cp > 1) or not allowed(tp, pp):
                    continue  # context parallel is not combined with stages
                dp = world_size // (cp * tp * pp)
                if global_batch % dp:
                    continue
                per_rank = global_batch // dp
                for strategy, replicate, shard in _data_parallel(dp, tp, pp):
                    if cp > 1 and strategy == "zero1":
                        continue  # ZeRO-1 runs plain data parallelism only
                    for ep in _expert_degrees(stats, strategy, shard):
                        for ac in checkpointing:
                            base = Layout(
                                strategy, replicate, shard, tp, pp, ac, 1, 1, ep=ep, cp=cp
                            )
                            yield from _batch_splits(base, per_rank, stats)


# Context parallel pays an exchange of keys and values per block for splitting each sequence:
# only where every rank keeps at least this many tokens of it (a long sequence) is it a
# candidate; shorter shares leave attention kernels too small to pay for it.
MIN_CONTEXT_TOKENS = 1024


def _context_degrees(cfg: Config, world_size: int) -> list[int]:
    """The context-parallel degrees to consider: 1, and for a family with context-parallel
    attention each degree dividing the world that splits ``data.seq_len`` into ``2 x cp`` equal
    chunks of ``MIN_CONTEXT_TOKENS`` tokens per rank at least."""
    family = model_family(cfg.model.name)
    if family is None or not family.context_parallel or not is_language_model_data(cfg.data):
        return [1]
    seq_len = cfg.data.seq_len
    return [
        cp
        for cp in _divisors(world_size)
        if cp == 1 or (seq_len % (2 * cp) == 0 and seq_len // cp >= MIN_CONTEXT_TOKENS)
    ]


def _expert_degrees(stats: ModelStats, strategy: str, shard: int) -> list[int]:
    """Expert parallel degrees for a mixture of experts under FSDP: the divisors of ``dp_shard``
    (its ranks are taken from there) that split the experts evenly; 1 for any other model."""
    if strategy != "fsdp" or not stats.num_experts:
        return [1]
    return [ep for ep in _divisors(shard) if stats.num_experts % ep == 0]


def _data_parallel(dp: int, tp: int, pp: int) -> Iterator[tuple[str, int, int]]:
    """(strategy, dp_replicate, dp_shard) over ``dp`` ranks."""
    if dp == 1:
        yield ("fsdp" if tp * pp > 1 else "ddp"), 1, 1
        return
    yield "fsdp", 1, dp
    if tp == 1:  # DDP takes no tensor-parallel parameters; ZeRO-1 runs plain data parallel
        yield "ddp", dp, 1
        if pp == 1:
            yield "zero1", dp, 1
    for shard in _divisors(dp):
        if 1 < shard < dp:  # HSDP: shard within a group, replicate across groups
            yield "fsdp", dp // shard, shard


def _batch_splits(base: Layout, per_rank: int, stats: ModelStats) -> Iterator[Layout]:
    for steps in _divisors(per_rank):
        micro = per_rank // steps
        if base.pp == 1:
            yield _replace(base, micro_batch=micro, micro_steps=steps)
            continue
        # torch's 1F1B needs a micro-batch per stage at least; GPipe runs fewer (stages idle).
        single = "1F1B" if steps >= base.pp else "GPipe"
        yield _replace(base, micro_batch=micro, micro_steps=steps, schedule=single)
        rounds = max(1, steps // base.pp)  # torch's Interleaved1F1B: whole rounds of micro-batches
        if stats.n_blocks >= 2 * base.pp and steps % rounds == 0:
            yield _replace(
                base, micro_batch=micro, micro_steps=steps, schedule=INTERLEAVED, stages_per_rank=2
            )


def _replace(layout: Layout, **changes: Any) -> Layout:
    return Layout(**{**layout.__dict__, **changes})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _complexity(layout: Layout) -> int:
    """Between equal times and bytes, the layout with fewer dimensions in play."""
    degrees = (layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp, layout.ep, layout.cp)
    return sum(d > 1 for d in degrees)


def with_layout(cfg: Config, layout: Layout) -> Config:
    """A copy of ``cfg`` set to ``layout``."""
    out = copy.deepcopy(cfg)
    _set_layout(out, layout)
    return out


def _layout_values(layout: Layout) -> dict[str, Any]:
    """The config keys ``layout`` sets, and their values: what ``_set_layout`` writes and
    ``layout_overrides`` prints, from this one list."""
    values: dict[str, Any] = {
        "parallel.strategy": layout.strategy,
        "parallel.dp_replicate": layout.dp_replicate,
        "parallel.dp_shard": layout.dp_shard,
        "parallel.tp": layout.tp,
        "parallel.pp": layout.pp,
        "parallel.ep": layout.ep,
        "parallel.cp": layout.cp,
    }
    if layout.tp == 1:  # the tensor-parallel options are the user's where tensor parallelism runs
        values["parallel.tensor_parallel.loss_parallel"] = False
        values["parallel.tensor_parallel.sequence_parallel"] = False
    if layout.pp > 1:
        values["parallel.pipeline.schedule"] = layout.schedule
        values["parallel.pipeline.stages_per_rank"] = layout.stages_per_rank
        values["parallel.pipeline.microbatches"] = layout.micro_steps
        # The even split: split points given were for another stage count.
        values["parallel.pipeline.split_points"] = []
    values["parallel.activation_checkpointing"] = "full" if layout.checkpointing else "none"
    values["loop.grad_accum_steps"] = 1 if layout.pp > 1 else layout.micro_steps
    values["loop.micro_batch_size"] = None
    return values


def _set_layout(cfg: Config, layout: Layout) -> None:
    for key, value in _layout_values(layout).items():
        *path, name = key.split(".")
        setattr(functools.reduce(getattr, path, cfg), name, value)


def layout_overrides(layout: Layout) -> list[str]:
    """The command-line keys that launch ``layout`` without the planner (the strategy as its
    ``parallel=`` group)."""
    values = _layout_values(layout)
    for key in ("parallel.ep", "parallel.cp"):
        if values[key] == 1:  # the default, said where the layout uses it alone
            del values[key]
    return [_override(key, value) for key, value in values.items()]


def _override(key: str, value: Any) -> str:
    if key == "parallel.strategy":
        return f"parallel={value}"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    return f"{key}={'null' if value is None else value}"


def _dry_run(cfg: Config, candidate: Estimate, world_size: int, hw: Hardware) -> list[RankPlan]:
    """The dry run of the first and last pipeline stage's first rank; a ConfigError if what it
    counts, with what it does not, exceeds the memory."""
    stride = world_size // candidate.layout.pp
    ranks = sorted({0, (candidate.layout.pp - 1) * stride})
    plans = [plan_rank(cfg, rank, world_size) for rank in ranks]
    # The estimate's parts alive at the peak, each raised to the dry run's own count where the
    # built rank holds more of it (the parts the dry run does not count as they are: the weights'
    # average, FSDP's gathered parameters and unsharded gradients, DDP's buckets, the loss).
    estimated = candidate.bytes
    for p in plans:
        seen = {
            "params": p.params,
            "grads": p.grads,
            "optim": p.optim,
            "activations": p.activations,
        }
        counted = candidate.total_bytes + sum(
            max(0, seen[k] - estimated[k])
            for k in seen
            if estimated[k]  # alive at the peak
        )
        if counted > hw.memory:
            raise ConfigError(
                f"the dry run of {candidate.layout.describe()} counts {in_units(counted)} on rank "
                f"{p.rank}, more than {in_units(hw.memory)}"
            )
    return plans


def _nothing_fits(
    cfg: Config,
    stats: ModelStats,
    estimates: list[Estimate],
    world_size: int,
    hw: Hardware,
    refused: list[tuple[Layout, str]],
) -> str:
    head = (
        f"parallel=auto: no layout of model {cfg.model.name} on {world_size} ranks fits "
        f"{in_units(hw.memory)} per rank ({hw.memory_source})"
    )
    if not estimates:
        return (
            f"{head}: loop.global_batch_size={cfg.loop.global_batch_size} splits over none of "
            f"the data-parallel widths the world allows; use a multiple of the world size"
        )
    if refused:
        reasons = [reason for _, reason in refused]
        commonest = max(set(reasons), key=reasons.count)
        return (
            f"{head}: the validator refused every layout that fits ({len(refused)} tried; "
            f"{reasons.count(commonest)} of them: {commonest})"
        )
    leanest = min(estimates, key=lambda e: e.total_bytes)
    parts = ", ".join(f"{k} {in_units(v)}" for k, v in leanest.bytes.items() if v)
    text = (
        f"{head}: the leanest, {leanest.layout.describe()} with activation checkpointing "
        f"{'on' if leanest.layout.checkpointing else 'off'} and micro-batch "
        f"{leanest.layout.micro_batch}, needs {in_units(leanest.total_bytes)} ({parts})."
    )
    ways = []
    for factor in (2, 4, 8, 16, 32, 64):
        more = world_size * factor
        fits = any(e.total_bytes <= hw.memory for e in _estimates(cfg, stats, more, hw))
        if fits:
            ways.append(f"{more} ranks")
            break
    state = leanest.total_bytes - leanest.bytes["activations"]
    if state < hw.memory and leanest.bytes["activations"] and is_language_model_data(cfg.data):
        room = (hw.memory - state) / leanest.bytes["activations"]
        seq_len = 2 ** int(math.log2(max(room * cfg.data.seq_len, 1)))
        if seq_len < cfg.data.seq_len:
            ways.append(f"data.seq_len={seq_len} (sequences shorter than {cfg.data.seq_len})")
    if leanest.layout.micro_batch > 1:
        ways.append("a smaller micro-batch (a global batch with more factors)")
    ways.append("more memory (parallel.memory_per_rank_gib, parallel.auto.memory_fraction)")
    return text + " It would fit with " + "; or ".join(ways)


def table(plan: Plan, cfg: Config) -> str:
    """The plan as a user reads it: what was assumed, the candidates and why the others lost."""
    hw = plan.hardware
    lines = [
        f"parallel=auto: model {cfg.model.name}, {plan.world_size} ranks ({hw.ranks_per_node} per "
        f"node), global batch {cfg.loop.global_batch_size}, sequence {cfg.data.seq_len}",
        f"  memory {in_units(hw.memory)} per rank: {hw.memory_source}; "
        f"{hw.flops / 1e12:.3g} TFLOP/s per rank: {hw.flops_source}; links "
        f"{hw.intra / 1e9:g} GB/s in a node, {hw.inter / 1e9:g} GB/s between nodes "
        f"({hw.links_source})",
        f"  {plan.considered} layouts, {plan.fitting} fit; the fastest "
        f"{len(plan.shown)} the validator accepts:",
        f"  {'#':>2} {'layout':<30} {'ckpt':<4} {'micro-batch':<16} {'per rank':>10} "
        f"{'step s':>9} " + " ".join(f"{k:>9}" for k in TIME_PARTS) + "  why not first",
    ]
    best = plan.chosen
    for i, e in enumerate(plan.shown, 1):
        lines.append(
            f"  {i:>2} {e.layout.describe():<30} {'on' if e.layout.checkpointing else 'off':<4} "
            f"{e.layout.batch():<16} {in_units(e.total_bytes):>10} {e.step_seconds:>9.4g} "
            + " ".join(f"{e.seconds[k]:>9.3g}" for k in TIME_PARTS)
            + ("  " + _why_not(e, best) if i > 1 else "  chosen")
        )
    for layout, reason in plan.refused[:3]:
        lines.append(f"  refused: {layout.describe()}: {reason}")
    for p in plan.checked:
        lines.append(
            f"  dry run of the choice, rank {p.rank}: parameters {in_units(p.params)}, gradients "
            f"{in_units(p.grads)}, optimizer {in_units(p.optim)}, activations "
            f"~{in_units(p.activations)}"
        )
    lines.append("  as keys: " + " ".join(layout_overrides(best.layout)))
    return "\n".join(lines)


def _why_not(e: Estimate, best: Estimate) -> str:
    worse = {k: e.seconds[k] - best.seconds[k] for k in TIME_PARTS}
    part = max(worse, key=lambda k: worse[k])
    if worse[part] > 1e-9 * max(best.step_seconds, 1e-9):
        return f"+{worse[part]:.3g} s {TIME_PARTS[part]}"
    return f"as fast, {in_units(e.total_bytes - best.total_bytes)} more per rank"


__all__ = [
    "Plan",
    "candidates",
    "layout_overrides",
    "plan_layout",
    "resolve_auto",
    "table",
    "with_layout",
]
