"""Periodic work around the training loop: evaluation, metrics and the progress bar.

The loop calls every hook's ``before_train`` / ``after_step`` / ``after_train`` in the order of
``Trainer.build_hooks``; a subclass adds its own by extending that list. Hooks read the trainer's
state (``trainer.step``, ``trainer.last_step``) and never change the training math.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from sdnet_trainer.distributed import all_gather_floats
from sdnet_trainer.observability import ProgressBar, peak_memory_mb
from sdnet_trainer.observability.flops import mfu
from sdnet_trainer.observability.progress import progress_enabled

if TYPE_CHECKING:
    from sdnet_trainer.trainer import Trainer

logger = logging.getLogger(__name__)


class HookBase:
    def before_train(self, trainer: Trainer) -> None:
        pass

    def after_step(self, trainer: Trainer) -> None:
        pass

    def after_train(self, trainer: Trainer) -> None:
        pass


class EvalHook(HookBase):
    """Evaluate every ``loop.eval_every_n_steps``, at each epoch end, and once at the end."""

    def after_step(self, trainer: Trainer) -> None:
        loop = trainer.cfg.loop
        step = trainer.step
        if step == trainer.total_steps and loop.eval_at_end:
            return  # after_train evaluates the final model once
        periodic = loop.eval_every_n_steps is not None and step % loop.eval_every_n_steps == 0
        if periodic or (loop.eval_at_epoch_end and trainer.epoch_ended):
            self._run(trainer)

    def after_train(self, trainer: Trainer) -> None:
        if trainer.cfg.loop.eval_at_end:
            self._run(trainer)

    @staticmethod
    def _run(trainer: Trainer) -> None:
        started = time.perf_counter()
        trainer.phase.enter("evaluation", step=trainer.step)
        metrics = {f"val/{k}": v for k, v in trainer.evaluate().items()}
        if not metrics:
            return
        trainer.final_metrics.update(metrics)
        trainer.writer.write(trainer.step, metrics)
        shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        logger.info("eval @ step %d: %s (%.1f s)", trainer.step, shown, time.perf_counter() - started)


class CheckpointHook(HookBase):
    """Save every ``checkpoint.every_n_steps`` and ``every_n_minutes`` (rank 0's clock, agreed by
    all ranks in the step's all-reduce), on SIGTERM, and at the end of training."""

    def after_step(self, trainer: Trainer) -> None:
        cfg = trainer.cfg.checkpoint
        periodic = cfg.every_n_steps is not None and trainer.step % cfg.every_n_steps == 0
        on_stop = trainer.stop_requested and cfg.save_on_exit
        if (periodic or trainer.checkpoint_due or on_stop) and trainer.step != trainer.last_checkpoint_step:
            trainer.save_checkpoint()

    def after_train(self, trainer: Trainer) -> None:
        if trainer.cfg.checkpoint.save_on_exit and trainer.step != trainer.last_checkpoint_step:
            trainer.save_checkpoint()


def _throughput_metrics(trainer: Trainer, samples_per_s: float) -> dict[str, float]:
    """Tokens/s for language models, model TFLOPs/s and MFU when FLOPs were counted, and the
    bytes one rank hands to the gradient collectives per step under the active comm hook."""
    out = {}
    if trainer.tokens_per_sample:
        out["perf/tokens_per_s"] = samples_per_s * trainer.tokens_per_sample
    if trainer.flops_per_sample:
        flops_per_s = samples_per_s * trainer.flops_per_sample
        out["perf/tflops_per_s"] = flops_per_s / 1e12
        if trainer.peak_tflops:
            out["perf/mfu"] = mfu(flops_per_s, trainer.peak_tflops, trainer.env.world_size)
    if trainer.comm is not None:
        out["comm/bytes_per_step"] = trainer.comm.bytes_per_step(trainer.step)
    return out


class MetricsHook(HookBase):
    """Training metrics every ``logging.log_every_n_steps`` (and at the last step), the progress
    bar, and the one-line summary at the end.

    All ranks take part: each log point gathers a few floats per rank in one collective (loss,
    throughput, step time, data wait, peak memory), so per-rank stragglers show in TensorBoard.
    Between log points the loss stays on the device, so the loop adds no host synchronisation.
    """

    def before_train(self, trainer: Trainer) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._loss_steps = 0
        self._started = time.perf_counter()
        self._bar = ProgressBar(total=trainer.total_steps, initial=trainer.step,
                                enabled=progress_enabled(trainer.cfg.logging.progress_bar,
                                                         is_main=trainer.env.is_main))

    def after_step(self, trainer: Trainer) -> None:
        if not trainer.last_step["nonfinite"]:  # a skipped step's NaN would poison the window
            loss = trainer.last_step["loss"]
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_steps += 1
        if trainer.is_log_step(trainer.step):
            self._log(trainer)
        else:
            self._bar.update(trainer.step)

    def _log(self, trainer: Trainer) -> None:
        window = trainer.meter.flush()
        local_loss = (self._loss_sum / self._loss_steps).item() if self._loss_steps else math.nan
        self._loss_sum, self._loss_steps = None, 0
        # metric_weight: only ranks whose loss counts (last pipeline stage) enter the mean.
        weight = trainer.metric_weight
        ranks = all_gather_floats(
            [local_loss * weight if weight else 0.0, weight, window["samples_per_s"], window["step_s"],
             window["data_wait_s"], window["fwd_bwd_s"], window["optimizer_s"], peak_memory_mb(trainer.env.device)],
            device=trainer.env.device)
        loss, weights, samples_per_s, step_s, data_wait_s, fwd_bwd_s, optimizer_s, peak_mb = ranks.unbind(dim=1)
        metrics = {
            "train/loss": (loss.sum() / weights.sum()).item(),
            "train/lr": trainer.scheduler.get_last_lr()[0],
            "train/epoch": trainer.epoch + trainer.epoch_sample / (trainer.steps_per_epoch
                                                                   * trainer.layout.global_batch_size),
            "perf/samples_per_s": samples_per_s.sum().item(),
            "perf/step_s": step_s.max().item(),
            "perf/data_wait_s": data_wait_s.max().item(),
            "perf/fwd_bwd_s": fwd_bwd_s.max().item(),
            "perf/optimizer_s": optimizer_s.max().item(),
            "perf/peak_memory_mb": peak_mb.max().item(),
        }
        metrics["train/grad_norm"] = trainer.last_step["grad_norm"].item()
        metrics.update(_throughput_metrics(trainer, metrics["perf/samples_per_s"]))
        if trainer.nonfinite_steps:
            metrics["train/nonfinite_steps"] = float(trainer.nonfinite_steps)
        if trainer.precision.scaling:
            metrics["train/loss_scale"] = trainer.precision.scaler.get_scale()
            metrics["train/skipped_steps"] = float(trainer.skipped_steps)
        for rank, value in enumerate(samples_per_s.tolist()):
            metrics[f"perf/samples_per_s_rank{rank}"] = value
        for rank, value in enumerate(step_s.tolist()):
            metrics[f"perf/step_s_rank{rank}"] = value
        trainer.final_metrics["train/loss"] = metrics["train/loss"]
        trainer.writer.write(trainer.step, metrics)
        self._bar.update(trainer.step, {"loss": f"{metrics['train/loss']:.4f}",
                                        "lr": f"{metrics['train/lr']:.3g}",
                                        "img/s": f"{metrics['perf/samples_per_s']:.1f}"})
        logger.info("step %d/%d  loss %.4f  lr %.4g  %.1f samples/s  step %.3f s  data %.3f s",
                    trainer.step, trainer.total_steps, metrics["train/loss"], metrics["train/lr"],
                    metrics["perf/samples_per_s"], metrics["perf/step_s"], metrics["perf/data_wait_s"])

    def after_train(self, trainer: Trainer) -> None:
        self._bar.close()
        meter = trainer.meter
        global_rate = (meter.total_samples / meter.total_seconds * trainer.env.world_size
                       if meter.total_seconds > 0 else 0.0)
        summary = {"summary/steps": float(meter.total_steps),
                   "summary/train_seconds": meter.total_seconds,
                   "summary/wall_seconds": time.perf_counter() - self._started,
                   "summary/samples_per_s": global_rate}
        trainer.final_metrics.update(summary)
        trainer.writer.write(trainer.step, summary)
        finals = "  ".join(f"{k} {v:.4g}" for k, v in trainer.final_metrics.items()
                           if k.startswith(("train/loss", "val/")))
        logger.info("done: %d steps in %.1f s  %.1f samples/s global  %s", meter.total_steps,
                    summary["summary/wall_seconds"], global_rate, finals)
