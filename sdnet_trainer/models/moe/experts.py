"""The mixture-of-experts layer: a router sends each token to ``top_k`` of ``num_experts`` SwiGLU
experts whose weights are stacked into 3-D parameters (:class:`GroupedExperts`: one grouped
matmul per projection for all experts), optionally beside shared experts every token passes
through, with its load balancing and the counters the training loop reads (:class:`MoE`).

Load balancing (``load_balance``):

- ``aux_loss``: a per-sequence auxiliary loss ``coeff * E * sum_i f_i * P_i`` (``f_i``: the share
  of the sequence's routed slots that went to expert i; ``P_i``: expert i's mean router
  probability over the sequence's tokens). Its gradient enters backward through the layer's own
  output (:class:`_AuxLossGradient`, Megatron's "aux loss auto-scaler"), so it needs no path to
  the loss and works inside a pipeline stage;
- ``bias``: DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the router's
  probabilities for the choice of experts only (the weights come from the probabilities), moved
  towards balance after each optimizer step by :meth:`MoE.update_bias`;
- ``none``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from sdnet_trainer.models.llama.model import FeedForward

LOAD_BALANCE = ("aux_loss", "bias", "none")

# torch's grouped matmul: public from torch 2.10 (F.grouped_mm), private before.
_GROUPED_MM: Any = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of a parameter: a DTensor's local shard (the experts an expert-parallel
    rank holds; a tensor-parallel replica), a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _autocast_off(device: torch.device) -> AbstractContextManager:
    # A device without autocast (the meta device of the planner's forward) has nothing to turn off.
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return nullcontext()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on (the grouped matmul is not
    on autocast's lists, so the layer casts for it), else the input's."""
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes ``x`` against these stacked weights: on the CPU (any
    float dtype) and on CUDA GPUs of compute capability 8.0 or more in bf16, with every row
    width a multiple of 16 bytes (the kernels' requirement); a compiled graph lowers it in bf16
    only."""
    if _GROUPED_MM is None:
        return False
    dtype, device = x.dtype, x.device
    if any(t.shape[-1] * t.element_size() % 16 for t in (x, *weights)):
        return False
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    return False


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts ``w2(silu(w1 x) * w3 x)``, each one slice of the stacked
    parameters: ``w1[e]`` (gate) and ``w3[e]`` (up) of shape (hidden, dim), ``w2[e]`` (down) of
    shape (dim, hidden), as a Hugging Face expert's ``gate_proj``, ``up_proj`` and ``down_proj``.

    Under expert parallel each rank holds a run of whole experts (the parameters are DTensors
    sharded by expert, read through ``to_local()``), and the rows it receives are its experts'."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default per expert: uniform within 1 / sqrt(fan_in).
        for weight in (self.w1, self.w3, self.w2):
            bound = weight.shape[-1] ** -0.5
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (M, dim): rows sorted by expert, ``counts[e]`` of them for this rank's expert e
        (int64, one per local expert, possibly 0) -> (M, dim), each row through its expert."""
        dtype = _compute_dtype(x)
        x = x.to(dtype)
        w1, w3, w2 = (_local(w).to(dtype) for w in (self.w1, self.w3, self.w2))
        if x.is_meta:
            # The planner's shape-only forward: every row through one expert has the grouped
            # computation's shapes, FLOPs and saved activations (FlopCounterMode does not count
            # the grouped matmul).
            return _swiglu(x, w1[0], w3[0], w2[0])
        if grouped_mm_supported(x, w1, w2):
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)

            def project(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return _GROUPED_MM(rows, w.transpose(-2, -1), offs=offsets)

            return project(F.silu(project(x, w1)) * project(x, w3), w2)
        # One matmul per expert; the split sizes are a host synchronisation.
        groups = torch.split(x, counts.tolist())
        return torch.cat([_swiglu(g, w1[e], w3[e], w2[e]) for e, g in enumerate(groups)])


class _AuxLossGradient(torch.autograd.Function):
    """The layer's output unchanged in forward; in backward, besides the output's gradient,
    ``weight`` as the gradient of the auxiliary loss (a scalar), whose own backward then reaches
    the router."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None


def _counting_forward() -> bool:
    """Not a recomputation: activation checkpointing runs a forward again inside backward, where
    autograd's graph task is set. A compiled graph recomputes inside its own backward graph, which
    runs no Python forward, so a forward being traced always counts."""
    return torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1


class MoE(nn.Module):
    """(B, T, dim) -> (B, T, dim): each token through its ``top_k`` routed experts, weighted by
    the router's probabilities (renormalised over the chosen ones with ``norm_topk_prob``), plus
    the shared experts when there are any.

    Dropless: every token reaches all its ``top_k`` experts, with no capacity limit and nothing
    dropped. The router computes in float32 whatever the compute dtype. In training (not in a
    recomputation, see :func:`_counting_forward`) the layer counts the rows each expert received
    (``tokens_per_expert``), and under ``aux_loss`` adds up its sequences' auxiliary losses
    (``aux_loss_sum``, detached) and their number (``sequences``): the training loop reads and
    resets them (:meth:`reset_counts`). ``aux_loss_weight`` scales the auxiliary loss's gradient
    (None: ``1 / B``, the mean over this forward's sequences); the Trainer sets it for the global
    batch, as a number or as a function read at each forward (its value may change between steps:
    fault-tolerant replica groups share a batch among as many groups as the step's quorum holds).
    fp16 autocast is not recommended for the router's inputs; the precision check is the
    preflight's."""

    # Kept out of float8 (distributed/float8.py reads this): the choice of experts is made in
    # float32 from the router's weight read directly (_probabilities), which float8 would round
    # and FSDP's float8 all-gather would hand over as a float8-casting wrapper.
    high_precision_children: ClassVar[tuple[str, ...]] = ("router",)

    expert_bias: torch.Tensor
    tokens_per_expert: torch.Tensor
    aux_loss_sum: torch.Tensor
    sequences: torch.Tensor

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        hidden: int,
        *,
        num_shared_experts: int = 0,
        norm_topk_prob: bool = True,
        load_balance: str = "aux_loss",
        aux_loss_coeff: float = 0.001,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.norm_topk_prob = norm_topk_prob
        self.load_balance, self.aux_loss_coeff = load_balance, aux_loss_coeff
        self.aux_loss_weight: float | Callable[[], float] | None = None
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, hidden)
        self.shared = FeedForward(dim, num_shared_experts * hidden) if num_shared_experts else None
        if load_balance == "bias":
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.register_buffer("sequences", torch.zeros(()), persistent=False)

    def reset_parameters(self) -> None:
        """The layer's own tensors are its buffers, all zero at the start (also the init step
        that sets them after a build on the meta device)."""
        with torch.no_grad():
            for buffer in self._buffers.values():
                if buffer is not None:
                    buffer.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        tokens = x.reshape(-1, dim)
        probs = self._probabilities(tokens)
        weights, chosen = self._choose(probs)
        flat = chosen.flatten()
        # A scatter rather than bincount: its output's shape does not depend on the values (the
        # meta device, compiled graphs).
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k  # the token of each expert-sorted copy
        routed = self.experts(tokens[rows], counts)
        weighted = routed.to(x.dtype) * weights.to(x.dtype).flatten()[order, None]
        out = torch.zeros_like(tokens).index_add(0, rows, weighted)
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = out.view(batch, length, dim)
        if not self.training:
            return out
        counting = _counting_forward()
        if counting:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
                self.sequences.add_(batch)
        if self.load_balance == "aux_loss":
            aux = self._sequence_aux_losses(probs, chosen, batch).sum()
            if counting:
                self.aux_loss_sum.add_(aux.detach())
            weight = self.aux_loss_weight if self.aux_loss_weight is not None else 1.0 / batch
            if callable(weight):
                weight = weight()
            out = _AuxLossGradient.apply(out, aux, weight)
        return out

    def _probabilities(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N, E) router probabilities in float32: the choice of experts is decided by small
        differences that a bf16 matmul (autocast's) would round away."""
        weight = _local(self.router.weight)
        with _autocast_off(tokens.device):
            logits = F.linear(tokens.float(), weight.float())
        return logits.softmax(dim=-1)

    def _choose(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), each (N, top_k): the experts by probability, or under ``bias`` by
        probability plus the expert's bias; the weights are the probabilities either way."""
        scores = probs + self.expert_bias if self.load_balance == "bias" else probs
        chosen = torch.topk(scores, self.top_k, dim=-1).indices
        weights = probs.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def _sequence_aux_losses(
        self, probs: torch.Tensor, chosen: torch.Tensor, batch: int
    ) -> torch.Tensor:
        """(B,) ``coeff * E * sum_i f_i * P_i`` per sequence (module docstring)."""
        experts = self.num_experts
        slots = chosen.view(batch, -1)
        routed = torch.zeros(batch, experts, device=probs.device)
        routed = routed.scatter_add(1, slots, torch.ones_like(slots, dtype=routed.dtype))
        share = routed / slots.shape[1]  # f: of the sequence's T * top_k slots
        mean_probs = probs.view(batch, -1, experts).mean(1)  # P
        return self.aux_loss_coeff * experts * (share * mean_probs).sum(1)

    @torch.no_grad()
    def update_bias(
        self, global_counts: torch.Tensor, rate: float, *, applied: torch.Tensor | None = None
    ) -> None:
        """DeepSeek-V3's update after an optimizer step: each expert's bias moves by ``rate``
        towards balance, ``bias += rate * sign(mean load - load)``; ``global_counts``: the tokens
        per expert of the step, summed over every rank; ``applied`` (``StepResult.applied``, on
        the device; None: applied): 0.0 where the step's update was skipped (non-finite), and the
        bias then stays bitwise as it was, the host not reading the flag (a select, not a
        multiplication: ``bias + 0.0`` would turn a -0.0 into +0.0)."""
        if self.load_balance != "bias":
            raise RuntimeError(
                f"update_bias on a layer with load_balance={self.load_balance!r}: only "
                f"model.moe.load_balance=bias has a routing bias"
            )
        load = global_counts.to(self.expert_bias)
        moved = self.expert_bias + rate * torch.sign(load.mean() - load)
        if applied is not None:
            moved = torch.where(applied.to(moved.device) > 0, moved, self.expert_bias)
        self.expert_bias.copy_(moved)

    @torch.no_grad()
    def reset_counts(self) -> None:
        """Zero the step's counters (``tokens_per_expert``, ``aux_loss_sum``, ``sequences``)."""
        for counter in (self.tokens_per_expert, self.aux_loss_sum, self.sequences):
            counter.zero_()


__all__ = ["LOAD_BALANCE", "GroupedExperts", "MoE", "grouped_mm_supported"]
