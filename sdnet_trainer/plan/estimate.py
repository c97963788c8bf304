"""One layout's bytes per rank and step time, from the model's stats and the machines' figures.

Bytes follow the dry run's counting (``plan/dry_run.py``), divided per layout instead of built:
the parameters, gradients and optimizer state of the heaviest pipeline stage's shard, and the
activations the stage keeps (the bytes one forward keeps for backward, measured on the meta model
without and with full activation checkpointing (``model_stats.saved_activations``), by
micro-batch, scaled to the stage, the samples' part split by tensor parallelism, times the
micro-batches in flight; under context parallel measured on a rank's share of each sequence);
and what the dry run does not count: the weights' moving average, FSDP's unsharded parameters
(``_gathered``) and gradients (``_unsharded_grads``) at their peak, DDP's gradient buckets, the
unsharded gradients ``parallel.fsdp.grad_sync=last_microstep`` accumulates, and the loss's own
peak over the logits (``_loss``). The bytes are those alive at the peak, the larger of backward's
start and its end (``_stage_bytes``); the measured peaks of real runs stay within 15 % of them
(``tests/distributed/test_planned_peak.py``).

The step time adds:

- compute: the model's FLOPs for the global batch (a forward again under activation
  checkpointing) over the world, at the achieved FLOP/s of a rank (peak x efficiency);
- overhead: each block's fixed cost per micro-step (launches, the framework's work), so that
  many small micro-batches cost more than a few large ones;
- the pipeline bubble: compute x (pp - 1) / (micro-batches x stages per rank), as in 1F1B and
  its interleaved form;
- tensor- and pipeline-parallel communication, which waits for its result (the dry run's own
  collectives: ``model_parallel_collectives``), context parallel's exchanges of keys and values
  (``context_parallel_collectives``) and expert parallel's all-to-alls
  (``expert_parallel_collectives``);
- data-parallel communication, less what hides behind compute: FSDP's gathers and reductions
  prefetch under the micro-steps' compute, DDP's all-reduce under the last backward (two thirds
  of a micro-step).

Where a node has more ranks than processors (CPU ranks over fewer cores, ``Hardware.time_shared``)
the ranks take turns on the cores: a stage waiting in the pipeline's bubble lends its core to
another rank (no bubble is counted), and the collectives run on the cores the model computes on
(none hides behind compute); the calibration's FLOP/s is then a rank's share of the cores.

Each collective is a ring: a gather or a reduction of ``X`` bytes over ``n`` ranks moves
``(n - 1) / n x X`` per rank and pays ``n - 1`` hops of latency; an all-reduce twice that. A group
whose ranks all sit on one node uses the node's bandwidth, any other the network's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sdnet_trainer.config import Config
from sdnet_trainer.distributed.mesh import ParallelDims
from sdnet_trainer.plan.dry_run import (
    context_parallel_collectives,
    cp_attention,
    dtype_bytes,
    fsdp_param_dtype,
    gpu_dtype,
    model_parallel_collectives,
    per_tensor_parallel_rank,
)
from sdnet_trainer.plan.experts import expert_parallel_collectives
from sdnet_trainer.plan.model_stats import (
    Activations,
    ContextShare,
    ModelStats,
    saved_activations,
)


@dataclass(frozen=True)
class Layout:
    """One candidate: a strategy, the mesh degrees, checkpointing and the batch split."""

    strategy: str  # ddp | zero1 | fsdp (HSDP: fsdp with dp_replicate > 1)
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    checkpointing: bool
    micro_batch: int  # samples in one forward of a rank
    micro_steps: int  # accumulation steps (pp 1) or the pipeline's micro-batches (pp > 1)
    schedule: str = "1F1B"  # pp > 1
    stages_per_rank: int = 1
    ep: int = 1  # a mixture of experts' experts split over ep of the dp_shard ranks
    cp: int = 1  # each sequence split over cp ranks (context parallel)

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(
            pp=self.pp,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            cp=self.cp,
            tp=self.tp,
            ep=self.ep,
        )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shards(self) -> int:
        """The ranks FSDP shards a parameter over: dp_shard and the context-parallel peers."""
        return self.dp_shard * self.cp

    def describe(self) -> str:
        """``fsdp 8 x tp 8``, ``hsdp 4x8``, ``ddp 2 x pp 4 (Interleaved1F1B)``..."""
        if self.strategy == "fsdp" and self.dp_replicate > 1:
            parts = [f"hsdp {self.dp_replicate}x{self.dp_shard}"]
        elif self.dp > 1:
            parts = [f"{self.strategy} {self.dp}"]
        else:
            parts = []
        parts += [f"cp {self.cp}"] if self.cp > 1 else []
        parts += [f"tp {self.tp}"] if self.tp > 1 else []
        parts += [f"pp {self.pp} ({self.schedule})"] if self.pp > 1 else []
        text = " x ".join(parts) or "1 rank"
        return text if self.ep == 1 else f"{text}, experts over ep {self.ep}"

    def batch(self) -> str:
        if self.pp > 1:
            return f"{self.micro_batch} x {self.micro_steps} in flight"
        return f"{self.micro_batch} x {self.micro_steps} accum"


@dataclass(frozen=True)
class Hardware:
    """What one rank has: memory for the layout, FLOP/s achieved, and the links."""

    memory: int  # bytes a layout may count (memory_fraction of the rank's)
    memory_source: str
    flops: float  # FLOP/s a rank achieves in the model's matmuls
    flops_source: str
    intra: float  # bytes/s per rank within a node
    inter: float  # bytes/s per rank across nodes
    latency: float  # seconds per hop
    block_overhead: float  # seconds per block and micro-step beyond the FLOPs
    ranks_per_node: int
    # More ranks than processors (CPU ranks over fewer cores): they take turns on the cores.
    time_shared: bool = False
    links_source: str = ""  # where intra, inter and latency came from, for the plan's header


@dataclass
class Estimate:
    layout: Layout
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())


# The parts of a step, in the order a table shows them, with the words a comparison uses.
TIME_PARTS = {
    "compute": "compute",
    "overhead": "more micro-steps (each block's fixed cost per micro-step)",
    "recompute": "recomputation (activation checkpointing)",
    "bubble": "pipeline bubble",
    "tp": "tensor-parallel communication",
    "pp": "pipeline sends",
    "cp": "context-parallel exchanges",
    "ep": "expert-parallel all-to-alls",
    "dp": "data-parallel communication not hidden by compute",
}


def estimate(cfg: Config, stats: ModelStats, layout: Layout, hw: Hardware) -> Estimate:
    """``cfg`` already carries ``layout`` (``plan.auto.with_layout``): the dry run's collectives
    read the degrees, the batch split and the dtypes from it."""
    out = Estimate(layout)
    out.bytes = max(
        (_stage_bytes(cfg, stats, layout, stage) for stage in _stages(layout.pp)),
        key=lambda b: sum(b.values()),
    )
    out.seconds = _step_seconds(cfg, stats, layout, hw)
    return out


def _stages(pp: int) -> tuple[int, ...]:
    """The stages whose bytes differ most: the first (embeddings, every micro-batch in flight)
    and the last (the output layer); the middle ones hold blocks alone."""
    return (0,) if pp == 1 else (0, pp - 1)


def _stage_elements(stats: ModelStats, layout: Layout, stage: int) -> int:
    if layout.pp == 1:
        return stats.params
    per_rank = _blocks_per_rank(stats, layout)
    outside = (stats.head if stage == 0 else 0) + (stats.tail if stage == layout.pp - 1 else 0)
    blocks = stats.blocks[:per_rank] if stage == 0 else stats.blocks[-per_rank:]
    return outside + sum(blocks)


def _blocks_per_rank(stats: ModelStats, layout: Layout) -> int:
    """The blocks a pipeline rank holds, as the even split by block count gives them."""
    return -(-stats.n_blocks // layout.pp)


def _stage_bytes(cfg: Config, stats: ModelStats, layout: Layout, stage: int) -> dict[str, int]:
    """The stage's bytes at its peak, each part as alive then: the parameters, the optimizer
    state, the weights' average, DDP's buckets and FSDP's gathered parameters throughout; and the
    larger of two moments of backward:

    - its start: the activations kept, with the larger of the loss's peak over the logits and
      the first block's gradients (under FSDP unsharded, with their reduce-scatter's input), and
      the gradients of earlier micro-steps where they accumulate;
    - its end: every gradient, under FSDP with the root's unsharded ones and their
      reduce-scatter's input (the root reduces last), the activations gone."""
    elements = _stage_elements(stats, layout, stage)
    share = elements / max(stats.params, 1)
    unsplit = stats.unsplit * share
    whole = (elements - unsplit) / layout.tp + unsplit  # tensor parallelism keeps 1-D whole
    fsdp = layout.strategy == "fsdp"
    local = whole / layout.shards if fsdp else whole
    optim = local * stats.optim_per_param
    if layout.strategy == "zero1":
        optim /= layout.dp
    grads = local
    if fsdp and layout.micro_steps > 1 and cfg.parallel.fsdp.grad_sync == "last_microstep":
        grads = whole  # unsharded, accumulated until the last micro-step reduces them
    grads_bytes = int(grads * stats.bytes_per_param)
    saved = _saved(cfg, stats, layout)
    in_flight = _in_flight(layout, stage)
    activations = int(
        per_tensor_parallel_rank(saved, layout.micro_batch, layout.tp) * share * in_flight
    )
    loss = _loss(cfg, stats, layout) if stage == layout.pp - 1 else 0
    first_block, root = _unsharded_grads(cfg, stats, layout, elements)
    accumulated = grads_bytes if layout.micro_steps > 1 else 0
    if activations + max(loss, first_block) + accumulated >= grads_bytes + root:  # the start
        grads_bytes, root = accumulated, 0
        loss, first_block = (loss, 0) if loss >= first_block else (0, first_block)
    else:  # the end
        activations = loss = first_block = 0
    return {
        "params": int(local * stats.bytes_per_param),
        "grads": grads_bytes,
        "optim": int(optim),
        # The weights' moving average, in the weights' layout (sharded under FSDP).
        "ema": int(local * stats.bytes_per_param) if cfg.model.ema.enabled else 0,
        "gathered": _gathered(cfg, stats, layout, elements),
        # Gradients on their way to a reduction: the first block's, or at the end the root's.
        "reduced": first_block + root,
        # DDP's gradient buckets: a second copy of the gradients unless they are views of them.
        "buckets": int(whole * stats.bytes_per_param)
        if layout.strategy != "fsdp"
        and layout.dp > 1
        and layout.pp == 1
        and not cfg.parallel.ddp.gradient_as_bucket_view
        else 0,
        "activations": activations,
        "loss": loss,
    }


