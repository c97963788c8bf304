"""Typed schemas of ``logging.*``: the trackers (MLflow, W&B), the Prometheus exporter and the
metrics' own settings, kept beside ``schema.py``, whose ``Config`` includes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class PrometheusConfig:
    # Every rank serves its metrics at http://HOST:(port + local rank)/metrics while training;
    # null: off.
    port: Optional[int] = None
    host: str = "0.0.0.0"  # the address served on; needs port
    # A Prometheus Pushgateway URL to push to at every log point instead, for jobs that cannot be
    # scraped; null: off.
    pushgateway: Optional[str] = None


@dataclass
class MLflowConfig:
    # A folder (MLflow's file store; all the mlflow extra needs): by default one per run.root,
    # shared by its runs, so a run resumed in another run directory continues its MLflow run.
    # MLflow 3 asks for MLFLOW_ALLOW_FILE_STORE=true to use it, which the run sets for itself;
    # to browse it: MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri outputs/mlruns.
    # Or a server, http(s)://HOST:PORT; a database (sqlite:///...) needs `pip install mlflow`.
    # Every key of logging.mlflow needs mlflow in logging.trackers (logging.wandb: wandb).
    tracking_uri: str = "${run.root}/mlruns"
    experiment: str = "sdnet_trainer"
    # null: run.name
    run_name: Optional[str] = None


@dataclass
class WandbConfig:
    project: str = "sdnet_trainer"  # needs wandb in logging.trackers, as every key here
    entity: Optional[str] = None
    # null: online when WANDB_API_KEY is set, else offline; or online | offline | disabled.
    mode: Optional[str] = None


@dataclass
class LoggingConfig:
    log_every_n_steps: int = 10
    # Where rank 0 logs the scalars, the resolved config and the final summary: any of
    # tensorboard, jsonl (metrics.jsonl), csv (metrics.csv), mlflow, wandb. A resumed run
    # continues the same MLflow / W&B run (its id is kept in the checkpoint).
    trackers: List[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    # auto: a progress bar on rank 0 only when stderr is a terminal; on / off force it.
    progress_bar: str = "auto"
    level: str = "INFO"
    # Count model FLOPs per step (torch.utils.flop_counter, once at the start) and log MFU
    # against peak_tflops (null: looked up for known GPUs; unknown devices log no MFU).
    flops: bool = True
    peak_tflops: Optional[float] = None
    # Every rank's step time and samples/s as keys of their own (perf/step_s_rank{R}, ...) at each
    # log point: 2 keys per rank. Off: their spread over the ranks (min, median, max) and the
    # slowest rank's index, whatever the world size; each rank's Prometheus gauges either way.
    per_rank_metrics: bool = False
