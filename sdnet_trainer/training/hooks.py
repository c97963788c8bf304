"""Periodic work around the training loop: profiler, evaluation, metrics, watchdog, heartbeat.

The loop calls every hook's ``before_train(state)``, ``after_step(state, result)`` and
``after_train(state)`` in the order of ``Trainer.build_hooks`` (the one place that order is
declared), and ``close()`` on every path out of the loop, last hook first. Each hook is built
with what it needs (periods, the writer, callables) and reads the run's ``RunState`` and the
step's ``StepResult``, never the Trainer; hooks never change the training math. The
checkpointer is a hook too (``sdnet_trainer.training.checkpointer``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from sdnet_trainer.config.observability import LoggingConfig
from sdnet_trainer.config.schema import LoopConfig
from sdnet_trainer.observability import MetricsWriter, ProgressBar, StepMeter
from sdnet_trainer.observability.figures import RunFigures, gather_named, per_rank, rank_spread
from sdnet_trainer.observability.meters import MemoryWindow
from sdnet_trainer.observability.profiler import StepProfiler
from sdnet_trainer.observability.progress import progress_enabled
from sdnet_trainer.training.health import Heartbeat, PhaseTracker, Watchdog
from sdnet_trainer.training.state import RunState, StepResult

logger = logging.getLogger(__name__)


class HookBase:
    def before_train(self, state: RunState) -> None:
        pass

    def after_step(self, state: RunState, result: StepResult) -> None:
        pass

    def after_train(self, state: RunState) -> None:
        pass

    def close(self) -> None:
        """Release what the hook holds; runs on every path out of the loop, errors included."""


class ProfilerHook(HookBase):
    """Advances ``torch.profiler``'s step schedule after every step."""

    def __init__(self, profiler: StepProfiler) -> None:
        self.profiler = profiler
        self._open = False

    def before_train(self, state: RunState) -> None:
        self.profiler.__enter__()
        self._open = True

    def after_step(self, state: RunState, result: StepResult) -> None:
        self.profiler.step()

    def close(self) -> None:
        if self._open:
            self._open = False
            self.profiler.__exit__(None, None, None)


class EvalHook(HookBase):
    """Evaluate every ``every_n_steps``, at each epoch end, and once at the end. With
    ``swap_average`` (``model.ema``), the weight average is evaluated too, in the model's place,
    as ``val_ema/*`` (over the same batches: ``evaluate`` applies ``loop.eval_max_batches``).

    ``loop.eval_at_epoch_end`` left null evaluates at epoch ends only when no
    ``loop.eval_every_n_steps`` is set: a period the user chose is the schedule, and an epoch
    end adding evaluations to it was work nobody asked for."""

    def __init__(
        self,
        evaluate: Callable[[], dict[str, float]],
        cfg: LoopConfig,
        *,
        writer: MetricsWriter,
        total_steps: int,
        phase: PhaseTracker | None = None,
        swap_average: Callable[[], AbstractContextManager[None]] | None = None,
    ) -> None:
        self.evaluate = evaluate
        self.swap_average = swap_average
        self.writer = writer
        self.every_n_steps = cfg.eval_every_n_steps
        at_epoch_end = cfg.eval_at_epoch_end
        self.at_epoch_end = cfg.eval_every_n_steps is None if at_epoch_end is None else at_epoch_end
        self.at_end = cfg.eval_at_end
        self.total_steps = total_steps
        self.phase = phase

    def after_step(self, state: RunState, result: StepResult) -> None:
        if state.step == self.total_steps and self.at_end:
            return  # after_train evaluates the final model once
        periodic = self.every_n_steps is not None and state.step % self.every_n_steps == 0
        if periodic or (self.at_epoch_end and state.epoch_ended):
            self._run(state)

    def after_train(self, state: RunState) -> None:
        if self.at_end:
            self._run(state)

    def _run(self, state: RunState) -> None:
        started = time.perf_counter()
        if self.phase is not None:
            self.phase.enter("evaluation", step=state.step)
        metrics = {f"val/{k}": v for k, v in self.evaluate().items()}
        if not metrics:
            return
        if self.swap_average is not None:
            with self.swap_average():
                metrics.update({f"val_ema/{k}": v for k, v in self.evaluate().items()})
        state.metrics.update(metrics)
        self.writer.write(state.step, metrics)
        shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        logger.info("eval @ step %d: %s (%.1f s)", state.step, shown, time.perf_counter() - started)


