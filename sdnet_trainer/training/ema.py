"""An exponential moving average of the model's weights (``model.ema``).

The average lives in the layout of the weights it follows: under FSDP or tensor parallelism each
rank keeps the average of its own shards (DTensors, so a checkpoint of it reshards to any layout
and world size like the model's), under DDP and in one process a full copy, under pipeline
parallelism each stage its own part. The update is torch's EMA function
(``torch.optim.swa_utils.get_ema_multi_avg_fn``, the one ``AveragedModel`` applies), on the local
tensors: one fused ``lerp`` over the parameters and floating buffers, no collective.
``AveragedModel`` itself is not used: it deep-copies the module, which under FSDP2 copies the
sharding hooks and state of a module it does not own, and its forward would need the whole model.
The average is evaluated by swapping it into the model's own storage (:meth:`swapped_in`), so every
parallel layout evaluates it with its usual forward.

Non-floating buffers (BatchNorm's ``num_batches_tracked``) are not averaged: they follow the
model. Entries are named as in the model's checkpoint entry, so export loads either one into the
bare model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import get_ema_multi_avg_fn

from sdnet_trainer.config.checks import check_positive
from sdnet_trainer.config.schema import Config, EMAConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.training.hooks import HookBase
from sdnet_trainer.training.state import RunState, StepResult


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's values of a tensor (the shard of a DTensor), sharing its storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _no_negative_zeros(tensors: list[torch.Tensor]) -> None:
    """-0.0 made +0.0 (``x + 0.0``), every other value, NaN included, left as it is: a value
    that is not -0.0 stays bitwise the same when a zero of either sign is added to it, which a
    skipped step's masked update does (``WeightAverage.update``)."""
    if tensors:
        torch._foreach_add_(tensors, 0.0)


class WeightAverage(HookBase):
    """The EMA of ``model``'s parameters and floating buffers. A hook: ``after_step`` updates it
    every ``cfg.every_n_steps`` steps (a copy of the weights until ``cfg.warmup_steps``); a
    ``Stateful`` part of the checkpoint."""

    def __init__(
        self, model: nn.Module, cfg: EMAConfig, *, stages: Sequence[nn.Module] = ()
    ) -> None:
        self.model = model
        # Pipeline stages are modules of their own around the model's parts: their FSDP roots
        # are not in the model's tree.
        self.stages = list(stages)
        self.every_n_steps = cfg.every_n_steps
        self.warmup_steps = cfg.warmup_steps
        self.decay = cfg.decay
        self._update = get_ema_multi_avg_fn(cfg.decay)
        self.average: dict[str, torch.Tensor] = {}
        self.restart()

    def restart(self) -> None:
        """The average set to the current weights (at the start, and on resuming from a
        checkpoint written without ``model.ema``)."""
        self._reshard()
        live = self._live()
        self.average = {name: tensor.detach().clone() for name, tensor in live.items()}
        self._pair_up(live)
        _no_negative_zeros(self._averaged)

    def _pair_up(self, live: dict[str, torch.Tensor]) -> None:
        """The local tensors the update and the swap work on, found once: building the model's
        state dict costs milliseconds per call (tens on a ResNet-50), too much for every step.
        Weights and shards keep their storage (loading and optimizer steps write in place)."""
        self._weights = [_local(live[name]) for name in self.average]
        self._averages = [_local(average) for average in self.average.values()]
        floating = [t.is_floating_point() for t in self._averages]
        pairs = list(zip(self._averages, self._weights, floating))
        self._averaged = [average for average, _, f in pairs if f]
        self._dtypes = [average.dtype for average in self._averaged]  # of the masked lerp's weights
        self._current = [weight for _, weight, f in pairs if f]
        # Integer buffers (BatchNorm's counters) follow the weights: one fused copy, not a
        # Python loop over the layers every step.
        self._followers = [average for average, _, f in pairs if not f]
        self._followed = [weight for _, weight, f in pairs if not f]

    def _reshard(self) -> None:
        """FSDP modules back to their shards: after an evaluation, modules that keep their
        gathered weights after forward (the root) would otherwise be read, and written to, in a
        copy that the next forward does not gather again."""
        for root in (self.model, *self.stages):
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _live(self) -> dict[str, torch.Tensor]:
        """The model's tensors under their checkpoint names, sharing the model's storage; a tied
        tensor (an embedding shared with the output layer) once, under its first name."""
        seen: set[tuple[int, Any]] = set()
        live = {}
        for name, tensor in get_model_state_dict(self.model).items():
            if not isinstance(tensor, torch.Tensor):
                continue
            local = _local(tensor)
            key = (local.untyped_storage().data_ptr(), local.storage_offset())
            if local.numel() and key in seen:
                continue
            seen.add(key)
            live[name] = tensor
        return live

    @torch.no_grad()
    def update(self, step: int, applied: torch.Tensor | None = None) -> None:
        """The average moved towards the weights: a copy of them up to ``warmup_steps``, then
        torch's EMA, a ``lerp`` by ``1 - decay``. ``applied`` (``StepResult.applied``, on the
        device; None: applied) scales the lerp's weight, so a skipped step (0.0) leaves the
        average bitwise as it was without the host reading the flag: the weights did not move,
        so ``weights - average`` is finite and the lerp adds a zero to each value. A zero added
        to -0.0 can give +0.0: the average never holds a -0.0 (``_no_negative_zeros`` after
        every write), so adding a zero changes nothing."""
        if self._followers:
            torch._foreach_copy_(self._followers, self._followed)
        if not self._averaged:
            return
        if step <= self.warmup_steps:
            torch._foreach_copy_(self._averaged, self._current)
        elif applied is None:
            self._update(self._averaged, self._current, None)
        else:
            # A weight tensor per tensor keeps the flag on the device (a Scalar weight would read
            # it on the host); on CUDA this is one lerp kernel per tensor (the multi-tensor
            # kernel needs the weights' shapes to match the tensors').
            weight = (1.0 - self.decay) * applied.float()
            by_dtype = {dtype: weight.to(dtype) for dtype in set(self._dtypes)}
            weights = [by_dtype[dtype] for dtype in self._dtypes]
            torch._foreach_lerp_(self._averaged, self._current, weights)
        _no_negative_zeros(self._averaged)

    def after_step(self, state: RunState, result: StepResult) -> None:
        if state.step % self.every_n_steps == 0:
            self.update(state.step, result.applied)

    # ------------------------------------------------------------------ evaluation

    @contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """The average in the model's place (and the weights back afterwards, on every path)."""
        self._reshard()
        kept = [weight.clone() for weight in self._weights]
        torch._foreach_copy_(self._weights, self._averages)
        try:
            yield
        finally:
            self._reshard()
            torch._foreach_copy_(self._weights, kept)

    # ------------------------------------------------------------------ as a checkpoint part

    def state_dict(self) -> dict[str, Any]:
        return dict(self.average)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, average in self.average.items():
            if state[name] is not average:  # DCP fills the tensors in place
                average.copy_(state[name])
        # The weights were loaded just before (checkpoint order): pair with them as they are now.
        self._reshard()
        self._pair_up(self._live())
        _no_negative_zeros(self._averaged)


def validate_ema(cfg: Config) -> None:
    ema = cfg.model.ema
    if not ema.enabled:
        return
    if not 0.0 <= ema.decay <= 1.0:
        raise ConfigError(f"model.ema.decay={ema.decay} must be in [0, 1]")
    check_positive("model.ema.every_n_steps", ema.every_n_steps)
    check_positive("model.ema.warmup_steps", ema.warmup_steps, allow_zero=True)


__all__ = ["WeightAverage", "validate_ema"]
