"""The server's ``key=value`` arguments, checked before anything is loaded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from sdnet_trainer.config.arguments import parse_key_values
from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.errors import ConfigError

BACKENDS = ("torch", "onnx")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass
class ServeArgs:
    # A checkpoint (a step_NNNNNNNN/ folder, or a run's checkpoint directory: its newest valid
    # step) or a folder written by python -m sdnet_trainer.export (config.yaml + model.pt / .onnx).
    checkpoint: str = MISSING
    host: str = "127.0.0.1"
    # 0: any free port (the port taken is printed on start).
    port: int = 8000
    # torch: the PyTorch model; onnx: onnxruntime on the export folder's model.onnx (a checkpoint
    # is exported to ONNX in memory first).
    backend: str = "torch"
    # auto: cuda when there is a GPU, else cpu; or cpu | cuda | cuda:N.
    device: str = "auto"
    # Dynamic batching: requests arriving within max_wait_ms of the first run as one batch of at
    # most max_batch_size; max_batch_size=1 or max_wait_ms=0 runs every request by itself.
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    # A language model with a KV cache: requests join the decoding batch at the next step and
    # leave when they end (at most max_batch_size decode together); false: a batch forms, as
    # above, and runs until its last request ends before the next starts.
    continuous_batching: bool = True
    # The model's name in the OpenAI API (/v1/models, a request's "model"); null: checkpoint as
    # given.
    served_model_name: Optional[str] = None
    # Server processes, each with its own copy of the model (and its own /metrics).
    workers: int = 1
    # Requests with a larger body are refused with 413 (before the body is read when the client
    # sends Content-Length).
    max_body_mb: float = 16.0
    # Images with more pixels are refused with 413 before they are decoded (a PNG of one colour
    # is tiny in the body but 3 bytes a pixel decoded, more as floats while it is preprocessed).
    max_image_pixels: int = 16_000_000
    # Requests waiting for the model beyond this many are refused with 503 (shed load).
    max_queue: int = 1024
    # Classes an image prediction returns unless the request says (top_k).
    top_k: int = 5
    # The most tokens a language-model request may ask for (max_new_tokens).
    max_new_tokens: int = 512
    # The Trainer class (dotted path) whose build_model rebuilds the network, as for export;
    # null: sdnet_trainer.Trainer.
    trainer: Optional[str] = None
    # Serve the checkpoint's EMA weights (model.ema); needs a checkpoint that holds them.
    ema: bool = False
    log_level: str = "info"

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 1 and self.max_wait_ms > 0


def parse_args(argv: Sequence[str]) -> ServeArgs:
    """``key=value`` pairs onto ``ServeArgs``; an unknown key (named, with the closest known one),
    a value of the wrong type or out of range is a ConfigError."""
    args = parse_key_values(
        ServeArgs,
        argv,
        example="checkpoint=PATH port=8000",
        missing="checkpoint=PATH is required (a step_* folder, a run's checkpoints/ directory or "
        "an export folder)",
    )
    validate_serve_args(args)
    return args


def validate_serve_args(args: ServeArgs) -> None:
    check_choice("backend", args.backend, BACKENDS)
    check_choice("log_level", args.log_level, LOG_LEVELS)
    device = args.device
    if device not in ("auto", "cpu", "cuda") and not (
        device.startswith("cuda:") and device[5:].isdigit()
    ):
        raise ConfigError(f"device={device!r}: choose auto, cpu, cuda or cuda:N")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"port={args.port} must be in 0..65535 (0: any free port)")
    minimum = {
        "max_batch_size": 1,
        "workers": 1,
        "max_image_pixels": 1,
        "max_queue": 1,
        "top_k": 1,
        "max_new_tokens": 1,
    }
    for key, least in minimum.items():
        if getattr(args, key) < least:
            raise ConfigError(f"{key}={getattr(args, key)} must be >= {least}")
    if args.max_wait_ms < 0:
        raise ConfigError(f"max_wait_ms={args.max_wait_ms} must be >= 0 (0: no batching)")
    if not args.max_body_mb > 0:
        raise ConfigError(f"max_body_mb={args.max_body_mb} must be > 0")
