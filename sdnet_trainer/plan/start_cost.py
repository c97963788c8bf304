"""What starting a rank costs, rehearsed on the meta device: the dry run's ``start`` section
(``plan/dry_run.py``).

A real rank, once its parts of the model are sharded, allocates them and writes their values:
from scratch (``models/init.py``'s :func:`~sdnet_trainer.models.init.materialize` over the
model's init steps) or from a Hugging Face folder (the family's reader: DCP's
``HuggingFaceStorageReader`` over the family's state-dict adapter). :func:`start_cost` takes the
same parts, the same steps and the same adapter, all on the meta device, and counts what those
code paths would touch and allocate, computing no value and reading no file:

- initialisation: the bytes allocated on the device for the parts' parameters and buffers (their
  local shards; parameters under FSDP's CPU offload in host memory); the values the
  counter-based generator computes (:func:`~sdnet_trainer.models.init_values.fill_cost` of each
  :class:`~sdnet_trainer.models.init.Draw` whose parameter is on this rank); the largest fill's
  scratch on the device (one chunk's temporaries, measured once by running ``fill`` on a chunk,
  and a whole-shard staging buffer where ``fill`` cannot write in place); on the host, the
  full-size CPU stand-ins the replayed steps run on, sized as ``materialize`` sizes them;
- a Hugging Face load: DCP's own load planning (``DefaultLoadPlanner``'s local plan) of the
  adapter's state of this rank's tensors against the metadata of a folder storing each of them
  whole, in bf16 as the hub's folders do. Its read items are what the reader reads: each one
  through safetensors' ``get_slice`` into a host buffer of its own, then copied into the target,
  where torch's blocking copy to a GPU converts the dtype on the host first (a second host
  buffer, in the parameter's dtype).

The dry run builds one rank at a time, so host and device bytes are per rank.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sdnet_trainer.config import Config
from sdnet_trainer.models import init_values
from sdnet_trainer.models.init import Draw, InitStep
from sdnet_trainer.models.init_values import Constant, Distribution, fill, fill_cost
from sdnet_trainer.models.local_slices import local_runs

# The dtype a Hugging Face folder of these models stores (the hub's Llama 3 and MoE checkpoints).
STORED_DTYPE = torch.bfloat16


@dataclass
class InitCost:
    """Initialising this rank's parts from scratch (``materialize``)."""

    device: int  # bytes allocated on the device: the parts' parameters and buffers, local shards
    host: int  # host bytes while it runs: the replayed steps' full-size CPU stand-ins
    host_params: int  # parameters kept in host memory (FSDP's CPU offload), from then on
    values: int  # values the counter-based generator computes for this rank's shards
    # The largest fill's temporaries (one chunk, or a staging shard), where the parameters are:
    # on the device, or on the host under CPU offload (host_params).
    scratch: int
    draws: int  # the Draw steps whose parameter is on this rank
    replayed: int  # the steps replayed on CPU stand-ins (every rank runs all of them)


@dataclass
class LoadCost:
    """Reading this rank's parts from a Hugging Face folder (DCP's HuggingFaceStorageReader)."""

    read: int  # bytes this rank reads: its shards of every stored tensor
    reads: int  # DCP's read items (one host buffer each, one after the other)
    largest: int  # the largest read item's bytes: the host buffer safetensors reads it into
    host: int  # host bytes while the largest read is copied: its buffer + its dtype conversion
    own_names: int  # tensors no Hugging Face model names (a MoE's shared experts), counted alike


@dataclass
class StartCost:
    """What starting this rank costs (module docstring); ``init`` None: the model is built with
    its values on the CPU (no init steps); ``load`` None: its family reads no Hugging Face
    folder (``note`` says why)."""

    init: InitCost | None
    load: LoadCost | None
    # The most host memory at once: parameters offloaded to the CPU, then the init's stand-ins
    # (and its fills' scratch, where the parameters are offloaded) or a load's largest read
    # (materialize's stand-ins live while it runs, and are freed before a load reads).
    host_peak: int
    note: str = ""


def start_cost(
    cfg: Config, model: nn.Module, steps: list[InitStep] | None, parts: list[nn.Module]
) -> StartCost:
    """The start of the rank that holds ``parts`` (its part of ``model``, sharded, on the meta
    device), initialised by ``steps`` (the model's init steps, taken before it was parallelized,
    as the Trainer takes them) or read from a Hugging Face folder."""
    offload = cfg.parallel.fsdp.cpu_offload
    init = _init_cost(steps, parts, offload=offload) if steps is not None else None
    # Where a load's targets are: on a GPU, unless the run is on the CPU or FSDP keeps the
    # parameters there (CPU offload: every part is an FSDP unit).
    on_host = cfg.dist.device == "cpu" or (
        offload and all(isinstance(part, FSDPModule) for part in parts)
    )
    load, note = _load_cost(cfg, model, parts, on_gpu=not on_host)
    if init is None:
        note = "; ".join(filter(None, ["built with its values on the CPU (no init steps)", note]))
    kept, initialising = 0, 0
    if init is not None:
        kept = init.host_params
        initialising = init.host + (init.scratch if init.host_params else 0)
    host_peak = kept + max(initialising, load.host if load else 0)
    return StartCost(init=init, load=load, host_peak=host_peak, note=note)