def _unsharded_grads(
    cfg: Config, stats: ModelStats, layout: Layout, elements: int
) -> tuple[int, int]:
    """Bytes of the first block's gradients (the first backward produces), and under FSDP the
    root's unsharded ones (embeddings, output layer: produced early, reduced with the last unit),
    each under FSDP in the parameters' dtype and again as the reduce-scatter's input in
    ``reduce_dtype``; a rank's experts alone under expert parallel."""
    sharded = layout.strategy == "fsdp" and layout.shards > 1
    width = stats.bytes_per_param
    if sharded:
        width += dtype_bytes(cfg.parallel.fsdp.reduce_dtype)
    block = (max(stats.blocks) - _block_experts(stats, layout)) if stats.blocks else 0
    root = _root_elements(stats, layout, elements) if sharded else 0
    return int(block / layout.tp * width), int(root / layout.tp * width)


def _root_elements(stats: ModelStats, layout: Layout, elements: int) -> int:
    """Of a stage's ``elements``, those outside its blocks (embeddings, final norm, output
    layer): FSDP's root unit."""
    return elements - sum(stats.blocks[: _blocks_per_rank(stats, layout)])


def _loss(cfg: Config, stats: ModelStats, layout: Layout) -> int:
    """The loss's peak over one micro-batch's logits, on the stage that computes it: split over
    the vocabulary by tensor parallel's ``loss_parallel``, whole on every rank without it."""
    tp = cfg.parallel.tensor_parallel
    split = layout.tp if layout.tp > 1 and tp.loss_parallel else 1
    return int(stats.loss_per_sample * layout.micro_batch / split / layout.cp)


