"""What the Prometheus exporter (``observability/prometheus.py``) names each logged key: the metric
families it defines with their help texts, the logged keys that map onto them, and the spelling of
any other key's abbreviated units as Prometheus names them (``_seconds``, ``_per_second``,
``_bytes``: promtool's lint rejects ``_s``, ``_ms``, ``_mb``). Data, apart from the exporter's
mechanics, so that dashboards and tests read the names without the exporter's machinery.
"""

from __future__ import annotations

from dataclasses import dataclass

MB = 2**20


@dataclass(frozen=True)
class Series:
    """Where one logged key goes: metric ``name`` with extra ``labels``, value times ``scale``
    (to the metric's base unit)."""

    name: str
    scale: float = 1.0
    labels: tuple[tuple[str, str], ...] = ()


# Every metric the exporter itself defines: name -> help.
FAMILIES = {
    # Progress
    "sdnet_step": "Optimizer step of the latest training log point.",
    "sdnet_log_timestamp_seconds": "Unix time of the latest training log point.",
    "sdnet_world_size": "Ranks in the run.",
    "sdnet_train_epoch": "Epochs done (fractional) at the latest log point.",
    # Optimization
    "sdnet_train_loss": "Mean training loss over the steps since the previous log point.",
    "sdnet_train_learning_rate": "Learning rate at the latest log point.",
    "sdnet_train_grad_norm": "Global gradient norm of the step at the latest log point.",
    "sdnet_train_loss_scale": "Scale of the fp16 gradient scaler.",
    "sdnet_train_nonfinite_steps": "Steps with a non-finite loss or gradient, whole run.",
    "sdnet_train_skipped_steps": "Optimizer steps the fp16 gradient scaler skipped, whole run.",
    "sdnet_data_skipped_samples": "Training samples replaced because they could not be read.",
    # Throughput
    "sdnet_samples_per_second": "Training samples per second of the log window, all ranks.",
    "sdnet_tokens_per_second": "Training tokens per second of the log window, all ranks.",
    "sdnet_model_flops_per_second": "Model FLOPs per second of the log window, all ranks.",
    "sdnet_mfu_ratio": "Model FLOPs utilization: achieved over peak FLOPs of all devices.",
    # Step time
    "sdnet_step_seconds": "Mean time per training step in the log window, slowest rank.",
    "sdnet_step_phase_seconds": (
        "Mean time per step spent in each phase of the step in the log window, slowest rank."
    ),
    "sdnet_rank_step_seconds": "Mean time per training step in the log window, this rank.",
    "sdnet_rank_samples_per_second": "Training samples per second of the log window, this rank.",
    # The ranks' spread (perf/rank_step_s_*, perf/rank_samples_per_s_*): bounded at any world size
    **{
        f"sdnet_perf_rank_step_seconds_{stat}": f"The {stat} over ranks of their mean step time."
        for stat in ("min", "median", "max")
    },
    **{
        f"sdnet_perf_rank_samples_per_second_{stat}": (
            f"The {stat} over ranks of their training samples per second."
        )
        for stat in ("min", "median", "max")
    },
    "sdnet_perf_slowest_rank": "Index of the rank with the longest mean step time.",
    # Memory
    "sdnet_memory_peak_bytes": (
        "Peak memory in the log window, largest rank: allocated CUDA memory, or on the CPU the "
        "process's lifetime peak resident size."
    ),
    "sdnet_memory_reserved_bytes": (
        "Memory held in the log window, largest rank: the CUDA caching allocator's peak, or on "
        "the CPU the resident size at the log point."
    ),
    "sdnet_cuda_alloc_retries": "cudaMalloc calls retried after freeing the cache, log window.",
    # Communication
    "sdnet_comm_step_bytes": "Bytes one rank hands to the gradient collectives per step.",
    # Evaluation
    "sdnet_eval_metric": "Latest evaluation result, by metric name.",
    "sdnet_eval_step": "Optimizer step of the latest evaluation.",
    # Checkpoints
    "sdnet_checkpoint_save_seconds": "Time the latest checkpoint save held up training.",
    "sdnet_checkpoint_size_bytes": "Bytes this rank wrote for the latest checkpoint.",
    "sdnet_checkpoint_last_step": "Optimizer step of the latest checkpoint.",
    "sdnet_checkpoint_last_timestamp_seconds": "Unix time of the latest checkpoint save.",
    # Fault tolerance across replica groups (ft/*, sdnet_trainer/ft/)
    "sdnet_ft_quorum_groups": "Replica groups in the latest fault-tolerance quorum.",
    "sdnet_ft_in_quorum": "1 while the replica group (label group) is in the quorum, else 0.",
    "sdnet_ft_recoveries": "Times this group received the live state from a peer, this launch.",
    "sdnet_ft_recovery_seconds": "Seconds this group spent receiving state from peers.",
    "sdnet_ft_degraded_steps": "Steps committed with fewer groups than expected, this launch.",
    "sdnet_ft_skipped_steps": "Steps discarded by the commit vote (a peer failed), this launch.",
    "sdnet_ft_committed_steps": "Steps the replica groups committed, whole run.",
    # A mixture of experts' load (training/moe.py), per layer (and expert) as labels
    "sdnet_moe_aux_loss": "Auxiliary load-balancing loss of the last step (all layers).",
    "sdnet_moe_expert_tokens": "Tokens routed to an expert in the last step.",
    "sdnet_moe_tokens_min": "Fewest tokens an expert of the layer received in the last step.",
    "sdnet_moe_tokens_max": "Most tokens an expert of the layer received in the last step.",
    "sdnet_moe_load_min_max": "Fewest over most tokens of the layer's experts (1: balanced).",
    # End of run (summary/*; "summary" in a name would read as Prometheus' summary type)
    "sdnet_run_steps": "Steps trained by this launch, set at its end.",
    "sdnet_run_train_seconds": "Time spent in training steps by this launch, set at its end.",
    "sdnet_run_wall_seconds": "Wall-clock time of this launch's training loop, set at its end.",
    "sdnet_run_samples_per_second": "Training samples per second over the launch, set at its end.",
}