# The step meter's window figures each rank reports at a log point (StepMeter.flush).
_WINDOW = ("samples_per_s", "step_s", "data_wait_s", "fwd_bwd_s", "optimizer_s")


class MetricsHook(HookBase):
    """Training metrics every ``every_n_steps`` (and at the last step), the progress bar, and the
    one-line summary at the end.

    All ranks take part: each log point gathers a few named floats per rank in one collective
    (loss, throughput, step time, phase times, memory) and reduces each by name
    (``observability/figures.py``): stragglers show as the ranks' spread of step time and
    samples/s and the slowest rank's index, a bounded number of keys at any world size (every
    rank's own with ``logging.per_rank_metrics``).
    Memory figures are those of the window since the previous log point (see
    :class:`~sdnet_trainer.observability.meters.MemoryWindow`), evaluations and checkpoints in it
    included: the max over ranks, allocator retries the sum.
    Between log points the loss stays on the device, so the loop adds no host synchronisation.
    ``comm_bytes(step)`` gives the bytes one rank hands to the gradient collectives per step;
    ``loss_scale()`` the fp16 GradScaler's scale (None without loss scaling); ``bad_samples()``
    how many training samples this rank's loader replaced under ``data.on_bad_sample=skip`` (see
    ``sdnet_trainer.data.skipped_samples``), logged at every log point, summed over the
    data-parallel ranks, as ``data/skipped_samples`` (None: not logged).
    """

    def __init__(
        self,
        cfg: LoggingConfig,
        figures: RunFigures,
        *,
        writer: MetricsWriter,
        meter: StepMeter,
        device: torch.device,
        lr: Callable[[], float],
        comm_bytes: Callable[[int], float] | None,
        loss_scale: Callable[[], float] | None,
        rank: int,
        bad_samples: Callable[[], int] | None = None,
    ) -> None:
        self.figures = figures
        self.writer = writer
        self.meter = meter
        self.device = device
        self.every_n_steps = cfg.log_every_n_steps
        self.rank = rank
        self.per_rank_metrics = cfg.per_rank_metrics
        self.total_steps = figures.total_steps
        self.lr = lr
        self.comm_bytes = comm_bytes
        self.loss_scale = loss_scale
        self.bad_samples = bad_samples
        self.progress_bar = progress_enabled(cfg.progress_bar, is_main=rank == 0)
        self.memory = MemoryWindow(device)
        # The window's loss and applied steps, on the device: a skipped step's NaN stays out.
        self._loss_sum: torch.Tensor | None = None
        self._loss_steps: torch.Tensor | None = None
        self._started = time.perf_counter()
        self._bar: ProgressBar | None = None

    def is_log_step(self, step: int) -> bool:
        return step % self.every_n_steps == 0 or step == self.total_steps

    def before_train(self, state: RunState) -> None:
        self._started = time.perf_counter()
        self.memory.read()  # the first window starts here, without the setup's peak
        self._bar = ProgressBar(
            total=self.total_steps, initial=state.step, enabled=self.progress_bar
        )

    def after_step(self, state: RunState, result: StepResult) -> None:
        applied = result.applied
        if applied is None:
            applied = torch.tensor(0.0 if result.nonfinite else 1.0, device=result.loss.device)
        loss = torch.where(applied > 0, result.loss, torch.zeros_like(result.loss))
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_steps = applied if self._loss_steps is None else self._loss_steps + applied
        if self.is_log_step(state.step):
            self._log(state, result)
        elif self._bar is not None:
            self._bar.update(state.step)

    def _log(self, state: RunState, result: StepResult) -> None:
        window = self.meter.flush()
        local_loss = (
            (self._loss_sum / self._loss_steps).item()  # 0/0 where every step was skipped: nan
            if self._loss_sum is not None and self._loss_steps is not None
            else math.nan
        )
        self._loss_sum, self._loss_steps = None, None
        weight = self.figures.metric_weight
        memory = self.memory.read()
        local = {
            "loss": local_loss * weight if weight else 0.0,
            "weight": weight,
            **{key: window[key] for key in _WINDOW},
            **{f"memory/{key}": value for key, value in memory.items()},
        }
        if self.bad_samples is not None:
            # Weighted like the loss: tensor-parallel peers and pipeline stages load the same
            # samples, so each data-parallel rank counts once.
            local["bad_samples"] = float(self.bad_samples()) * weight
        ranks = gather_named(local, device=self.device)  # one collective, every rank's readings
        step_s = ranks["step_s"]
        metrics = {
            "train/loss": (ranks["loss"].sum() / ranks["weight"].sum()).item(),
            "train/lr": self.lr(),
            "train/epoch": state.epoch + state.epoch_sample / self.figures.samples_per_epoch,
            "perf/samples_per_s": ranks["samples_per_s"].sum().item(),
            # The phases of the slowest rank's window bound the step.
            **{f"perf/{key}": ranks[key].max().item() for key in _WINDOW[1:]},
            "train/grad_norm": result.grad_norm.item(),
            # Stragglers, in keys that do not grow with the world size.
            **rank_spread("perf/rank_step_s", step_s),
            **rank_spread("perf/rank_samples_per_s", ranks["samples_per_s"]),
            "perf/slowest_rank": float(step_s.argmax().item()),
        }
        for key in memory:
            # Retries add up over ranks (how often the run hit the limit); sizes are per rank.
            column = ranks[f"memory/{key}"]
            metrics[f"perf/{key}"] = (
                column.sum() if key == "alloc_retries" else column.max()
            ).item()
        metrics.update(self.figures.throughput(metrics["perf/samples_per_s"]))
        if self.comm_bytes is not None:
            metrics["comm/bytes_per_step"] = self.comm_bytes(state.step)
        if state.nonfinite_steps:
            metrics["train/nonfinite_steps"] = float(state.nonfinite_steps)
        if self.loss_scale is not None:
            metrics["train/loss_scale"] = self.loss_scale()
            metrics["train/skipped_steps"] = float(state.skipped_steps)
        if self.bad_samples is not None:
            metrics["data/skipped_samples"] = ranks["bad_samples"].sum().item()
        if self.per_rank_metrics:
            metrics.update(per_rank("perf/samples_per_s", ranks["samples_per_s"]))
            metrics.update(per_rank("perf/step_s", step_s))
        # This rank's own readings go to its own sinks (Prometheus' per-rank gauges) only.
        own = {f"perf/{key}_rank{self.rank}": local[key] for key in ("samples_per_s", "step_s")}
        state.metrics["train/loss"] = metrics["train/loss"]
        self.writer.write(state.step, metrics, this_rank=own)
        if self._bar is not None:
            self._bar.update(
                state.step,
                {
                    "loss": f"{metrics['train/loss']:.4f}",
                    "lr": f"{metrics['train/lr']:.3g}",
                    "img/s": f"{metrics['perf/samples_per_s']:.1f}",
                },
            )
        logger.info(
            "step %d/%d  loss %.4f  lr %.4g  %.1f samples/s  step %.3f s  data %.3f s",
            state.step,
            self.total_steps,
            metrics["train/loss"],
            metrics["train/lr"],
            metrics["perf/samples_per_s"],
            metrics["perf/step_s"],
            metrics["perf/data_wait_s"],
        )

    def after_train(self, state: RunState) -> None:
        self.close()
        meter = self.meter
        global_rate = (
            meter.total_samples / meter.total_seconds * self.figures.world_size
            if meter.total_seconds > 0
            else 0.0
        )
        summary = {
            "summary/steps": float(meter.total_steps),
            "summary/train_seconds": meter.total_seconds,
            "summary/wall_seconds": time.perf_counter() - self._started,
            "summary/samples_per_s": global_rate,
        }
        state.metrics.update(summary)
        self.writer.write(state.step, summary)
        finals = "  ".join(
            f"{k} {v:.4g}" for k, v in state.metrics.items() if k.startswith(("train/loss", "val/"))
        )
        logger.info(
            "done: %d steps in %.1f s  %.1f samples/s global  %s",
            meter.total_steps,
            summary["summary/wall_seconds"],
            global_rate,
            finals,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class WatchdogHook(HookBase):
    """Runs the hang watchdog while training and beats it after every step."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def before_train(self, state: RunState) -> None:
        self.watchdog.start()

    def after_step(self, state: RunState, result: StepResult) -> None:
        self.watchdog.beat()

    def close(self) -> None:
        self.watchdog.stop()


class HeartbeatHook(HookBase):
    """A rate-limited per-rank line with the step's timings, to spot stragglers."""

    def __init__(self, heartbeat: Heartbeat) -> None:
        self.heartbeat = heartbeat

    def after_step(self, state: RunState, result: StepResult) -> None:
        self.heartbeat.maybe_log(state.step, step_s=result.seconds, data_wait_s=result.data_wait_s)