def _saved(cfg: Config, stats: ModelStats, layout: Layout) -> Activations:
    """What one forward keeps for backward: the model's measure, or under context parallel the
    measure on a rank's ``seq_len / cp`` tokens with the ring's local attention; the all-gather
    attention keeps each block's gathered keys and values on top, unless full checkpointing
    recomputes them (``plan/model_stats.py``)."""
    if layout.cp == 1:
        saved = stats.checkpointed if layout.checkpointing else stats.activations
        assert saved is not None  # no checkpointing candidates without blocks (plan/auto.py)
        return saved
    saved = _rank_share(cfg, layout)
    if cp_attention(cfg) == "ring" or layout.checkpointing:
        return saved
    gathered = sum(k + v for k, v in saved.attention) * (layout.cp - 1) // layout.cp
    width = dtype_bytes(saved.dtype)
    return replace(saved, per_sample=saved.per_sample + gathered * width)


def _rank_share(cfg: Config, layout: Layout) -> Activations:
    """The measure on a rank's ``seq_len / cp`` tokens of each sequence, attention as the ring's
    local kernel (measured once per setting: ``model_stats.saved_activations``)."""
    mode = "full" if layout.checkpointing else "none"
    return saved_activations(cfg, mode, context=ContextShare(layout.cp, "ring"))