# Logged key -> series. The keys are those of sdnet_trainer.training.hooks.MetricsHook (log points),
# EvalHook (val/*), the checkpointer (checkpoint/*) and the end-of-run summary.
KEYS = {
    "train/loss": Series("sdnet_train_loss"),
    "train/lr": Series("sdnet_train_learning_rate"),
    "train/grad_norm": Series("sdnet_train_grad_norm"),
    "train/epoch": Series("sdnet_train_epoch"),
    "train/loss_scale": Series("sdnet_train_loss_scale"),
    "train/nonfinite_steps": Series("sdnet_train_nonfinite_steps"),
    "train/skipped_steps": Series("sdnet_train_skipped_steps"),
    "data/skipped_samples": Series("sdnet_data_skipped_samples"),
    "perf/samples_per_s": Series("sdnet_samples_per_second"),
    "perf/tokens_per_s": Series("sdnet_tokens_per_second"),
    "perf/tflops_per_s": Series("sdnet_model_flops_per_second", scale=1e12),
    "perf/mfu": Series("sdnet_mfu_ratio"),
    "perf/step_s": Series("sdnet_step_seconds"),
    "perf/data_wait_s": Series("sdnet_step_phase_seconds", labels=(("phase", "data_wait"),)),
    "perf/fwd_bwd_s": Series("sdnet_step_phase_seconds", labels=(("phase", "forward_backward"),)),
    "perf/optimizer_s": Series("sdnet_step_phase_seconds", labels=(("phase", "optimizer"),)),
    "perf/peak_memory_mb": Series("sdnet_memory_peak_bytes", scale=MB),
    "perf/reserved_memory_mb": Series("sdnet_memory_reserved_bytes", scale=MB),
    "perf/alloc_retries": Series("sdnet_cuda_alloc_retries"),
    "comm/bytes_per_step": Series("sdnet_comm_step_bytes"),
    "checkpoint/save_seconds": Series("sdnet_checkpoint_save_seconds"),
    "checkpoint/bytes": Series("sdnet_checkpoint_size_bytes"),
    "checkpoint/step": Series("sdnet_checkpoint_last_step"),
    "ft/quorum_size": Series("sdnet_ft_quorum_groups"),
    "ft/recoveries": Series("sdnet_ft_recoveries"),
    "ft/recovery_seconds": Series("sdnet_ft_recovery_seconds"),
    "ft/degraded_steps": Series("sdnet_ft_degraded_steps"),
    "ft/skipped_steps": Series("sdnet_ft_skipped_steps"),
    "ft/committed_steps": Series("sdnet_ft_committed_steps"),
    "moe/aux_loss": Series("sdnet_moe_aux_loss"),
    "summary/steps": Series("sdnet_run_steps"),
    "summary/train_seconds": Series("sdnet_run_train_seconds"),
    "summary/wall_seconds": Series("sdnet_run_wall_seconds"),
    "summary/samples_per_s": Series("sdnet_run_samples_per_second"),
    **{
        f"perf/rank_{unit}_{stat}": Series(f"sdnet_perf_rank_{spelt}_{stat}")
        for unit, spelt in (("step_s", "step_seconds"), ("samples_per_s", "samples_per_second"))
        for stat in ("min", "median", "max")
    },
    "perf/slowest_rank": Series("sdnet_perf_slowest_rank"),
}
# Abbreviated units in a logged key's words, spelt as Prometheus names them (promtool's lint
# rejects "_s", "_ms", "_mb" ...): word -> (spelling, scale to the base unit).
UNIT_WORDS = {"s": ("seconds", 1.0), "ms": ("seconds", 1e-3), "mb": ("bytes", float(MB))}
# The gathered per-rank keys (``perf/step_s_rank{R}``): base -> metric, published by rank R.
PER_RANK = {
    "perf/step_s": "sdnet_rank_step_seconds",
    "perf/samples_per_s": "sdnet_rank_samples_per_second",
}


def spell_units(name: str) -> tuple[str, float]:
    """``name`` with its abbreviated units spelt out (``step_s`` -> ``step_seconds``,
    ``samples_per_s`` -> ``samples_per_second``), and the scale to the spelt unit."""
    words = name.split("_")
    scale = 1.0
    for i, word in enumerate(words):
        if word.lower() in UNIT_WORDS:
            spelt, factor = UNIT_WORDS[word.lower()]
            after_per = i > 0 and words[i - 1] == "per"
            words[i] = spelt.removesuffix("s") if after_per else spelt
            scale = scale / factor if after_per else scale * factor
    return "_".join(words), scale


def metric_names() -> set[str]:
    """Every metric name the exporter can emit with the stock keys (hardware included; the GPU
    ones only on CUDA with NVML): what dashboards may refer to."""
    from sdnet_trainer.observability.hardware import GPU_METRICS, HARDWARE_METRICS

    return set(FAMILIES) | set(HARDWARE_METRICS) | set(GPU_METRICS)


__all__ = [
    "FAMILIES",
    "KEYS",
    "MB",
    "PER_RANK",
    "UNIT_WORDS",
    "Series",
    "metric_names",
    "spell_units",
]
