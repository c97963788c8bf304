"""Live training metrics for Prometheus (``logging.prometheus``).

Every rank serves ``/metrics`` on ``port + local rank`` while it trains, and/or pushes to a
Pushgateway for jobs that cannot be scraped. The exporter is one more metrics writer: the loop
hands it, on every rank, the same gathered figures it hands ``metrics.jsonl`` (at log points,
evaluations, checkpoint saves and the end), so what Prometheus stores is what the run logged.

Scraping costs the training loop nothing: ``write`` turns the figures into finished metric
families once per log point and swaps them in whole; a scrape (on the HTTP server's own thread)
only formats that snapshot, so it never reads the device, /proc or NVML, and never sees half of
one log point beside half of the next.

Names follow Prometheus' conventions: prefix ``sdnet_``, base units with a unit suffix (seconds,
bytes, ratio), gauges throughout (each value is a reading of the run at the log point, not a
counter Prometheus should ``rate``). Every series carries the run's identity as labels: ``run``
(run.name), ``run_id``, ``rank`` and ``node``. The table :data:`KEYS` maps each logged key to
its series; ``val/NAME`` becomes ``sdnet_eval_metric{name="NAME"}``; the gathered per-rank keys
(``perf/step_s_rank{R}``) become one gauge per rank, each published by its own rank, so
``sdnet_rank_step_seconds`` by ``rank`` compares the ranks (the straggler panel); any other key
becomes ``sdnet_`` + the key with ``/`` as ``_`` (``summary/`` as ``run_``). Besides the logged
figures: the step and time of the latest log point, evaluation and checkpoint (the checkpoint's
age), the world size, and this rank's process, host and GPU figures.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import torch

from sdnet_trainer.config.observability import PrometheusConfig
from sdnet_trainer.config.schema import Config
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.observability.metric_names import (
    FAMILIES,
    KEYS,
    PER_RANK,
    Series,
    metric_names,
    spell_units,
)

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from sdnet_trainer.observability.hardware import HardwareSampler

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'sdnet_trainer[monitor]'"
PUSH_JOB = "sdnet_trainer"
# A push that takes longer is abandoned and retried at the next log point; it runs on a thread
# of its own, so a slow gateway never holds up training.
PUSH_TIMEOUT_S = 10.0
# The run's identity, on every series.
IDENTITY = ("run", "run_id", "rank", "node")
EVAL_PREFIX = "val/"
SUMMARY_PREFIX = "summary/"
_PER_RANK_KEY = re.compile(r"^(?P<base>.+)_rank(?P<rank>\d+)$")
_FT_GROUP_KEY = re.compile(r"^ft/in_quorum/group(?P<group>\d+)$")  # one gauge per group
_MOE_KEY = re.compile(r"^moe/layer(?P<layer>\d+)/(?:expert(?P<expert>\d+)/)?(?P<what>\w+)$")
_NOT_IN_NAME = re.compile(r"[^a-zA-Z0-9_]")
# A write with one of these keys is a training log point (it moves sdnet_step).
_LOG_POINT_PREFIXES = ("train/", "perf/")


def prometheus_enabled(cfg: PrometheusConfig) -> bool:
    return cfg.port is not None or bool(cfg.pushgateway)


# ---------------------------------------------------------------------- validation


def validate_prometheus(cfg: Config) -> None:
    """``logging.prometheus.*``, checked before launch: every rank's port (``port + local rank``,
    torchrun's LOCAL_WORLD_SIZE ranks on this node) in 1..65535, a Pushgateway URL of the form
    http(s)://HOST[:PORT][/PATH], and the packages installed."""
    prom = cfg.logging.prometheus
    if not prometheus_enabled(prom):
        return
    if prom.port is not None:
        local_ranks = _local_world_size()
        last = prom.port + local_ranks - 1
        if prom.port < 1 or last > 65535:
            raise ConfigError(
                f"logging.prometheus.port={prom.port}: the {local_ranks} rank(s) of this node "
                f"serve on ports {prom.port}..{last}, which must lie in 1..65535"
            )
        if not prom.host:
            raise ConfigError(
                "logging.prometheus.host is empty: name the address to serve /metrics on "
                "(0.0.0.0: every interface, 127.0.0.1: this machine only)"
            )
    if prom.pushgateway:
        _check_pushgateway_url(prom.pushgateway)
    _require_packages()


def _local_world_size() -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        return max(int(value), 1)
    except ValueError:
        raise ConfigError(f"LOCAL_WORLD_SIZE={value!r} is not an integer") from None