def _gathered(cfg: Config, stats: ModelStats, layout: Layout, elements: int) -> int:
    """FSDP's unsharded parameters at their peak: the root's (embeddings, output layer: kept
    from forward to backward), and two blocks (the one computing, the one prefetched) or, with
    ``reshard_after_forward=false``, every block of the stage."""
    if layout.strategy != "fsdp" or layout.shards == 1:
        return 0
    width = dtype_bytes(fsdp_param_dtype(cfg))
    root = _root_elements(stats, layout, elements)
    blocks = elements - root - _block_experts(stats, layout) * _blocks_per_rank(stats, layout)
    if stats.blocks and cfg.parallel.fsdp.reshard_after_forward:
        blocks = 2 * (max(stats.blocks) - _block_experts(stats, layout))
    return int((root + blocks) / layout.tp * width)


def _block_experts(stats: ModelStats, layout: Layout) -> float:
    """A block's expert elements that an expert-parallel rank does not gather: FSDP gathers a
    rank's ``num_experts / ep`` experts alone."""
    if not stats.experts or not stats.blocks:
        return 0.0
    return stats.experts / stats.n_blocks * (1 - 1 / layout.ep)


def _in_flight(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a stage holds at once: GPipe all of them (every forward
    before any backward); 1F1B those still to come back, ``pp - stage``; interleaved 1F1B its
    warm-up, ``(v - 1) x m_round + 2 (pp - 1 - stage) + 1`` chunks of ``1 / v`` of the rank's
    activations each (torch's schedule, ``m_round`` the micro-batches of one round)."""
    if layout.pp == 1:
        return 1.0
    m, pp, v = layout.micro_steps, layout.pp, layout.stages_per_rank
    if layout.schedule == "GPipe":
        return float(m)
    if v == 1:
        return float(min(m, pp - stage))
    per_round = m // max(1, m // pp)
    return min(m * v, (v - 1) * per_round + 2 * (pp - 1 - stage) + 1) / v


def _step_seconds(cfg: Config, stats: ModelStats, layout: Layout, hw: Hardware) -> dict[str, float]:
    world = layout.dp * layout.cp * layout.tp * layout.pp
    batch = cfg.loop.global_batch_size
    compute = batch * stats.train_flops / world / hw.flops
    recompute = batch * stats.forward_flops / world / hw.flops if layout.checkpointing else 0.0
    blocks = max(_blocks_per_rank(stats, layout), 1)  # a model without blocks: one unit
    overhead = (
        layout.micro_steps * blocks * hw.block_overhead * (4 / 3 if layout.checkpointing else 1)
    )
    bubble = 0.0
    if layout.pp > 1 and not hw.time_shared:  # shared cores: a waiting stage lends its core
        bubble = (compute + recompute + overhead) * (layout.pp - 1)
        bubble /= layout.micro_steps * layout.stages_per_rank
    tp = pp = 0.0
    for c in model_parallel_collectives(cfg, layout.dims, stage=0):
        if c.over == "tp":
            ring = 2 if c.kind.startswith("all_reduce") else 1
            tp += c.count * ring * _ring(c.bytes_each, layout.tp, _bandwidth(layout, "tp", hw), hw)
        else:  # a send: one hop over the pipeline's links
            pp += c.count * (c.bytes_each / _bandwidth(layout, "pp", hw) + hw.latency)
    return {
        "compute": compute,
        "overhead": overhead,
        "recompute": recompute,
        "bubble": bubble,
        "tp": tp,
        "pp": pp,
        "cp": _context_exchanges(cfg, layout, hw),
        "ep": _all_to_alls(cfg, stats, layout, hw),
        # Shared cores: the collectives (gloo's) compute on the cores the model needs, so
        # nothing hides behind it.
        "dp": _data_parallel_exposed(
            cfg, stats, layout, hw, 0.0 if hw.time_shared else compute + recompute
        ),
    }


def _context_exchanges(cfg: Config, layout: Layout, hw: Hardware) -> float:
    """Context parallel's exchanges of keys and values, the dry run's own count
    (``context_parallel_collectives``), each a ring over the ``cp`` ranks."""
    if layout.cp == 1:
        return 0.0
    bandwidth = _bandwidth(layout, "cp", hw)
    return sum(
        c.count * _ring(c.bytes_each, layout.cp, bandwidth, hw)
        for c in context_parallel_collectives(cfg, layout.dims, _rank_share(cfg, layout))
    )


def _all_to_alls(cfg: Config, stats: ModelStats, layout: Layout, hw: Hardware) -> float:
    """Expert parallel's all-to-alls (the dry run's own count: ``expert_parallel_collectives``):
    each moves ``(ep - 1) / ep`` of its rows to other ranks and pays ``ep - 1`` latencies."""
    if layout.ep == 1:
        return 0.0
    collectives = expert_parallel_collectives(
        cfg,
        layout.dims,
        0,
        micro_steps=layout.micro_steps,
        micro_batch=layout.micro_batch,
        width=dtype_bytes(gpu_dtype(cfg)),
        recomputed=lambda block, op: layout.checkpointing,  # full checkpointing: every block
    )
    bandwidth = _bandwidth(layout, "ep", hw)
    return sum(count * _ring(each, layout.ep, bandwidth, hw) for _, _, count, each in collectives)


def _data_parallel_exposed(
    cfg: Config, stats: ModelStats, layout: Layout, hw: Hardware, busy: float
) -> float:
    if layout.dp * layout.cp == 1:
        return 0.0
    # The stage's parameters as a data-parallel group sees them (a tensor-parallel rank's part;
    # an expert-parallel rank's experts alone).
    experts = _block_experts(stats, layout) * _blocks_per_rank(stats, layout)
    elements = (_stage_elements(stats, layout, 0) - experts) / layout.tp
    micro_steps = layout.micro_steps
    window = busy / micro_steps * 2 / 3  # the last micro-step's backward
    replicas_bw = _bandwidth(layout, "dp_replicate", hw)
    if layout.strategy != "fsdp":
        # DDP averages over the context-parallel peers too.
        gather = _ring(elements * stats.bytes_per_param, layout.dp * layout.cp, replicas_bw, hw)
        exposed = max(0.0, 2 * gather - window)  # an all-reduce: a reduce-scatter and a gather
        if layout.strategy == "zero1":  # the updated parameters, after the optimizer step
            exposed += gather
        return exposed
    fsdp = cfg.parallel.fsdp
    param_dtype = fsdp_param_dtype(cfg)
    units = _blocks_per_rank(stats, layout) + 1  # a unit per block, and the root
    shard_bw = _bandwidth(layout, "dp_shard", hw)
    gathers = (2 if fsdp.reshard_after_forward else 1) * micro_steps
    reductions = micro_steps if fsdp.grad_sync == "every_microstep" else 1
    n = layout.shards
    seconds = gathers * _ring(elements * dtype_bytes(param_dtype), n, shard_bw, hw, hops=units)
    seconds += reductions * _ring(
        elements * dtype_bytes(fsdp.reduce_dtype), n, shard_bw, hw, hops=units
    )
    exposed = max(0.0, seconds - busy)
    if layout.dp_replicate > 1:  # HSDP: the shards' all-reduce across replicas, once per step
        shard = elements / n * dtype_bytes(fsdp.reduce_dtype)
        across = 2 * _ring(shard, layout.dp_replicate, replicas_bw, hw)
        exposed += max(0.0, across - window)
    return exposed


def _ring(nbytes: float, n: int, bandwidth: float, hw: Hardware, *, hops: int = 1) -> float:
    """Seconds of a ring all-gather or reduce-scatter of ``nbytes`` over ``n`` ranks, split into
    ``hops`` collectives (each pays the ring's latency)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + hops * (n - 1) * hw.latency


def _bandwidth(layout: Layout, dim: str, hw: Hardware) -> float:
    """The node's links if the ``dim`` group's ranks sit on one node (the mesh is row-major over
    pp, dp_replicate, dp_shard, tp: a group spans its own size times the degrees inside it)."""
    span = {
        "tp": layout.tp,
        "cp": layout.cp * layout.tp,
        # ep: the innermost of dp_shard's ranks (distributed/mesh.py).
        "ep": layout.ep * layout.cp * layout.tp,
        "dp_shard": layout.dp_shard * layout.cp * layout.tp,
        "dp_replicate": layout.dp * layout.cp * layout.tp,
        "pp": layout.dp * layout.cp * layout.tp * layout.pp,
    }[dim]
    return hw.intra if span <= hw.ranks_per_node else hw.inter


__all__ = ["TIME_PARTS", "Estimate", "Hardware", "Layout", "estimate"]
