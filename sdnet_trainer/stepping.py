"""After backward: the step's gradient norm, the ranks' agreement, and the parameter update.

``OptimizerStep.apply`` runs once per optimizer step, after the last micro-step's backward:

1. the global gradient norm (unscaled under fp16, over every shard and pipeline stage): it
   serves the non-finite check, clipping and logging, for one pass over the gradients;
2. one small all-reduce so every rank takes the same branch (``agree``): a NaN/Inf seen by any
   rank, a stop signal received by any rank, a timed checkpoint due by rank 0's clock;
3. the update (clip, GradScaler step, comm hook's after-step, schedule), or, for a non-finite
   step, ``health.nonfinite``: abort naming the tensors, or skip the update;
4. ``zero_grad``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sdnet_trainer.config.schema import OptimConfig
from sdnet_trainer.distributed.comm import GradientComm
from sdnet_trainer.distributed.ddp import unwrap
from sdnet_trainer.distributed.grad_norm import global_grad_norm
from sdnet_trainer.distributed.ops import all_reduce_max
from sdnet_trainer.health import NonFiniteError, PhaseTracker, nonfinite_tensor_names
from sdnet_trainer.precision import Precision
from sdnet_trainer.state import RunState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """What every rank agreed on at the end of a step."""

    nonfinite: bool  # a NaN/Inf on some rank: the update was skipped (or the run aborted)
    stop: bool  # some rank received a stop signal: save and leave after this step
    save_due: bool  # rank 0's clock: a timed checkpoint is due


class OptimizerStep:
    """Owns the part of a step between backward and the next forward. ``host_flags()`` gives this
    rank's (stop signal received, timed checkpoint due), folded into the step's one all-reduce."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        precision: Precision,
        comm: GradientComm | None,
        cfg: OptimConfig,
        nonfinite: str,
        pp_group: dist.ProcessGroup | None,
        device: torch.device,
        state: RunState,
        phase: PhaseTracker,
        rank: int,
        host_flags: Callable[[], tuple[bool, bool]],
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.precision = precision
        self.comm = comm
        self.cfg = cfg
        self.nonfinite = nonfinite
        self.pp_group = pp_group
        self.device = device
        self.state = state
        self.phase = phase
        self.rank = rank
        self.host_flags = host_flags

    def apply(self, loss: torch.Tensor) -> tuple[torch.Tensor, Verdict]:
        """Norm, agreement, update or skip, zero_grad; returns the gradient norm and the verdict."""
        # One pass over the parameters per step, shared by the norm and clipping.
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = self.grad_norm(params)
        verdict = self.agree(loss, grad_norm)
        if verdict.nonfinite:
            self._skip(loss)
        else:
            self._update(grad_norm, params)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, verdict

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The total gradient norm of ``params`` (those with gradients) in true units (unscaled
        under fp16); the global norm under every layout (sharded and pipelined gradients
        included)."""
        self.precision.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        return global_grad_norm(grads, pp_group=self.pp_group, device=self.device)

    def agree(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> Verdict:
        """One small all-reduce per step so every rank takes the same branch."""
        self.phase.enter("step agreement all-reduce", step=self.state.step + 1)
        # Under fp16 an overflowing gradient is routine (the GradScaler skips that step), so only
        # the loss counts as a health event there.
        finite = torch.isfinite(loss)
        if not self.precision.scaling:
            finite = finite & torch.isfinite(grad_norm)
        host = torch.tensor([float(flag) for flag in self.host_flags()])
        flags = torch.cat([(~finite).float().reshape(1), host.to(self.device, non_blocking=True)])
        # The one host synchronisation per step: every rank must know the verdict before stepping.
        nonfinite, stop, due = (bool(v) for v in all_reduce_max(flags).tolist())
        return Verdict(nonfinite=nonfinite, stop=stop, save_due=due)

    def _update(self, grad_norm: torch.Tensor, params: list[nn.Parameter]) -> None:
        self.phase.enter("optimizer", step=self.state.step + 1)
        self._clip(grad_norm, params)
        scaler = self.precision.scaler
        scale_before = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(self.optimizer)  # skips optimizer.step when fp16 gradients overflowed
        scaler.update()
        if scale_before is not None and scaler.get_scale() < scale_before:
            self.state.skipped_steps += 1
            if self.comm is not None:
                self.comm.discard_error_feedback()  # PowerSGD's memory holds this step's inf
        if self.comm is not None:
            self.comm.after_optimizer_step(self.model.parameters())  # local SGD: average replicas
        self.scheduler.step()

    def _clip(self, grad_norm: torch.Tensor, params: list[nn.Parameter]) -> None:
        if self.cfg.clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.cfg.clip_grad_value)
        if self.cfg.clip_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.clip_grad_norm, grad_norm)

    def _skip(self, loss: torch.Tensor) -> None:
        """``health.nonfinite``: abort naming the tensors, or skip. A skipped step leaves the
        parameters and optimizer state as they were; the schedule moves on with the step count,
        as it does when the fp16 GradScaler skips a step."""
        names = nonfinite_tensor_names(
            ((name, p.grad) for name, p in unwrap(self.model).named_parameters()),
            loss=loss if not torch.isfinite(loss) else None,
        )
        step = self.state.step + 1
        if self.nonfinite == "abort":
            raise NonFiniteError(step=step, rank=self.rank, names=names)
        self.state.nonfinite_steps += 1
        if self.comm is not None:
            self.comm.discard_error_feedback()
        if self.precision.scaling:
            self.precision.scaler.update()  # closes this step's unscale_; lowers the scale
        self.scheduler.step()
        logger.warning(
            "non-finite values at step %d (%s): step skipped (%d so far)",
            step,
            ", ".join(names) or "on another rank",
            self.state.nonfinite_steps,
        )