def _check_pushgateway_url(url: str) -> None:
    shape = "http(s)://HOST[:PORT][/PATH], e.g. http://pushgateway:9091"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError when out of range or not a number
    except ValueError as error:
        raise ConfigError(
            f"logging.prometheus.pushgateway={url!r} is not a URL ({error}); expected {shape}"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"logging.prometheus.pushgateway={url!r}: expected {shape}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(
            f"logging.prometheus.pushgateway={url!r}: expected {shape}, without query, fragment "
            "or credentials"
        )
    if port == 0:
        raise ConfigError(f"logging.prometheus.pushgateway={url!r}: port 0 cannot be reached")


def _require_packages() -> None:
    """prometheus_client and psutil (sdnet_trainer[monitor]); NVML is optional."""
    missing = [m for m in ("prometheus_client", "psutil") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"logging.prometheus needs {' and '.join(missing)}, which this environment lacks: "
            f"{INSTALL_HINT}"
        )


# ---------------------------------------------------------------------- the exporter


class PrometheusExporter:
    """Serves (``cfg.port``) and/or pushes (``cfg.pushgateway``) this rank's metrics.

    ``write(step, metrics)`` at every log point, evaluation, checkpoint save and at the end, on
    every rank, with the gathered figures; ``close()`` frees the port (idempotent). Hardware
    figures (:mod:`sdnet_trainer.observability.hardware`) are sampled at each write.
    """

    def __init__(
        self,
        cfg: PrometheusConfig,
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        run_name: str,
        run_id: str,
        node: str,
        device: torch.device,
    ) -> None:
        _require_packages()
        from prometheus_client import CollectorRegistry

        from sdnet_trainer.observability.hardware import (
            GPU_METRICS,
            HARDWARE_METRICS,
            HardwareSampler,
        )

        self.rank = rank
        self._identity = (run_name, run_id, str(rank), node)
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._help = {**FAMILIES, **HARDWARE_METRICS, **GPU_METRICS}
        self._resolved: dict[str, Series | None] = {}
        self._hardware: HardwareSampler | None = HardwareSampler(device)
        self._snapshot = _Snapshot()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self._snapshot)
        self._values[("sdnet_world_size", ())] = float(world_size)
        self._publish()  # a scrape before the first log point sees the run and its host
        self._server: Any = None
        self._server_thread: threading.Thread | None = None
        self._pusher: _Pusher | None = None
        self.port: int | None = None
        if cfg.port is not None:
            self._serve(cfg.host, cfg.port + local_rank)
        if cfg.pushgateway:
            grouping = {"run": run_name, "run_id": run_id, "rank": str(rank)}
            self._pusher = _Pusher(cfg.pushgateway, grouping, self.registry)

    def _serve(self, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        try:
            self._server, self._server_thread = start_http_server(
                port, addr=host, registry=self.registry
            )
        except OSError as error:
            self.close()
            raise ConfigError(
                f"logging.prometheus.port: rank {self.rank} cannot serve /metrics on "
                f"{host}:{port} ({error.strerror or error}); the ranks of a node use the "
                "ports from logging.prometheus.port on, one each: choose a free range"
            ) from None
        self.port = self._server.server_port
        logger.info("Prometheus metrics of rank %d at http://%s:%d/metrics", self.rank, host, port)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        now = time.time()
        values = self._values
        for key, value in metrics.items():
            series = self._series(key)
            if series is None or not isinstance(value, (int, float)):
                continue  # another rank's figure, a name taken, or no number (a subclass's text)
            values[(series.name, series.labels)] = float(value) * series.scale
        if any(key.startswith(_LOG_POINT_PREFIXES) for key in metrics):
            values[("sdnet_step", ())] = float(step)
            values[("sdnet_log_timestamp_seconds", ())] = now
            # Logged only once non-zero; until then the run has had none.
            values.setdefault(("sdnet_train_nonfinite_steps", ()), 0.0)
        if any(key.startswith(EVAL_PREFIX) for key in metrics):
            values[("sdnet_eval_step", ())] = float(step)
        if "checkpoint/step" in metrics:
            values[("sdnet_checkpoint_last_timestamp_seconds", ())] = now
        self._publish()
        if self._pusher is not None:
            self._pusher.request()

    def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.shutdown()
            server.server_close()
            if self._server_thread is not None:
                self._server_thread.join(timeout=5)
        if self._pusher is not None:
            pusher, self._pusher = self._pusher, None
            pusher.close()  # one last push: the summary reaches the gateway
        if self._hardware is not None:
            self._hardware.close()
            self._hardware = None

    # ------------------------------------------------------------------ keys to series

    def _series(self, key: str) -> Series | None:
        if key not in self._resolved:
            self._resolved[key] = self._resolve(key)
        return self._resolved[key]

    def _resolve(self, key: str) -> Series | None:
        if key in KEYS:
            return KEYS[key]
        if key.startswith(EVAL_PREFIX):
            return Series("sdnet_eval_metric", labels=(("name", key[len(EVAL_PREFIX) :]),))
        if group := _FT_GROUP_KEY.match(key):
            return Series("sdnet_ft_in_quorum", labels=(("group", group["group"]),))
        if moe := _MOE_KEY.match(key):  # the layer (and the expert) as labels
            name = "sdnet_moe_expert_tokens" if moe["expert"] else f"sdnet_moe_{moe['what']}"
            labels = (("layer", moe["layer"]), ("expert", moe["expert"]))
            if name in FAMILIES:
                return Series(name, labels=labels if moe["expert"] else labels[:1])
        per_rank = _PER_RANK_KEY.match(key)
        if per_rank is not None:
            if int(per_rank["rank"]) != self.rank:
                return None  # rank R publishes its own
            if per_rank["base"] in PER_RANK:
                return Series(PER_RANK[per_rank["base"]])
            name, scale = spell_units("sdnet_rank_" + _NOT_IN_NAME.sub("_", per_rank["base"]))
        else:
            spelt = key
            if key.startswith(SUMMARY_PREFIX):  # "summary" in a name reads as the metric type
                spelt = "run/" + key[len(SUMMARY_PREFIX) :]
            name, scale = spell_units("sdnet_" + _NOT_IN_NAME.sub("_", spelt))
        if name in self._help:  # a metric of the table, or of another key spelt alike
            logger.warning("metric %r would be exported as %s, which is taken: left out", key, name)
            return None
        self._help[name] = f"Logged as {key}."
        return Series(name, scale=scale)

    # ------------------------------------------------------------------ publishing

    def _publish(self) -> None:
        """Sample the hardware, build every family from the values and swap them in whole."""
        from prometheus_client.core import GaugeMetricFamily

        values = dict(self._values)
        if self._hardware is not None:
            for reading in self._hardware.sample():
                values[(reading.name, tuple(reading.labels.items()))] = reading.value
        grouped: dict[str, list[tuple[tuple[tuple[str, str], ...], float]]] = {}
        for (name, labels), value in values.items():
            grouped.setdefault(name, []).append((labels, value))
        families: list[Metric] = []
        for name in sorted(grouped):
            samples = grouped[name]
            extra = [label for label, _ in samples[0][0]]
            family = GaugeMetricFamily(name, self._help[name], labels=[*IDENTITY, *extra])
            for labels, value in sorted(samples, key=lambda s: s[0]):
                family.add_metric([*self._identity, *(v for _, v in labels)], value)
            families.append(family)
        self._snapshot.families = families


class _Snapshot:
    """The registry's one collector: the families of the latest write, as built. Rebinding the
    list is atomic, so a scrape sees one write or the next, never a mix."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> list[Metric]:
        return self.families

    def describe(self) -> list[Metric]:
        return []  # names appear as keys are logged: nothing to check at registration


class _Pusher:
    """Pushes the registry to a Pushgateway on a thread of its own whenever asked; the latest
    request wins (a slow gateway skips intermediate log points rather than queueing them). The
    group (job, run, run_id, rank) is replaced at each push and left on the gateway at the end,
    so the final figures stay visible after the run."""

    def __init__(self, url: str, grouping: dict[str, str], registry: Any) -> None:
        self.url = url
        self.grouping = grouping
        self.registry = registry
        self._wake = threading.Event()
        self._closing = False
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="sdnet-pushgateway", daemon=True)
        self._thread.start()

    def request(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=PUSH_TIMEOUT_S + 5)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            # Read before the push: a close() during it wakes the loop once more, so the last
            # snapshot (the summary) is pushed after it.
            closing = self._closing
            self._push()
            if closing:
                return

    def _push(self) -> None:
        from prometheus_client import push_to_gateway

        try:
            push_to_gateway(
                self.url,
                job=PUSH_JOB,
                registry=self.registry,
                grouping_key=self.grouping,
                timeout=PUSH_TIMEOUT_S,
            )
        except Exception as error:  # noqa: BLE001 -- any failure: training goes on, said once
            if not self._failing:
                logger.warning(
                    "rank %s: cannot push metrics to the Pushgateway at %s (%s); retrying at "
                    "each log point",
                    self.grouping["rank"],
                    self.url,
                    error,
                )
            self._failing = True
            return
        if self._failing:
            logger.warning("rank %s: pushing to %s works again", self.grouping["rank"], self.url)
        self._failing = False


__all__ = [
    "FAMILIES",
    "KEYS",
    "PER_RANK",
    "PrometheusExporter",
    "metric_names",
    "prometheus_enabled",
    "validate_prometheus",
]
