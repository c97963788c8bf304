"""Serve a checkpoint or an export folder over HTTP.

    python -m sdnet_trainer.serve checkpoint=outputs/quickstart/RUN/checkpoints
    python -m sdnet_trainer.serve checkpoint=RUN/checkpoints/step_00000300/export backend=onnx

The model is rebuilt the way ``python -m sdnet_trainer.export`` rebuilds it, so a checkpoint of
any parallel layout serves; images get the evaluation preprocessing of the data it was trained
on. The API (its OpenAPI page is /docs):

    POST /v1/predict   image models: a PNG/JPEG as multipart (field ``file``) or base64 JSON
                       ({"image": ...}), or {"tensor": [...]}; returns the top-k classes.
                       language models: {"prompt": "text" or [ids], "max_new_tokens": 32,
                       "temperature": 0, "top_p": 1, "stop": [ids], "seed": 0}; returns the
                       continuation.
    GET  /v1/model     what the model takes and returns
    GET  /healthz      alive;   GET /readyz   the model is loaded and takes requests
    GET  /metrics      Prometheus: requests, latency, batch sizes, errors

Arguments, as ``key=value``:

    checkpoint=PATH      a step_NNNNNNNN/ folder, a run's checkpoints/ directory (its newest valid
                         step), an export folder (config.yaml + model.pt / model.onnx), or a
                         transformers model folder (config.json + safetensors; the llm extra)
    host=127.0.0.1       port=8000 (0: any free port; the one taken is printed)
    backend=torch        torch | onnx (onnxruntime; a checkpoint is exported in memory first)
    device=auto          auto | cpu | cuda | cuda:N
    max_batch_size=32    max_wait_ms=5   requests arriving within max_wait_ms of the first run as
                         one batch; max_batch_size=1 or max_wait_ms=0: no batching
    workers=1            server processes, each with its own model and /metrics
    max_body_mb=16       larger request bodies get 413
    max_image_pixels=16000000   larger images get 413 before they are decoded
    max_queue=1024       requests waiting beyond this get 503
    top_k=5              classes returned unless the request says
    max_new_tokens=512   the most tokens one request may ask for
    trainer=DOTTED       the Trainer class that rebuilds the model (as export's trainer=)
    ema=false            serve the checkpoint's EMA weights
    log_level=info

Exit codes: 0 stopped (SIGINT / SIGTERM); 2 bad arguments or a checkpoint that cannot be served
(the message names the key and path), also when a worker process cannot load it; 1 the model
cannot be exported to ONNX for backend=onnx. With workers > 1 the model is loaded once on the
CPU before the workers start, so that these exit at once.
Needs the ``serve`` extra: pip install 'sdnet_trainer[serve]'.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from typing import Any

from sdnet_trainer.errors import ConfigError

logger = logging.getLogger("sdnet_trainer.serve")

EXIT_BAD_INPUT = 2
EXIT_EXPORT_FAILED = 1
EXTRA_HINT = "pip install 'sdnet_trainer[serve]'"
# The arguments, as JSON, for the worker processes of workers > 1 (see app_from_env).
ARGS_ENV = "SDNET_SERVE_ARGS"
# How long uvicorn's supervisor waits for a worker process to answer its health check before it
# kills and replaces it. A worker answers from a thread, which cannot while the process imports
# torch (loading its native libraries holds the interpreter's lock): uvicorn's 5 s, on a busy
# machine, kills each worker before it has started, and its replacement too. Gunicorn's worker
# timeout, for comparison, is 30 s.
WORKER_HEALTHCHECK_S = 30
# The serve extra's modules, by import name (python-multipart is python_multipart, formerly
# multipart).
_REQUIRED = (("fastapi",), ("uvicorn",), ("prometheus_client",), ("python_multipart", "multipart"))


def require_serve_extra() -> None:
    for names in _REQUIRED:
        if not any(importlib.util.find_spec(name) is not None for name in names):
            raise ConfigError(
                f"serving needs the Python module {names[0]!r}, which is not installed: "
                f"{EXTRA_HINT}"
            )


def build_app(args: Any) -> Any:
    """Load the model named by ``args`` and return the application serving it."""
    from sdnet_trainer.serve.app import create_app
    from sdnet_trainer.serve.model import load_served

    model, source = load_served(args)
    return create_app(model, args, source=source)


def app_from_env() -> Any:
    """The application of a worker process (workers > 1): uvicorn starts each worker by
    importing this factory; the arguments come from the parent in ARGS_ENV. A model the worker
    cannot load exits with uvicorn's STARTUP_FAILURE: its supervisor restarts a worker that dies
    of anything else, forever, but stops the server on that one (serve() then exits 2)."""
    from uvicorn.config import STARTUP_FAILURE

    from sdnet_trainer.export import ExportError
    from sdnet_trainer.serve.args import ServeArgs, validate_serve_args

    try:
        args = ServeArgs(**json.loads(os.environ[ARGS_ENV]))
        validate_serve_args(args)
        _configure_logging(args.log_level)
        return build_app(args)
    except (ConfigError, ExportError) as err:
        print(f"serve error: worker process {os.getpid()}: {err}", file=sys.stderr, flush=True)
        # At once, as multiprocessing ends its children, without the interpreter's teardown
        # (seconds with torch loaded): the supervisor sees the death (_supervisor_class).
        os._exit(STARTUP_FAILURE)


def check_loads(args: Any) -> None:
    """Load the model of ``args`` once, on the CPU, and drop it: a model that cannot be served is
    then a ConfigError (ExportError) here, before any worker process starts. The device is
    checked, not used: a CUDA context made here would stay with the parent for its lifetime."""
    from sdnet_trainer.serve.model import load_served, serving_device

    serving_device(args.device)
    load_served(replace(args, device="cpu"))


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0: a free port), shared by every worker."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Nagle's algorithm off, for the connections accepted too (Linux passes the option on): with
    # it, a response's body write waits for the client's delayed ACK of its header write, 40 ms
    # per request on a keep-alive connection. asyncio turns it off by itself only on sockets it
    # recognises as TCP; set here, it holds however a worker process gets the socket.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"host={host} port={port}: cannot listen there: {err.strerror}") from None
    sock.set_inheritable(True)
    return sock


def serve(argv: Sequence[str]) -> int:
    require_serve_extra()
    import uvicorn

    from sdnet_trainer.serve.args import parse_args

    args = parse_args(argv)
    _configure_logging(args.log_level)
    options: dict[str, Any] = dict(
        log_level=args.log_level, access_log=False, timeout_graceful_shutdown=10
    )
    if args.workers == 1:
        app = build_app(args)
    else:
        # Every worker loads the model itself; the parent loads it first so that one that
        # cannot be served exits 2 (1) at once, with its message, rather than in every worker.
        check_loads(args)
        os.environ[ARGS_ENV] = json.dumps(asdict(args))
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    print(f"sdnet_trainer.serve: listening on http://{url_host}:{port} (docs: /docs)", flush=True)
    try:
        with _stopped_by_signals():
            if args.workers == 1:
                uvicorn.Server(uvicorn.Config(app, **options)).run(sockets=[sock])
            else:
                _supervise(args.workers, sock, options)
    except _Stop:
        pass
    return 0


def _supervise(workers: int, sock: socket.socket, options: dict[str, Any]) -> None:
    """Run ``workers`` server processes on ``sock`` under uvicorn's supervisor, as uvicorn.run
    does, until a stop signal, or a worker that could not start: a ConfigError then (exit 2),
    where uvicorn.run would return as after a stop (a worker that cannot load the model exits
    with STARTUP_FAILURE: app_from_env)."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    config = uvicorn.Config(
        "sdnet_trainer.serve.cli:app_from_env",
        factory=True,
        workers=workers,
        timeout_worker_healthcheck=WORKER_HEALTHCHECK_S,
        **options,
    )
    # The workers share the parent's socket (spawned processes get it pickled).
    supervisor = _supervisor_class()(config, sockets=[sock])
    supervisor.run()
    # The supervisor keeps a worker that failed to start in its list (it restarts any other).
    if any(process.exitcode == STARTUP_FAILURE for process in supervisor.processes):
        raise ConfigError("a worker process could not start: its message is above")


