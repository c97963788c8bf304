"""What the automatic layout and the dry run need to know of a model, measured on the meta device.

The planner weighs hundreds of layouts; building each one, as the dry run does, takes seconds of
a 8B model. The quantities a layout divides are the same for all of them, so they are counted
here once (the elements, ``optimizer_bytes_per_element``, FLOPs from ``FlopCounterMode``, the
activations below), and :mod:`~sdnet_trainer.plan.estimate` divides them per layout. The layout
that wins is then built by the dry run itself (``plan/auto.py``).

**Activations** (:func:`saved_activations`) are measured, not computed from a formula: one
forward of the meta model, built and converted as a rank builds it (float8 layers, activation
checkpointing per ``parallel.activation_checkpointing``), under a ``TorchDispatchMode`` that
keeps a weak reference to the storage of every tensor an op produces. Once the forward has
returned (its output still held) and garbage is collected, the storages still alive are what
backward will read: autograd's saved tensors, the outputs selective checkpointing caches in its
own storage, the block inputs a non-reentrant checkpoint keeps. Saved-tensor hooks, the measure
before this one, see only the first (a checkpoint's own hooks replace them inside the block).
Weak references to the storages rather than to the tensors: autograd saves an op's own output as
a new tensor over the same storage, whose Python object never exists. Each storage counts once,
whole; the parameters', the buffers', the input's and the output's do not count.

Two things of the GPUs are stood in for, since the meta device runs neither:

- attention: on the meta device ``scaled_dot_product_attention`` takes its math path, which keeps
  the ``T x T`` attention weights; a GPU runs a fused kernel that keeps its output and the
  softmax's log-sum-exp. The measure routes it to the memory-efficient kernel's meta function,
  which takes grouped-query heads and masks as the CUDA kernel does (a boolean mask becomes an
  additive one of the query's dtype per call, as ``scaled_dot_product_attention`` makes it);
- context parallel (``parallel.cp``): the forward runs on the ``seq_len / cp`` tokens a rank
  holds; for the all-gather attention the dry run hands in its ``ContextParallel`` on the fake
  group's ``cp`` mesh, so the keys and values gathered per layer are the real op's output (kept
  or not as autograd and the checkpoint policy decide), and the ring attention is its local
  kernel (torch's ring keeps this rank's keys and values and passes the others' in backward).

The bytes are those of the meta model's dtype (fp32: the parameters' and the optimizer's, as the
run keeps them); a run computing in bf16 keeps about half. The loss's own peak over the logits
(:func:`loss_per_sample`) is measured apart, by torch's ``MemTracker``: at a large vocabulary it
is the largest part of a step's memory. Still an estimate: the allocator's caching is not
counted, nor the collectives' buffers (``plan/estimate.py`` adds FSDP's).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from sdnet_trainer.config import Config
from sdnet_trainer.data import is_language_model_data
from sdnet_trainer.distributed.activation_checkpointing import apply_activation_checkpointing
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.models.moe import GroupedExperts
from sdnet_trainer.models.parallel_spec import parallel_blocks, supports_tensor_parallel
from sdnet_trainer.models.registry import decoder_sizes
from sdnet_trainer.observability.flops import count_flops
from sdnet_trainer.runtime.precision import DTYPES
from sdnet_trainer.training.classes import resolve_trainer_class
from sdnet_trainer.training.fits import optimizer_bytes_per_element


@dataclass(frozen=True)
class Activations:
    """Bytes one forward of the whole model keeps for backward: ``fixed + per_sample x batch``;
    ``params``: the model's elements (a pipeline stage takes its share of the bytes by them);
    ``attention``: the key and value elements of each attention call of one sample, over the
    whole sequence (what context parallel gathers or passes around), in the order they ran."""

    per_sample: int
    fixed: int
    params: int
    attention: tuple[tuple[int, int], ...] = ()
    dtype: str = "fp32"  # the model's parameters', which its activations follow

    def at(self, batch: int) -> int:
        return self.fixed + self.per_sample * batch


@dataclass(frozen=True)
class ContextShare:
    """A rank's share of each sequence under context parallel, as the measure runs it: ``cp``
    shards, attention by ``method`` (``ring`` | ``allgather``), and for ``allgather`` what makes
    the model gather keys and values (``ContextParallel.apply`` on a ``cp`` mesh)."""

    cp: int
    method: str
    apply: Callable[[nn.Module], None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ModelStats:
    params: int  # elements, all of them
    head: int  # elements before the first block (embeddings): the first pipeline stage's
    tail: int  # elements after the last block (final norm, output layer): the last stage's
    blocks: tuple[int, ...]  # elements of each repeated block, in order
    unsplit: int  # 1-D elements (norms, biases): tensor parallelism keeps them whole
    experts: int  # a mixture of experts' expert elements (expert parallel splits them)
    num_experts: int  # experts per MoE layer (0: no mixture of experts)
    bytes_per_param: int  # of a parameter (and its gradient) as the run keeps it
    optim_per_param: float  # optimizer state bytes per trainable element
    activations: Activations  # without activation checkpointing
    checkpointed: Activations | None  # with full checkpointing (None: no blocks to checkpoint)
    loss_per_sample: int  # the loss's peak over a sample's logits (:func:`loss_per_sample`)
    train_flops: float  # forward + backward of one sample
    forward_flops: float  # forward of one sample (what checkpointing recomputes)
    width: int | None  # a decoder's hidden size (the tensor- and pipeline-parallel stream)
    tensor_parallel: bool  # whether the model has a tensor-parallel plan

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)


_MEASURED: dict[str, ModelStats] = {}
_SAVED: dict[tuple[Any, ...], Activations] = {}


def _model_key(cfg: Config) -> str:
    """What the measurements depend on (not the layout's checkpointing: each mode is its own)."""
    return repr((cfg.model, cfg.data, cfg.trainer, cfg.precision.float8))


def model_stats(cfg: Config) -> ModelStats:
    """The stats of ``cfg``'s model at ``cfg.data``'s sequence length, measured once per model,
    data and optimizer config in a process (a plan, then the dry run of its choice)."""
    key = repr((_model_key(cfg), cfg.optim))
    if key not in _MEASURED:
        _MEASURED[key] = _measure(cfg)
    return _MEASURED[key]


def saved_activations(
    cfg: Config, mode: str, *, every: int = 1, context: ContextShare | None = None
) -> Activations:
    """What one forward of ``cfg``'s whole model keeps for backward (module docstring) with
    activation checkpointing ``mode`` (``none`` | ``full`` | ``selective``; ``every``: full's
    every n-th block) and, under context parallel, on a rank's share of each sequence (the
    whole sequence without ``context``). Measured once per model and setting in a process."""
    share = context if context is not None and context.cp > 1 else None
    key = (_model_key(cfg), mode, every if mode == "full" else 1, share)
    if key not in _SAVED:
        model = _meta_model(cfg)
        if cfg.precision.float8 is not None:
            # As parallelize converts it, first; imported here: it imports torchao.
            from sdnet_trainer.distributed.float8 import convert_float8

            # fsdp=False: FSDP's float8 all-gather changes what is gathered, not what is saved.
            convert_float8(model, cfg, fsdp=False)
        if share is not None and share.apply is not None:
            share.apply(model)
        blocks = [b for b in parallel_blocks(model) if b is not None]
        apply_activation_checkpointing(blocks, mode, every=every, model_name=cfg.model.name)
        _SAVED[key] = _measure_saved(cfg, model, share.cp if share is not None else 1)
    return _SAVED[key]


def _meta_trainer(cfg: Config) -> Any:
    return resolve_trainer_class(cfg.trainer._target_)(cfg, env=DistEnv())


def _meta_model(cfg: Config) -> nn.Module:
    with torch.device("meta"):
        return _meta_trainer(cfg).build_model()


def _measure(cfg: Config) -> ModelStats:
    model = _meta_model(cfg)
    blocks = parallel_blocks(model)
    head, tail = _outside_blocks(model, blocks)
    params = list(model.parameters())
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    train, forward = _flops(cfg, model)
    sizes = decoder_sizes(cfg.model)
    return ModelStats(
        params=sum(p.numel() for p in params),
        head=head,
        tail=tail,
        blocks=tuple(sum(p.numel() for p in b.parameters()) for b in blocks),
        unsplit=sum(p.numel() for p in params if p.dim() < 2),
        experts=sum(p.numel() for m in experts for p in m.parameters()),
        num_experts=max((m.w1.shape[0] for m in experts), default=0),
        bytes_per_param=params[0].element_size() if params else 4,
        optim_per_param=optimizer_bytes_per_element(cfg),
        activations=saved_activations(cfg, "none"),
        checkpointed=saved_activations(cfg, "full") if blocks else None,
        loss_per_sample=loss_per_sample(cfg, model),
        train_flops=train,
        forward_flops=forward,
        width=sizes[0] if sizes is not None else None,
        tensor_parallel=supports_tensor_parallel(model),
    )


def _measure_saved(cfg: Config, model: nn.Module, cp: int) -> Activations:
    """Kept bytes at batch 1 and 2 (what grows with the batch, and what does not), each forward
    on the ``seq_len / cp`` tokens of a rank."""
    params = sum(p.numel() for p in model.parameters())
    one, attention = kept_bytes(model, sample_input(cfg, 1, cp=cp))
    two, _ = kept_bytes(model, sample_input(cfg, 2, cp=cp))
    seq_len = cfg.data.seq_len if is_language_model_data(cfg.data) else 0
    # Per sample over the whole sequence: the ring attention sees the local keys alone.
    whole = tuple((k * seq_len // length, v * seq_len // length) for k, v, length in attention)
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    names = {dtype: name for name, dtype in DTYPES.items()}
    return Activations(
        per_sample=two - one,
        fixed=max(0, 2 * one - two),
        params=params,
        attention=whole,
        dtype=names.get(floating[0], str(floating[0])) if floating else "fp32",
    )


def loss_per_sample(cfg: Config, model: nn.Module) -> int:
    """The most bytes the trainer's loss (``Trainer.loss_fn``) holds at once over a sample's
    logits, from the logits' creation to their gradient, counted by torch's ``MemTracker`` on the
    meta device (at one and two samples: what grows with the batch). The model's forward keeps
    the logits alive only until the loss has read them: a cross-entropy keeps its log-softmax for
    backward, which then holds that, its gradient and the logits' at once (three copies of the
    logits in fp32). Activations kept for backward (:func:`saved_activations`) leave the model's
    output out: this is its part. A classifier's (a few classes per sample, not a vocabulary per
    token) is left out."""
    if not is_language_model_data(cfg.data):
        return 0
    with torch.no_grad():
        per_sample = model(sample_input(cfg, 1)).shape[1:]
    trainer = _meta_trainer(cfg)

    def peak(batch: int) -> int:
        shape = (batch, *per_sample)
        targets = torch.zeros(shape[:-1], dtype=torch.long, device="meta")
        seed = torch.zeros((), device="meta", requires_grad=True)
        tracker = MemTracker()
        with tracker:
            # The logits as the model hands them over: produced by an op that saves nothing, so
            # the loss's own references alone keep them (as in a step, the forward's frame gone).
            trainer.loss_fn(seed.expand(shape) + 0, targets).backward()
        snapshot = tracker.get_tracker_snapshot("peak")
        return max((device["Total"] for device in snapshot.values()), default=0)

    return peak(2) - peak(1)


def sample_input(cfg: Config, batch: int, *, cp: int = 1) -> torch.Tensor:
    """A meta batch of ``cfg.data``'s shape; a language model's on ``seq_len / cp`` tokens."""
    data = cfg.data
    if is_language_model_data(data):
        return torch.zeros(batch, data.seq_len // cp, dtype=torch.long, device="meta")
    return torch.zeros(batch, 3, data.image_size, data.image_size, device="meta")


def kept_bytes(model: nn.Module, inputs: torch.Tensor) -> tuple[int, list[tuple[int, int, int]]]:
    """Bytes the forward of ``model`` on ``inputs`` leaves alive for backward (module docstring;
    on the meta device with attention as a GPU's fused kernel keeps it, on another device as its
    own kernels do), and each attention call's key and value elements per sample with the keys'
    length."""
    produced = _Produced()
    attention = _FusedAttention()
    with attention, produced:
        output = model(inputs)
    gc.collect()  # reference cycles of the forward's frames would keep what backward does not
    own = _storage_keys([*model.parameters(), *model.buffers(), inputs, *tree_leaves(output)])
    alive = sum(
        nbytes
        for key, (ref, nbytes) in produced.storages.items()
        if key not in own and not ref.expired()
    )
    del output
    return alive, attention.calls


class _Produced(TorchDispatchMode):
    """A weak reference to the storage of every tensor the ops under it produce, by the storage's
    address (unique while the weak reference holds it, also on the meta device, where every
    ``data_ptr`` is 0) with its size."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                for storage in _storages(leaf):
                    if storage._cdata not in self.storages:
                        self.storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        return out


class _FusedAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` as a GPU's fused kernel keeps it (module docstring), and
    the key and value elements of each call per sample, with the keys' length."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, int]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        query = args[0] if args else kwargs.get("query")
        meta = isinstance(query, torch.Tensor) and query.device.type == "meta"
        if func is not F.scaled_dot_product_attention or not meta:
            return func(*args, **kwargs)
        return self._fused(*args, **kwargs)

    def _fused(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        batch = max(q.shape[0], 1)
        self.calls.append((k.numel() // batch, v.numel() // batch, k.shape[-2]))
        bias = None
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                # What scaled_dot_product_attention hands the fused kernel: a new additive mask.
                zeros = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
                attn_mask = zeros.masked_fill(attn_mask.logical_not(), float("-inf"))
            bias = attn_mask.expand(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, dropout_p, is_causal and attn_mask is None, scale=scale
        )
        return out[0]


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages under ``t``: its own, or a tensor subclass's inner tensors' (float8's)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [s for name in names for s in _storages(getattr(t, name))]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # a layout without one storage (sparse, nested)
        return []


def _storage_keys(tensors: list[Any]) -> set[int]:
    return {s._cdata for t in tensors if isinstance(t, torch.Tensor) for s in _storages(t)}


T = TypeVar("T")


def saved_for_backward(forward: Callable[[], T], model: nn.Module | None = None) -> tuple[int, T]:
    """Bytes autograd keeps for backward while ``forward`` runs (on the meta device too), and
    what ``forward`` returned, through saved-tensor hooks: what autograd saves itself, not what a
    selective checkpoint caches (see :func:`kept_bytes`). Saved views of ``model``'s parameters
    (a linear layer keeps its weight for the input's gradient) are not counted: they are the
    parameters' own memory."""
    saved = 0
    owned = {p.untyped_storage()._cdata for p in model.parameters()} if model is not None else set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.untyped_storage()._cdata not in owned:
            saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = forward()
    return saved, result


def _outside_blocks(model: nn.Module, blocks: list[nn.Module]) -> tuple[int, int]:
    """Elements registered before the first block and after the last (each counted once)."""
    inside = {id(p) for b in blocks for p in b.parameters()}
    first = {id(p) for p in blocks[0].parameters()} if blocks else set()
    head = tail = 0
    seen: set[int] = set()
    before = True
    for p in model.parameters():
        if id(p) in first:
            before = False
        if id(p) in inside or id(p) in seen:
            continue
        seen.add(id(p))
        if before:
            head += p.numel()
        else:
            tail += p.numel()
    return head, tail


def _flops(cfg: Config, model: nn.Module) -> tuple[float, float]:
    """FLOPs of one sample: forward and backward together, and the forward alone."""
    out: list[torch.Tensor] = []
    forward = count_flops(lambda: out.append(model(sample_input(cfg, 1))))
    backward = count_flops(lambda: out[0].float().sum().backward())
    return float(forward + backward), float(forward)


__all__ = [
    "Activations",
    "ContextShare",
    "ModelStats",
    "kept_bytes",
    "loss_per_sample",
    "model_stats",
    "sample_input",
    "saved_activations",
    "saved_for_backward",
]