# ---------------------------------------------------------------------- initialisation


def _init_cost(steps: list[InitStep], parts: list[nn.Module], *, offload: bool) -> InitCost:
    """``materialize(steps)`` on this rank's parts, counted (module docstring)."""
    params = _unique(p for part in parts for p in part.parameters())
    buffers = _unique(b for part in parts for b in part.buffers())
    # allocate(): under FSDP's CPU offload a wrapped part's parameters live in host memory.
    offloaded = _unique(
        p for part in parts if offload and isinstance(part, FSDPModule) for p in part.parameters()
    )
    held = {id(p) for p in params}
    device = _local_bytes(params + buffers) - _local_bytes(offloaded)
    values = scratch = draws = 0
    replayed: list[InitStep] = []
    # (values, scratch) per shard geometry: a model's blocks repeat the same few shapes, and
    # cutting a shard into rows and chunks walks its indices.
    costs: dict[tuple[Any, ...], tuple[int, int]] = {}
    for step in steps:
        if not isinstance(step.fn, Draw):
            replayed.append(step)
            continue
        tensor = step.module._parameters[step.fn.name]
        # A Draw's parameter that is not among the parts' (a unit a pipeline split gave to
        # another rank) stays on the meta device in a real run, and fill() skips it.
        if tensor is None or id(tensor) not in held:
            continue
        dist = step.fn.dist
        key = (_geometry(tensor), type(dist))
        if key not in costs:
            costs[key] = (fill_cost(tensor, dist), _fill_scratch(tensor, dist))
        draws += 1
        values += costs[key][0]
        scratch = max(scratch, costs[key][1])
    return InitCost(
        device=device,
        host=sum(_stand_in_slots(replayed)),
        host_params=_local_bytes(offloaded),
        values=values,
        scratch=scratch,
        draws=draws,
        replayed=len(replayed),
    )


