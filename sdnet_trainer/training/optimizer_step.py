"""After backward: the step's gradient norm, the ranks' agreement, and the parameter update.

``OptimizerStep.apply`` runs once per optimizer step, after the last micro-step's backward:

1. the global gradient norm (unscaled under fp16, over every shard and pipeline stage): it
   serves the non-finite check, clipping and logging, for one pass over the gradients;
2. one small all-reduce so every rank takes the same branch (``Agreement``): a NaN/Inf seen by
   any rank, a stop signal received by any rank, a timed checkpoint due by rank 0's clock;
3. the update (clip, optimizer step, comm hook's after-step, schedule), never applied for a
   non-finite step: ``health.nonfinite=abort`` ends the run with the weights of the last good
   step, ``skip`` leaves the parameters and the optimizer state as they were;
4. ``zero_grad``.

Reading the verdict is a host synchronisation: on a GPU it drains the queue every step. So where
the optimizer can skip on the device (:func:`skips_on_device`: torch's fused Adam, AdamW and SGD
kernels skip their update where the optimizer's ``found_inf`` is nonzero, the mechanism
``GradScaler`` uses), the agreed flag is handed to the kernel without the host reading it, and
the verdict is *deferred*: read during the next step, after that step's backward is queued (every
rank at the same step, so the ranks still agree). The step's ``applied`` flag (1 - the agreed
non-finite flag, on the device) goes to the hooks, which scale what they move by it (the weight
average, a mixture of experts' routing bias), so a skipped step moves nothing there either.
Under ``abort`` the run ends when the verdict arrives, before the next update; ``settle()`` runs
before every checkpoint save and after the last step, so no checkpoint ever follows a non-finite
step. A stop signal or a timed checkpoint is acted on one step later. Elsewhere the verdict is
read at once, before the update (fp16, whose GradScaler reads its own overflow flag every step,
optimizers without a fused kernel, ZeRO-1's wrapper, PowerSGD's error feedback, which the host
discards).
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
        self._flags, self._device_flags = flags, flags
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

    def nonfinite_flag(self) -> torch.Tensor:
        """The agreed non-finite flag on the device (0-dim float: 1.0 where some rank saw a NaN
        or an Inf), for the update to skip on; the host does not read it (gloo's all-reduce on
        the CPU is waited for: its result is written by the host)."""
        if self._work is not None and self._event is None:
            self._work.wait()
            self._work = None
        return self._device_flags[0]

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
        # Deferred verdicts (module docstring): where the update skips on the device.
        self.on_device = skips_on_device(optimizer, precision, comm)
        self._pending: Agreement | None = None  # the last step's agreement, not read yet
        self._settled = NO_VERDICT  # read but not yet acted on (stop, save due, skipped)
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
        self.settle()  # the previous step's, now that this step's backward is queued
        verdict, self._settled = self._settled, NO_VERDICT
        if self.on_device and _skip_keeps_state(self.optimizer, params):
            self._pending = agreement
            flag = agreement.nonfinite_flag()
            self._update(grad_norm, params, found_inf=flag)
            applied = 1.0 - flag
        else:
            self.phase.enter("step agreement all-reduce", step=agreement.step)
            now = agreement.read()
            verdict |= now
            if now.nonfinite:
                self._skip(loss)
            else:
                self._update(grad_norm, params)
            applied = torch.full((), 0.0 if now.nonfinite else 1.0, device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, verdict, applied

    def settle(self, *, saving: bool = False) -> None:
        """Read a deferred verdict still in flight (its update was skipped on the device if it
        was non-finite): ``abort`` ends the run here, before a checkpoint (``saving``: a save is
        about to run, so a timed save due is served by it) or the next update builds on it;
        ``skip`` counts it. Stop and save-due flags wait for the next ``apply``."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.phase.enter("step agreement all-reduce (previous step)", step=pending.step)
            verdict = pending.read()
            if verdict.nonfinite:
                names = pending.nonfinite_names()
                if self.nonfinite == "abort":
                    raise NonFiniteError(pending.step, rank=self.rank, names=names)
                self._skipped(pending.step, names)
            self._settled |= verdict
        if saving:
            self._settled = Verdict(
                nonfinite=self._settled.nonfinite, stop=self._settled.stop, save_due=False
            )

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

    def _update(
        self,
        grad_norm: torch.Tensor,
        params: list[nn.Parameter],
        *,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """The update; ``found_inf`` (the device skip): the fused kernels skip it where nonzero."""
        self.phase.enter("optimizer", step=self.state.step + 1)
        self._clip(grad_norm, params)
        scaler = self.precision.scaler
        scale_before = scaler.get_scale() if scaler.is_enabled() else None
        if found_inf is not None:
            self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # torch reads it
        try:
            scaler.step(self.optimizer)  # skips optimizer.step when fp16 gradients overflowed
        finally:
            if found_inf is not None:
                del self.optimizer.found_inf  # type: ignore[attr-defined]
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
        if self.precision.scaling:
            self.precision.scaler.update()  # closes this step's unscale_; lowers the scale
        self.scheduler.step()
        self._skipped(step, names)

    def _skipped(self, step: int, names: list[str]) -> None:
        """A skipped step counted, and PowerSGD's memory of its gradients dropped."""
        self.state.nonfinite_steps += 1
        if self.comm is not None:
            self.comm.discard_error_feedback()
        logger.warning(
            "non-finite values at step %d (%s): step skipped (%d so far)",
            step,
            ", ".join(names) or "on another rank",
            self.state.nonfinite_steps,
        )


def skips_on_device(
    optimizer: torch.optim.Optimizer, precision: Precision, comm: GradientComm | None
) -> bool:
    """Whether a non-finite step can be skipped by the optimizer on the device, the host not
    reading the verdict first: torch's optimizers that take ``GradScaler``'s ``found_inf``
    (``_step_supports_amp_scaling``: Adam, AdamW, SGD, ...) skip on the device only in their
    fused kernels (the others refuse it). Not under fp16, whose GradScaler sets ``found_inf``
    itself; not with PowerSGD, whose error feedback the host must discard after such a step."""
    fused = all(group.get("fused") for group in optimizer.param_groups)
    supported = getattr(optimizer, "_step_supports_amp_scaling", False)
    powersgd = comm is not None and comm.cfg.hook == "powersgd"
    return fused and supported and not precision.scaling and not powersgd


def _skip_keeps_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> bool:
    """Whether a fused kernel's skipped step leaves the optimizer state as it was. Adam's and
    AdamW's state starts as zeros (their step count is restored). SGD's first step with momentum
    creates its buffers with ``empty_like`` for the kernel to fill with the gradient, which a
    skip leaves unwritten: where ``dampening`` is 0 the buffers are created here as zeros
    instead, which the kernel's ``momentum x 0 + gradient`` fills with the same gradient; with
    dampening the first step is checked on the host. Host-side dictionary work: no
    synchronisation, and once every parameter has its state no loop over them."""
    if not isinstance(optimizer, torch.optim.SGD):
        return True
    if len(optimizer.state) == sum(len(group["params"]) for group in optimizer.param_groups):
        return True
    stepped = {id(p) for p in params}
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        missing = [p for p in group["params"] if id(p) in stepped and not optimizer.state.get(p)]
        if missing and group["dampening"] != 0:
            return False
        for p in missing:
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return True