def _supervisor_class() -> type:
    from uvicorn.supervisors import Multiprocess

    class Supervisor(Multiprocess):
        """uvicorn's supervisor, told of a worker's death while it waits for its reply.

        The supervisor pings each live worker over a pipe and waits up to the health-check
        timeout for the reply. It keeps its own copy of the worker's end of that pipe, so a
        worker that dies with a ping unanswered (it exits, or is still tearing down its memory
        when it is pinged) leaves it waiting the whole timeout. Each worker has its end from its
        start (the spawn passes it): closed here, before the worker's first ping, the death
        reads as end-of-file at once and the supervisor goes on."""

        def keep_subprocess_alive(self) -> None:
            for process in self.processes:  # started since the last round too (restarts)
                process.child_conn.close()  # closing a closed end does nothing
            super().keep_subprocess_alive()

    return Supervisor


class _Stop(Exception):
    """SIGTERM or SIGINT, after uvicorn has shut the server down."""


@contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again with the
    handlers it found: these make that a normal stop (exit 0), not death by signal (SIGTERM)
    or a KeyboardInterrupt traceback (SIGINT)."""

    def stop(signum: int, frame: object) -> None:
        raise _Stop

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _configure_logging(level: str) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="[%(name)s][%(levelname)s] %(message)s")
    logging.getLogger("sdnet_trainer").setLevel(level.upper())


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sdnet_trainer.serve key=value ...``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        return 0
    from sdnet_trainer.export import ExportError

    try:
        return serve(argv)
    except ConfigError as err:
        print(f"serve error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ExportError as err:
        print(f"serve error: backend=onnx: {err}", file=sys.stderr)
        return EXIT_EXPORT_FAILED