def _geometry(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What ``fill`` cuts a shard by: the whole tensor's shape, its placements on its mesh (this
    rank's coordinates), the local tensor's kind and layout."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    layout = (type(local), local.dtype, local.is_contiguous())
    if not isinstance(tensor, DTensor):
        return (tuple(tensor.shape), *layout)
    mesh = tensor.device_mesh
    return (tuple(tensor.shape), tensor.placements, id(mesh), *layout)


def _stand_in_slots(steps: list[InitStep]) -> list[int]:
    """``materialize``'s scratch for the replayed ``steps``: one buffer per position among a
    module's own tensors (weight, bias, ...), each as large as the largest full tensor at that
    position, on every rank (every rank replays every step)."""
    slots: list[int] = []
    for step in steps:
        own = [
            *(t for t in step.module._parameters.values() if t is not None),
            *(t for t in step.module._buffers.values() if t is not None),
        ]
        for i, t in enumerate(own):
            nbytes = t.numel() * t.element_size()  # a DTensor's numel is the full tensor's
            if i == len(slots):
                slots.append(nbytes)
            else:
                slots[i] = max(slots[i], nbytes)
    return slots


def _fill_scratch(tensor: torch.Tensor, dist: Distribution) -> int:
    """The device bytes ``fill`` needs beside ``tensor``'s shard: its largest chunk's
    temporaries, and a float32 buffer of the whole shard where it cannot write in place (the
    same test as ``fill``: a plain contiguous floating-point local tensor)."""
    if isinstance(dist, Constant):
        return 0  # fill_() in place
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.numel() == 0:
        return 0
    direct = type(local) is torch.Tensor and local.is_contiguous() and local.dtype.is_floating_point
    staging = 0 if direct else local.numel() * 4
    return staging + _largest_chunk_pairs(tensor) * _bytes_per_pair(dist)


def _largest_chunk_pairs(tensor: torch.Tensor) -> int:
    """The counters (pairs of values) of the largest chunk ``fill`` cuts ``tensor``'s shard into:
    the first chunk has the most rows and the widest columns; a row starting at an odd index
    takes one more pair."""
    bases, inner = init_values._rows(local_runs(tensor), tensor.shape, torch.device("cpu"))
    r0, r1, c0, c1 = next(init_values._chunks(bases.numel(), inner))
    aligned = not bool((bases & 1).any())
    return (r1 - r0) * init_values._pairs(c1 - c0, aligned=aligned)


# Bytes of fill's temporaries per counter, by distribution kind (measured once per process).
_PER_PAIR: dict[type, int] = {}


def _bytes_per_pair(dist: Distribution) -> int:
    """The most bytes of temporaries alive at once while ``fill`` computes one whole chunk of
    ``dist``'s kind, per counter: measured once per kind, on the CPU (the same torch operations
    run on the device)."""
    kind = type(dist)
    if kind not in _PER_PAIR:
        pairs = init_values._CHUNK_PAIRS
        target = torch.empty(2 * pairs)
        fill(target[:2], dist, seed=0, key="rehearsal")  # once before: first calls import modules
        with _LiveBytes(ignore=target) as live:
            fill(target, dist, seed=0, key="rehearsal")
        _PER_PAIR[kind] = math.ceil(live.peak / pairs)
    return _PER_PAIR[kind]


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensors torch operations create while the mode is on (storages
    other than ``ignore``'s), each counted until its last tensor is gone."""

    def __init__(self, *, ignore: torch.Tensor) -> None:
        super().__init__()
        self._ignore = ignore.untyped_storage().data_ptr()
        self._holders: dict[int, int] = {}  # storage address -> its live tensors seen
        self.live = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        if address in (0, self._ignore):
            return
        if address not in self._holders:
            self._holders[address] = 0
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._holders[address] += 1
        weakref.finalize(t, self._release, address, nbytes)

    def _release(self, address: int, nbytes: int) -> None:
        self._holders[address] -= 1
        if not self._holders[address]:
            del self._holders[address]
            self.live -= nbytes


# ---------------------------------------------------------------------- Hugging Face load


def _load_cost(
    cfg: Config, model: nn.Module, parts: list[nn.Module], *, on_gpu: bool
) -> tuple[LoadCost | None, str]:
    """DCP's load plan of this rank's tensors under Hugging Face's names, counted."""
    state, own_names, note = hf_state(cfg, model, parts)
    if state is None:
        return None, note
    items = _read_items(state)
    read, largest, host = 0, 0, 0
    for lengths, target in items:
        nbytes = math.prod(lengths) * STORED_DTYPE.itemsize
        read += nbytes
        # A blocking copy to a GPU converts on the host first (torch's copy_kernel_cuda).
        converted = math.prod(lengths) * target.itemsize if on_gpu and target != STORED_DTYPE else 0
        largest, host = max(largest, nbytes), max(host, nbytes + converted)
    cost = LoadCost(read=read, reads=len(items), largest=largest, host=host, own_names=own_names)
    return cost, note


def hf_state(
    cfg: Config, model: nn.Module, parts: list[nn.Module]
) -> tuple[dict[str, torch.Tensor] | None, int, str]:
    """This rank's parameters under the names the family's Hugging Face reader reads them by
    (its state-dict adapter, the hub's layout), each value over the same tensor (a DTensor
    shard, or a view of one); the count of tensors left under the model's own names (what no
    Hugging Face model of the family has); a note. None where the family reads no folder."""
    from sdnet_trainer.models.lora_names import base_state
    from sdnet_trainer.models.registry import model_family

    family = model_family(cfg.model.name)
    if family is None or family.hf_weights is None:
        return None, 0, f"no Hugging Face reader for model.name={cfg.model.name}"
    held = {id(p) for part in parts for p in part.parameters()}
    names = {name for name, p in model.named_parameters() if id(p) in held}
    state = {k: v for k, v in base_state(model, keep_vars=True).items() if k in names}
    tied = bool(getattr(model, "tie_embeddings", False))
    if cfg.model.name == "llama":
        from sdnet_trainer.models.llama.state_dict_adapter import to_hf

        return dict(to_hf(state, tied=tied).tensors), 0, ""
    if cfg.model.name == "moe":
        from sdnet_trainer.models.moe import hf as moe_hf
        from sdnet_trainer.models.moe.state_dict_adapter import to_hf as moe_to_hf

        # The hub's per-expert layout, Qwen3-MoE's with query/key norms, Mixtral's without (the
        # two name the same shapes); what neither has (shared experts) under the model's names.
        kind = moe_hf.QWEN3 if getattr(model, "qk_norm", False) else moe_hf.MIXTRAL
        layout = moe_hf.written_layout(kind)
        own = {
            k: v for k, v in state.items() if moe_hf.stored_as(k, tuple(v.shape), layout) is None
        }
        named = {k: v for k, v in state.items() if k not in own}
        tensors = dict(moe_to_hf(named, layout, tied=tied).tensors) | own
        note = f"{len(own)} tensors with no Hugging Face name read as named" if own else ""
        return tensors, len(own), note
    return None, 0, f"no rehearsal of model.name={cfg.model.name}'s Hugging Face reader"


def _read_items(state: dict[str, torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """DCP's read items for loading ``state`` from a folder storing each of its tensors whole
    (the metadata ``HuggingFaceStorageReader`` makes of a folder's headers): each item's lengths
    and its target's dtype."""
    metadata = Metadata(
        {
            key: TensorStorageMetadata(
                TensorProperties(dtype=STORED_DTYPE),
                t.shape,
                [ChunkStorageMetadata(offsets=torch.Size([0] * t.dim()), sizes=t.shape)],
            )
            for key, t in state.items()
        }
    )
    # DefaultLoadPlanner's create_local_plan over a flat state dict, without its set_up_planner,
    # which would allocate every meta tensor (on the device a real rank has them on already).
    plan = create_default_local_load_plan(state, metadata)
    return [(tuple(item.lengths), state[item.dest_index.fqn].dtype) for item in plan.items]


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor once (a tied weight is one parameter in two modules)."""
    return list({id(t): t for t in tensors}.values())


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


__all__ = ["STORED_DTYPE", "InitCost", "LoadCost", "StartCost", "hf_state", "start_cost"]
