"""The server's Prometheus metrics, in a registry of the application's own (not
prometheus_client's global one): requests by route and status, latency, batch sizes, errors, the
queue and readiness (:class:`ServeMetrics`, counted by :class:`MetricsMiddleware`), and a language
model's decoding (:class:`EngineMetrics`). With ``workers`` > 1 each worker process counts its own.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ABORT_STEP_BUCKETS = (0, 1, 2, 4, 8, 16)


class EngineMetrics:
    """The engine's figures, named as vLLM's dashboards read them (``vllm:`` there,
    ``sdnet_serve_`` here)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.first_token = Histogram(
            "sdnet_serve_time_to_first_token_seconds",
            "From a request's arrival to its first generated token",
            buckets=FIRST_TOKEN_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "sdnet_serve_inter_token_latency_seconds",
            "Between two tokens of one request",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "sdnet_serve_prompt_tokens", "Prompt tokens prefilled", registry=registry
        )
        self.generation_tokens = Counter(
            "sdnet_serve_generation_tokens", "Tokens generated", registry=registry
        )
        self.steps = Counter(
            "sdnet_serve_decode_steps",
            "Decode steps (one token for every running request)",
            registry=registry,
        )
        self.finished = Counter(
            "sdnet_serve_requests_finished",
            "Requests that ended, by why: stop (a stop token or text), length, abort",
            ["finish_reason"],
            registry=registry,
        )
        self.abort_steps = Histogram(
            "sdnet_serve_request_abort_steps",
            "Decode steps between a request's abort (its client left) and its slot freed",
            buckets=ABORT_STEP_BUCKETS,
            registry=registry,
        )
        self.running = Gauge(
            "sdnet_serve_num_requests_running", "Requests in the decoding batch", registry=registry
        )
        self.waiting = Gauge(
            "sdnet_serve_num_requests_waiting",
            "Requests waiting to join the decoding batch",
            registry=registry,
        )
        self.kv_cache = Gauge(
            "sdnet_serve_kv_cache_usage_perc",
            "The KV cache's columns held (rows x longest sequence) over its most "
            "(max_batch_size x context), 0 to 1",
            registry=registry,
        )


class ServeMetrics:
    """The application's Prometheus metrics, in a registry of its own."""

    def __init__(self, max_batch_size: int) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sdnet_serve_requests",
            "HTTP requests answered, by route and status code",
            ["route", "status"],
            registry=self.registry,
        )
        self.errors = Counter(
            "sdnet_serve_errors",
            "Requests answered with an error: client (4xx) or server (5xx)",
            ["route", "kind"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "sdnet_serve_request_duration_seconds",
            "Time from a request's arrival to its response, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        buckets = sorted({2**i for i in range(max_batch_size.bit_length())} | {max_batch_size})
        self.batch_size = Histogram(
            "sdnet_serve_batch_size",
            "Requests per model batch",
            buckets=buckets,
            registry=self.registry,
        )
        self.queue = Gauge(
            "sdnet_serve_queue_depth", "Requests waiting for the model", registry=self.registry
        )
        self.ready = Gauge(
            "sdnet_serve_ready", "1 while the model takes requests", registry=self.registry
        )
        self.engine = EngineMetrics(self.registry)  # a language model's decoding

    def record(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)
        if status >= 400:
            self.errors.labels(route, "client" if status < 500 else "server").inc()


class MetricsMiddleware:
    """Counts every HTTP request with its final status and latency (limit refusals included)."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics, routes: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes  # the label of any other path is "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        started = time.perf_counter()
        status = 500  # unless a response starts: an exception that escapes becomes a 500

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            self.metrics.record(route, status, time.perf_counter() - started)
