"""After backward: the step's gradient norm, the ranks' agreement, and the parameter update.

``OptimizerStep.apply`` runs once per optimizer step, after the last micro-step's backward:

1. the global gradient norm (unscaled under fp16, over every shard and pipeline stage): it
   serves the non-finite check, clipping and logging, for one pass over the gradients;
2. one small all-reduce so every rank takes the same branch (``Agreement``): a NaN/Inf seen by
   any rank, a stop signal received by any rank, a timed checkpoint due by rank 0's clock;
3. the update (clip, GradScaler step, comm hook's after-step, schedule), or, for a non-finite
   step, ``health.nonfinite``: abort naming the tensors, or skip the update;
4. ``zero_grad``.

Reading the verdict is a host synchronisation: on a GPU it drains the queue every step. So where
acting one step late is harmless, the verdict is *deferred*: the all-reduce starts asynchronously,
and the step's verdict is read during the next step, after that step's backward is queued (every
rank at the same step, so the ranks still agree). That is the default, ``health.nonfinite=abort``:
a non-finite step has been applied when the verdict arrives, but the run ends there, and
``settle()`` runs before every checkpoint save and after the last step, so no checkpoint ever holds
it. A stop signal or a timed checkpoint is acted on one step later. The verdict stays synchronous
where the update itself depends on it: ``nonfinite=skip`` (the step must not be applied) and fp16
(the GradScaler reads its overflow flag every step anyway).
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
from sdnet_trainer.distributed.float8 import refresh_float8_scales
from sdnet_trainer.distributed.grad_norm import (
    by_layout,
    global_grad_norm,
    replicate_partial_grads,
)
from sdnet_trainer.distributed.ops import is_distributed
from sdnet_trainer.runtime.precision import Precision
from sdnet_trainer.training.health import NonFiniteError, PhaseTracker, nonfinite_tensor_names
from sdnet_trainer.training.state import RunState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """What every rank agreed on at the end of a step."""

    nonfinite: bool  # a NaN/Inf on some rank: the update was skipped (or the run aborted)
    stop: bool  # some rank received a stop signal: save and leave after this step
    save_due: bool  # rank 0's clock: a timed checkpoint is due

    def __or__(self, other: Verdict) -> Verdict:
        return Verdict(
            nonfinite=self.nonfinite or other.nonfinite,
            stop=self.stop or other.stop,
            save_due=self.save_due or other.save_due,
        )


NO_VERDICT = Verdict(nonfinite=False, stop=False, save_due=False)


class Agreement:
    """One step's flags (non-finite, stop, save due) on their way to every rank.

    Construction starts the element-wise-max all-reduce asynchronously (no collective without a
    process group); ``read()`` waits for it and returns the verdict. On CUDA the result is copied
    into a pinned host buffer behind an event, so a later ``read()`` waits only for that copy,
    never for the work queued after it.
    """

    def __init__(
        self,
        flags: torch.Tensor,
        *,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        host_buffer: torch.Tensor | None = None,
    ) -> None:
        self.step = step
        # Kept to say what was non-finite when the verdict arrives a step late.
        self.loss, self.grad_norm = loss, grad_norm
        self._flags = flags
        self._event: torch.cuda.Event | None = None
        self._work = (
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
            if is_distributed()
            else None
        )
        if flags.device.type == "cuda":
            assert host_buffer is not None
            if self._work is not None:
                self._work.wait()  # NCCL: the current stream waits for the collective; the host not
                self._work = None
            host_buffer.copy_(flags, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._flags = host_buffer

    def read(self) -> Verdict:
        """The agreed verdict (a host synchronisation on this step's flags only)."""
        if self._work is not None:
            self._work.wait()
        if self._event is not None:
            self._event.synchronize()
        nonfinite, stop, due = (bool(v) for v in self._flags.tolist())
        return Verdict(nonfinite=nonfinite, stop=stop, save_due=due)

    def nonfinite_names(self) -> list[str]:
        """What this rank saw non-finite at that step (read when the run is ending anyway); the
        per-tensor names need the step's gradients, gone once it was applied."""
        names = [] if torch.isfinite(self.loss) else ["loss"]
        return names if torch.isfinite(self.grad_norm) else [*names, "gradient norm"]


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
        # Deferred verdicts (module docstring): everywhere the update does not depend on them.
        self.deferred = nonfinite == "abort" and not precision.scaling
        self._pending: Agreement | None = None  # the last step's agreement, not read yet
        self._settled = NO_VERDICT  # read but not yet acted on (stop, save due)
        # Two pinned buffers on CUDA: one for the step in flight, one for the step being read.
        self._host_buffers = (
            [torch.empty(3, pin_memory=True) for _ in range(2)] if device.type == "cuda" else None
        )

    def apply(self, loss: torch.Tensor) -> tuple[torch.Tensor, Verdict, torch.Tensor]:
        """Norm, agreement, update or skip, zero_grad; returns the gradient norm, the verdict
        to act on (this step's, or the previous step's when deferred) and, on the device, 1.0
        where this step's update was applied, 0.0 where it was skipped."""
        # One pass over the parameters per step, shared by the norm and clipping.
        params = [p for p in self.model.parameters() if p.grad is not None]
        replicate_partial_grads(params)
        grad_norm = self.grad_norm(params)
        agreement = self.agree(loss, grad_norm)
        if self.deferred:
            self.settle()  # the previous step's, now that this step's backward is queued
            verdict, self._settled = self._settled, NO_VERDICT
            self._pending = agreement
            self._update(grad_norm, params)
        else:
            self.phase.enter("step agreement all-reduce", step=agreement.step)
            verdict = agreement.read()
            if verdict.nonfinite:
                self._skip(loss)
            else:
                self._update(grad_norm, params)
        self.optimizer.zero_grad(set_to_none=True)
        applied = torch.full((), 0.0 if verdict.nonfinite and not self.deferred else 1.0)
        return grad_norm, verdict, applied.to(self.device)

    def settle(self, *, saving: bool = False) -> None:
        """Read a deferred verdict still in flight: a non-finite step ends the run here, before
        a checkpoint (``saving``: a save is about to run, so a timed save due is served by it) or
        the end of the run builds on it. Stop and save-due flags wait for the next ``apply``."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.phase.enter("step agreement all-reduce (previous step)", step=pending.step)
            verdict = pending.read()
            if verdict.nonfinite:
                raise NonFiniteError(pending.step, rank=self.rank, names=pending.nonfinite_names())
            self._settled |= verdict
        if saving:
            self._settled = Verdict(nonfinite=False, stop=self._settled.stop, save_due=False)

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The total gradient norm of ``params`` (those with gradients) in true units (unscaled
        under fp16); the global norm under every layout (sharded and pipelined gradients
        included)."""
        self.precision.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        return global_grad_norm(grads, pp_group=self.pp_group, device=self.device)

    def agree(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> Agreement:
        """Start this step's one small all-reduce, so every rank takes the same branch."""
        step = self.state.step + 1
        # Under fp16 an overflowing gradient is routine (the GradScaler skips that step), so only
        # the loss counts as a health event there.
        finite = torch.isfinite(loss)
        if not self.precision.scaling:
            finite = finite & torch.isfinite(grad_norm)
        # Pinned on CUDA: a copy from pageable memory would synchronise with the host.
        host = torch.tensor(
            [float(flag) for flag in self.host_flags()], pin_memory=self.device.type == "cuda"
        )
        flags = torch.cat([(~finite).float().reshape(1), host.to(self.device, non_blocking=True)])
        buffers = self._host_buffers
        return Agreement(
            flags,
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            host_buffer=buffers[step % 2] if buffers is not None else None,
        )

    def _update(self, grad_norm: torch.Tensor, params: list[nn.Parameter]) -> None:
        self.phase.enter("optimizer", step=self.state.step + 1)
        self._clip(grad_norm, params)
        scaler = self.precision.scaler
        scale_before = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(self.optimizer)  # skips optimizer.step when fp16 gradients overflowed
        scaler.update()
        refresh_float8_scales(self.model)  # FSDP's float8 all-gather: the new weights' scales
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
            # One call per layout: expert-parallel experts' gradients live on another mesh.
            for group in by_layout(params):  # a parameter's gradient shares its layout
                torch.nn.utils.clip_grads_with_norm_(group, self.cfg.clip_grad_norm, grad_norm)

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
