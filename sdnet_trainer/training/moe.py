"""A mixture-of-experts model around the step: the auxiliary loss's weight, the experts' load
summed over the ranks after every step, DeepSeek-V3's bias update from it, and the load metrics.

**The auxiliary loss** (``model.moe.load_balance=aux_loss``) is per sequence: each MoE layer adds
the gradient of ``weight x (sum of its sequences' auxiliary losses)`` in its own backward, with
the weight the step's reduction contract gives a term per sequence
(``StepReduction.mean_weight`` of the global batch, in ``distributed/reduction.py``, read at
each forward: fault tolerance's quorum may change), so a step's auxiliary loss is the mean over
the global batch's sequences on every layout. It is not part of ``train/loss``; it is logged as
``moe/aux_loss``.

**The load** of every layer, the tokens each expert received in the step, is summed over the
ranks that saw different tokens (every rank but a tensor-parallel peer's copy) in one all-reduce
of a small tensor, which also carries the auxiliary loss and the sequence count: after every step
under ``load_balance=bias``, where each layer then moves its routing bias (on the device: no host
synchronisation), and otherwise at log points only. There the load is written: per layer the
fewest and most tokens an expert received, their ratio (1: balanced), and the tokens of every
expert.

The routing is dropless: every token reaches its ``top_k`` experts (no capacity, nothing
dropped), so there is no dropped-token count to report.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from sdnet_trainer.config.schema import Config
from sdnet_trainer.distributed.mesh import ParallelDims
from sdnet_trainer.distributed.reduction import StepReduction
from sdnet_trainer.models.moe import MoE, moe_sizes
from sdnet_trainer.models.registry import model_family
from sdnet_trainer.observability import MetricsWriter
from sdnet_trainer.training.hooks import HookBase
from sdnet_trainer.training.state import RunState, StepResult

_LAYER = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


class ExpertBalance(HookBase):
    """After every step the counters reset; before, under the bias, the load reduced and the
    bias moved; at log points the load reduced and written. ``layers``: this rank's MoE layers by
    block index (a pipeline stage holds some, perhaps none, and still joins the sum);
    ``n_layers``, ``num_experts``: the model's; ``contributes``: whether this rank's counts join
    the sum (False on tensor-parallel peers, which count the same tokens as their first peer);
    ``bias_update_rate``: None unless the layers balance by their bias."""

    def __init__(
        self,
        layers: dict[int, MoE],
        *,
        n_layers: int,
        num_experts: int,
        contributes: bool,
        bias_update_rate: float | None,
        writer: MetricsWriter,
        every_n_steps: int,
        total_steps: int,
        device: torch.device,
    ) -> None:
        self.layers, self.n_layers, self.contributes = layers, n_layers, contributes
        self.rate = bias_update_rate
        self.writer, self.every_n_steps, self.total_steps = writer, every_n_steps, total_steps
        self.experts = num_experts
        self.device = device
        self._stats: torch.Tensor | None = None

    def after_step(self, state: RunState, result: StepResult) -> None:
        log = state.step % self.every_n_steps == 0 or state.step == self.total_steps
        if self.rate is not None or log:  # no collective on other steps
            self._stats = self._reduced()
            # A skipped (non-finite) step left the weights as they were: the bias too (masked on
            # the device: the verdict may not have reached the host yet).
            if self.rate is not None:
                for index, layer in self.layers.items():
                    counts = self._stats[index, : self.experts]
                    layer.update_bias(counts, self.rate, applied=result.applied)
        for layer in self.layers.values():
            layer.reset_counts()
        if log:
            self.writer.write(state.step, self.metrics())

    def _reduced(self) -> torch.Tensor:
        """(n_layers, experts + 2): each layer's tokens per expert, summed auxiliary loss and
        sequence count, over every rank."""
        stats = torch.zeros(self.n_layers, self.experts + 2, device=self.device)
        if self.contributes:
            for index, layer in self.layers.items():
                stats[index, : self.experts] = layer.tokens_per_expert
                stats[index, self.experts] = layer.aux_loss_sum
                stats[index, self.experts + 1] = layer.sequences
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(stats)
        return stats

    def metrics(self) -> dict[str, float]:
        """The last step's figures (a host synchronisation: log points only)."""
        assert self._stats is not None, "metrics() before the first step"
        stats = self._stats.cpu()
        tokens, aux, sequences = stats[:, : self.experts], stats[:, -2], stats[:, -1]
        out: dict[str, float] = {}
        if bool((sequences > 0).all()):
            out["moe/aux_loss"] = float((aux / sequences).sum())
        for index in range(self.n_layers):
            low, high = float(tokens[index].min()), float(tokens[index].max())
            out[f"moe/layer{index}/tokens_min"] = low
            out[f"moe/layer{index}/tokens_max"] = high
            out[f"moe/layer{index}/load_min_max"] = low / high if high else 1.0
            for expert in range(self.experts):
                out[f"moe/layer{index}/expert{expert}/tokens"] = float(tokens[index, expert])
        return out


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """This rank's MoE layers by block index (whatever wraps the model: DDP's ``module.``)."""
    layers = {}
    for name, module in model.named_modules():
        match = _LAYER.search(name + ".")
        if isinstance(module, MoE) and match is not None:
            layers[int(match[1])] = module
    return layers


def expert_balance(
    cfg: Config,
    model: nn.Module,
    dims: ParallelDims,
    *,
    rank: int,
    global_batch_size: int,
    reduction: StepReduction,
    writer: MetricsWriter,
    total_steps: int,
    device: torch.device,
) -> ExpertBalance | None:
    """The hook for ``model`` (None unless its family has experts); sets every layer's auxiliary
    loss weight (module docstring) from ``reduction``, the step's contract."""
    family = model_family(cfg.model.name)
    if family is None or family.num_experts is None:
        return None
    layers, moe = moe_layers(model), moe_sizes(cfg.model)

    def weight() -> float:
        return reduction.mean_weight(global_batch_size)

    for layer in layers.values():
        layer.aux_loss_weight = weight
    return ExpertBalance(
        layers,
        n_layers=int(moe["n_layers"]),
        num_experts=int(moe["num_experts"]),
        contributes=dims.coordinates(rank)["tp"] == 0,
        bias_update_rate=moe["bias_update_rate"] if moe["load_balance"] == "bias" else None,
        writer=writer,
        every_n_steps=cfg.logging.log_every_n_steps,
        total_steps=total_steps,
        device=device,
    )


__all__ = ["ExpertBalance", "expert_balance", "moe_layers"]
