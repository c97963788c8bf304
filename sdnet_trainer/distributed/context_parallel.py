"""Context parallel (``parallel.cp``): each sequence split over ``cp`` ranks, attention computed
across the shards, with torch's own pieces (``torch.distributed.tensor.experimental``).

**Sharding.** A causal sequence cut into ``cp`` contiguous pieces gives the last rank the most
work (its queries see the most keys). torch's head-tail load balancer cuts it into ``2 x cp``
chunks and gives rank ``r`` chunks ``r`` and ``2cp - 1 - r``, so every rank does the same
attention work; :meth:`ContextParallel.shard` applies it (``_context_parallel_shard``) to the
tokens and the targets of every batch, training and validation, right after they reach the
device. ``data.seq_len`` must therefore be a multiple of ``2 x cp``.

**Positions.** A rank's tokens are no longer ``0..T/cp-1``: every module that reads positions
(rotary angles, the GPT's position table; ``models/attention.py``) is given the positions of this
rank's tokens, so RoPE and learned positions are right on every shard.

**Attention** (``parallel.cp_attention``), :meth:`ContextParallel.attend`, which every attention
layer calls: the :class:`CausalAttention` kernel of the project's families, the attention function
a ``transformers`` model is given (``models/hf_causal_lm.py``):

- ``ring``: torch's ring attention. The inputs become DTensors sharded on the sequence (as
  torch's ``_ContextParallel`` style makes them) and torch's CP dispatcher routes the fused SDPA
  kernels (flash, memory-efficient, cuDNN) to their ring versions, which pass key/value blocks
  around the ranks and merge the partial softmaxes. CUDA only: torch has no ring for the CPU kernel.
- ``allgather``: the keys and values of the whole sequence are gathered on every rank (torch's
  ``flex_cp_allgather`` custom op, whose backward reduce-scatters their gradients) and each
  local query attends to the keys at its own and earlier positions, by a mask built from the
  positions. This is the K/V all-gather form of context parallel (Llama 3's); it holds the
  whole sequence's keys and values on each rank (small under grouped-query attention).
- ``auto``: ring on CUDA, allgather elsewhere.

**Gradients.** Context-parallel peers hold the same parameters and partial gradients; FSDP
shards over ``dp_shard x cp`` and DDP reduces over ``dp_replicate x cp`` (distributed/mesh.py),
and the step weighs each rank's loss by its share of the global batch's counted targets
(distributed/reduction.py), so the step equals one process's over the whole sequences.
Parameters are untouched: checkpoints move between layouts with and without context parallel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.config.schema import Config
from sdnet_trainer.distributed.env import resolve_device
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.attention import CausalAttention

CP_ATTENTION = ("auto", "ring", "allgather")


def validate_context_parallel(cfg: Config, *, cp: int, pp: int, supported: bool) -> None:
    """``parallel.cp`` against the data and the rest of the layout, before launch.
    ``supported``: whether ``model.name``'s family has attention context parallel can shard."""
    parallel = cfg.parallel
    check_choice("parallel.cp_attention", parallel.cp_attention, CP_ATTENTION)
    if cp == 1:
        return
    if not supported:
        raise ConfigError(
            f"parallel.cp={cp}: model.name={cfg.model.name!r} has no context-parallel attention "
            f"(the gpt, llama and hf_causal_lm families have it); use parallel.cp=1"
        )
    seq_len = cfg.data.seq_len
    if seq_len % (2 * cp):
        raise ConfigError(
            f"parallel.cp={cp} splits each sequence into 2 x {cp} = {2 * cp} equal chunks "
            f"(causal load balancing); data.seq_len={seq_len} is not a multiple of {2 * cp}"
        )
    tp = parallel.tp
    if parallel.tensor_parallel.sequence_parallel and tp > 1 and (seq_len // cp) % tp:
        raise ConfigError(
            f"sequence parallel splits each rank's {seq_len // cp} tokens (data.seq_len="
            f"{seq_len} / parallel.cp={cp}) over parallel.tp={tp} ranks, which does not divide "
            f"them; data.seq_len must be a multiple of parallel.cp x parallel.tp = {cp * tp}"
        )
    if pp > 1:
        raise ConfigError(
            f"parallel.cp={cp} with parallel.pp={pp}: context parallel is not combined with "
            f"pipeline stages here; use FSDP and tensor parallel beside it"
        )
    if parallel.strategy == "zero1":
        raise ConfigError(
            f"parallel.strategy=zero1 with parallel.cp={cp}: ZeRO-1 runs with plain data "
            f"parallelism only; use parallel=fsdp"
        )
    attention_method(parallel.cp_attention, resolve_device(cfg.dist, local_rank=0))


def attention_method(requested: str, device: torch.device) -> str:
    """``parallel.cp_attention`` resolved for ``device``."""
    if requested == "auto":
        return "ring" if device.type == "cuda" else "allgather"
    if requested == "ring" and device.type != "cuda":
        raise ConfigError(
            f"parallel.cp_attention=ring runs torch's ring attention, which has CUDA kernels "
            f"only; this rank runs on {device}: use parallel.cp_attention=allgather (or auto)"
        )
    return requested


class ContextParallel:
    """This rank's share of every sequence of ``seq_len`` tokens over ``cp_mesh``, and what the
    model needs to compute on it (module docstring)."""

    def __init__(self, cp_mesh: DeviceMesh, *, seq_len: int, method: str, device: torch.device):
        # Private torch API (the module docstring's pieces): imported only by runs that use it.
        from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

        self.mesh, self.method, self.seq_len = cp_mesh, method, seq_len
        self.balancer = _HeadTailLoadBalancer(seq_len, cp_mesh.size(), device)
        # Rank-major: the whole sequence's positions in the order the ranks hold them, which is
        # also the order of keys and values gathered from all ranks.
        order = self.balancer._generate_indices(restore=False)[0].to(device)
        self.key_positions = order
        self.positions = order.chunk(cp_mesh.size())[cp_mesh.get_local_rank()]
        # Where each local query may look: keys at its own and earlier positions.
        self.mask = self.positions[:, None] >= self.key_positions[None, :]
        # The same as an additive mask, made once per dtype: SDPA would otherwise turn the
        # boolean one into a new additive mask in every layer and keep each for backward.
        self._additive: dict[torch.dtype, torch.Tensor] = {}

    def apply(self, model: nn.Module) -> None:
        """Set the positions of every module that reads them and route the model's attention
        through :meth:`attend`, in place: the :class:`CausalAttention` kernels of the project's
        families, or a model's own ``use_attention`` (``transformers`` models); raises
        ConfigError for a model with neither."""
        kernels = [m for m in model.modules() if isinstance(m, CausalAttention)]
        routes: Any = getattr(model, "use_attention", None)  # transformers models (above)
        if not kernels and routes is None:
            raise ConfigError(
                f"parallel.cp={self.mesh.size()}: the model has no CausalAttention kernel "
                f"(models/attention.py) to compute attention across the sequence's shards"
            )
        if self.method == "ring":
            from torch.distributed.tensor.experimental._context_parallel import (
                _enable_context_parallel_dispatcher,
            )

            # DTensor's dispatch of the fused SDPA kernels to their ring versions.
            _enable_context_parallel_dispatcher()
        for module in model.modules():
            if hasattr(module, "positions"):
                module.positions = self.positions
        for kernel in kernels:
            kernel.attend = self.attend
        if not kernels:
            routes(self.attend)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        dropout_p: float = 0.0,
    ) -> torch.Tensor:
        """Causal attention of this rank's queries (B, heads, T/cp, head_dim) over the whole
        sequence, from this rank's keys and values (B, kv_heads, T/cp, head_dim)."""
        if self.method == "ring":
            return self._ring(q, k, v, scale=scale, dropout_p=dropout_p)
        from torch.distributed.distributed_c10d import _get_process_group_name
        from torch.distributed.tensor.experimental._context_parallel import flex_cp_allgather

        group = _get_process_group_name(self.mesh.get_group())
        k, v = flex_cp_allgather(k, v, 2, group)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=self._additive_mask(q.dtype),
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    def _additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._additive:
            blocked = torch.full_like(self.mask, float("-inf"), dtype=dtype)
            self._additive[dtype] = blocked.masked_fill(self.mask, 0.0)
        return self._additive[dtype]

    def _ring(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
        dropout_p: float,
    ) -> torch.Tensor:
        """torch's ring attention: the inputs as DTensors sharded on the sequence (what torch's
        ``_ContextParallel`` style does around a module), the causal SDPA dispatched to its ring
        version, the output back to this rank's shard."""
        if k.shape[1] != q.shape[1]:  # the ring kernels take as many key/value heads as queries
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        q, k, v = (DTensor.from_local(t, self.mesh, [Shard(2)], run_check=False) for t in (q, k, v))
        out: Any = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale
        )
        return out.to_local()  # a DTensor, as its inputs

    def shard(self, batch: Any) -> Any:
        """This rank's share of a language-model batch: ``(tokens, targets)``, each (B, T) with
        T = data.seq_len, cut along the sequence as the load balancer orders it. Anything else
        passes as it is."""
        from torch.distributed.tensor.experimental._context_parallel import (
            _context_parallel_shard,
        )

        if not (isinstance(batch, (tuple, list)) and all(torch.is_tensor(t) for t in batch)):
            return batch
        for tensor in batch:
            if tensor.dim() < 2 or tensor.shape[1] != self.seq_len:
                raise ConfigError(
                    f"parallel.cp={self.mesh.size()} was set up for sequences of data.seq_len="
                    f"{self.seq_len} tokens; a batch holds a tensor of shape {tuple(tensor.shape)}"
                )
        shards = _context_parallel_shard(
            self.mesh, list(batch), [1] * len(batch), load_balancer=self.balancer
        )
        return type(batch)(shards)


__all__ = [
    "CP_ATTENTION",
    "ContextParallel",
    "attention_method",
    "validate_context_parallel",
]
