"""The Prometheus exporter in one process: what a scrape shows after each kind of write, ports,
the Pushgateway, hardware figures, validation, and the deploy/monitoring files (the dashboards
refer only to metrics the exporter and the model server emit; the configs are valid where promtool
is installed)."""

from __future__ import annotations

import http.server
import json
import logging
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

# The monitor extra: without it these tests skip with the reason, and collection goes on.
psutil = pytest.importorskip("psutil", reason="the monitor extra (psutil) is not installed")
pytest.importorskip("prometheus_client", reason="the monitor extra is not installed")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from sdnet_trainer.config.observability import PrometheusConfig  # noqa: E402
from sdnet_trainer.config.schema import Config  # noqa: E402
from sdnet_trainer.errors import ConfigError  # noqa: E402
from sdnet_trainer.observability import hardware  # noqa: E402
from sdnet_trainer.observability.hardware import GPU_METRICS, HardwareSampler  # noqa: E402
from sdnet_trainer.observability.meters import resident_memory_mb  # noqa: E402
from sdnet_trainer.observability.prometheus import (  # noqa: E402
    PrometheusExporter,
    metric_names,
    validate_prometheus,
)
from tests.support import REPO, free_port, wait_until  # noqa: E402

MONITORING = REPO / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "sdnet_training.json"
SERVING_DASHBOARD = MONITORING / "grafana" / "dashboards" / "sdnet_serving.json"
CPU = torch.device("cpu")
RUN = {"run": "quickstart", "run_id": "2024-01-01_00-00-00", "node": "host-a"}

# What MetricsHook hands the writers at one log point of a 2-rank run (CPU: no alloc_retries).
LOG_POINT = {
    "train/loss": 0.6931471805599453,
    "train/lr": 0.05,
    "train/epoch": 1.25,
    "perf/samples_per_s": 1234.5,
    "perf/step_s": 0.125,
    "perf/data_wait_s": 0.0125,
    "perf/fwd_bwd_s": 0.0625,
    "perf/optimizer_s": 0.03125,
    "train/grad_norm": 2.75,
    "perf/peak_memory_mb": 512.5,
    "perf/reserved_memory_mb": 480.25,
    "perf/tokens_per_s": 158016.0,
    "perf/tflops_per_s": 3.5,
    "perf/mfu": 0.4125,
    "comm/bytes_per_step": 4_000_000.0,
    "train/loss_scale": 65536.0,
    "train/skipped_steps": 2.0,
    "perf/samples_per_s_rank0": 620.0,
    "perf/samples_per_s_rank1": 614.5,
    "perf/step_s_rank0": 0.1,
    "perf/step_s_rank1": 0.125,
}
EVAL = {"val/loss": 0.5, "val/top1": 81.25, "val/top5": 99.5}
CHECKPOINT = {
    "checkpoint/save_seconds": 1.5,
    "checkpoint/bytes": 123456789.0,
    "checkpoint/step": 8.0,
}
SUMMARY = {
    "summary/steps": 8.0,
    "summary/train_seconds": 12.5,
    "summary/wall_seconds": 20.0,
    "summary/samples_per_s": 1100.0,
}
FT = {  # sdnet_trainer.training.fault_tolerance at a log point under fault_tolerance.enabled
    "ft/quorum_size": 2.0,
    "ft/in_quorum/group0": 1.0,
    "ft/in_quorum/group1": 0.0,
    "ft/in_quorum/group2": 1.0,
    "ft/recoveries": 1.0,
    "ft/recovery_seconds": 0.75,
    "ft/degraded_steps": 3.0,
    "ft/skipped_steps": 1.0,
    "ft/committed_steps": 40.0,
}
MB = 2**20

# The reference: each logged key's series as the documentation names it (metric, extra labels,
# value in the metric's base unit), written out here rather than read from the exporter's table.
EXPECTED = {
    "train/loss": ("sdnet_train_loss", {}, 1),
    "train/lr": ("sdnet_train_learning_rate", {}, 1),
    "train/epoch": ("sdnet_train_epoch", {}, 1),
    "train/grad_norm": ("sdnet_train_grad_norm", {}, 1),
    "train/loss_scale": ("sdnet_train_loss_scale", {}, 1),
    "train/skipped_steps": ("sdnet_train_skipped_steps", {}, 1),
    "perf/samples_per_s": ("sdnet_samples_per_second", {}, 1),
    "perf/tokens_per_s": ("sdnet_tokens_per_second", {}, 1),
    "perf/tflops_per_s": ("sdnet_model_flops_per_second", {}, 1e12),
    "perf/mfu": ("sdnet_mfu_ratio", {}, 1),
    "perf/step_s": ("sdnet_step_seconds", {}, 1),
    "perf/data_wait_s": ("sdnet_step_phase_seconds", {"phase": "data_wait"}, 1),
    "perf/fwd_bwd_s": ("sdnet_step_phase_seconds", {"phase": "forward_backward"}, 1),
    "perf/optimizer_s": ("sdnet_step_phase_seconds", {"phase": "optimizer"}, 1),
    "perf/peak_memory_mb": ("sdnet_memory_peak_bytes", {}, MB),
    "perf/reserved_memory_mb": ("sdnet_memory_reserved_bytes", {}, MB),
    "comm/bytes_per_step": ("sdnet_comm_step_bytes", {}, 1),
    "val/loss": ("sdnet_eval_metric", {"name": "loss"}, 1),
    "val/top1": ("sdnet_eval_metric", {"name": "top1"}, 1),
    "val/top5": ("sdnet_eval_metric", {"name": "top5"}, 1),
    "checkpoint/save_seconds": ("sdnet_checkpoint_save_seconds", {}, 1),
    "checkpoint/bytes": ("sdnet_checkpoint_size_bytes", {}, 1),
    "checkpoint/step": ("sdnet_checkpoint_last_step", {}, 1),
    "summary/steps": ("sdnet_run_steps", {}, 1),
    "summary/train_seconds": ("sdnet_run_train_seconds", {}, 1),
    "summary/wall_seconds": ("sdnet_run_wall_seconds", {}, 1),
    "summary/samples_per_s": ("sdnet_run_samples_per_second", {}, 1),
    "ft/quorum_size": ("sdnet_ft_quorum_groups", {}, 1),
    "ft/in_quorum/group0": ("sdnet_ft_in_quorum", {"group": "0"}, 1),
    "ft/in_quorum/group1": ("sdnet_ft_in_quorum", {"group": "1"}, 1),
    "ft/in_quorum/group2": ("sdnet_ft_in_quorum", {"group": "2"}, 1),
    "ft/recoveries": ("sdnet_ft_recoveries", {}, 1),
    "ft/recovery_seconds": ("sdnet_ft_recovery_seconds", {}, 1),
    "ft/degraded_steps": ("sdnet_ft_degraded_steps", {}, 1),
    "ft/skipped_steps": ("sdnet_ft_skipped_steps", {}, 1),
    "ft/committed_steps": ("sdnet_ft_committed_steps", {}, 1),
}


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return parse(response.read().decode())


def value(samples: Samples, metric: str, rank: int, /, **labels: str) -> float:
    key = (metric, frozenset({**RUN, "rank": str(rank), **labels}.items()))
    assert key in samples, f"no {metric}{labels} of rank {rank}; have {sorted(names(samples))}"
    return samples[key]


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def exporter(cfg: PrometheusConfig, *, rank: int = 0, local_rank: int = 0) -> PrometheusExporter:
    return PrometheusExporter(
        cfg,
        rank=rank,
        local_rank=local_rank,
        world_size=2,
        run_name=RUN["run"],
        run_id=RUN["run_id"],
        node=RUN["node"],
        device=CPU,
    )


@pytest.fixture
def served():
    """Rank 1 of a 2-rank run, serving on 127.0.0.1."""
    exp = exporter(PrometheusConfig(port=free_port(), host="127.0.0.1"), rank=1)
    yield exp
    exp.close()


def assert_matches(samples: Samples, written: dict[str, float], rank: int) -> None:
    for key, logged in written.items():
        if key not in EXPECTED:
            continue
        name, labels, scale = EXPECTED[key]
        assert value(samples, name, rank, **labels) == pytest.approx(logged * scale, rel=1e-12), key


# ---------------------------------------------------------------------- what a scrape shows


def test_fault_tolerance_figures_show_with_a_group_label(served):
    served.write(40, FT)
    assert_matches(scrape(served.port), FT, rank=1)


def test_each_write_shows_in_the_next_scrape(served):
    before = scrape(served.port)
    assert value(before, "sdnet_world_size", 1) == 2  # the run is visible before its first step
    assert "sdnet_train_loss" not in names(before)

    served.write(4, LOG_POINT)
    samples = scrape(served.port)
    assert_matches(samples, LOG_POINT, rank=1)
    assert value(samples, "sdnet_step", 1) == 4
    assert value(samples, "sdnet_train_nonfinite_steps", 1) == 0  # logged only once non-zero
    assert time.time() - value(samples, "sdnet_log_timestamp_seconds", 1) < 60

    served.write(6, EVAL)
    served.write(6, CHECKPOINT)
    served.write(8, {**LOG_POINT, "train/loss": 0.25, "train/nonfinite_steps": 1.0})
    served.write(8, SUMMARY)
    samples = scrape(served.port)
    assert_matches(samples, {**LOG_POINT, "train/loss": 0.25, **EVAL, **CHECKPOINT, **SUMMARY}, 1)
    assert value(samples, "sdnet_train_nonfinite_steps", 1) == 1
    assert value(samples, "sdnet_eval_step", 1) == 6
    assert value(samples, "sdnet_step", 1) == 8  # the summary is no log point: the step stays
    assert time.time() - value(samples, "sdnet_checkpoint_last_timestamp_seconds", 1) < 60
    # Every series carries the run's identity.
    for name, labels in samples:
        assert {**RUN, "rank": "1"}.items() <= dict(labels).items(), name


def test_an_evaluation_does_not_move_the_training_step(served):
    served.write(3, LOG_POINT)
    served.write(4, EVAL)  # e.g. an evaluation at an epoch end between two log points
    samples = scrape(served.port)
    assert value(samples, "sdnet_step", 1) == 3
    assert value(samples, "sdnet_eval_step", 1) == 4
    assert value(samples, "sdnet_train_loss", 1) == LOG_POINT["train/loss"]


def test_other_keys_get_a_name_of_their_own(served):
    served.write(
        2,
        {
            "train/ema_loss": 0.5,
            "data/skipped_samples": 3.0,
            "summary/tokens": 9.0,
            "train/note": "no number",  # a subclass's text: left out, training goes on
        },
    )
    samples = scrape(served.port)
    assert "sdnet_train_note" not in names(samples)
    assert value(samples, "sdnet_train_ema_loss", 1) == 0.5
    assert value(samples, "sdnet_data_skipped_samples", 1) == 3
    assert value(samples, "sdnet_run_tokens", 1) == 9


def test_each_rank_publishes_its_own_per_rank_figures():
    base = free_port(2)
    cfg = PrometheusConfig(port=base, host="127.0.0.1")
    ranks = [exporter(cfg, rank=rank, local_rank=rank) for rank in (0, 1)]
    try:
        assert [exp.port for exp in ranks] == [base, base + 1]  # port + local rank
        for exp in ranks:
            exp.write(4, LOG_POINT)  # the same gathered figures on every rank
        for rank in (0, 1):
            samples = scrape(base + rank)
            series = {
                dict(labels)["rank"]: v
                for (name, labels), v in samples.items()
                if name == "sdnet_rank_step_seconds"
            }
            assert series == {str(rank): LOG_POINT[f"perf/step_s_rank{rank}"]}
            assert value(samples, "sdnet_rank_samples_per_second", rank) == pytest.approx(
                LOG_POINT[f"perf/samples_per_s_rank{rank}"]
            )
            assert value(samples, "sdnet_train_loss", rank) == LOG_POINT["train/loss"]
    finally:
        for exp in ranks:
            exp.close()


def test_a_scrape_reads_no_hardware_and_sees_one_write_whole(served, monkeypatch):
    """Values are computed at writes only: scrapes never sample the machine, and a scrape during
    a stream of writes sees the step and the loss of the same write."""
    calls = []
    sample = HardwareSampler.sample

    def counted(self: HardwareSampler) -> list:
        calls.append(1)
        return sample(self)

    monkeypatch.setattr(HardwareSampler, "sample", counted)
    for _ in range(20):
        scrape(served.port)
    assert calls == []

    stop = threading.Event()

    def writer() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            served.write(step, {**LOG_POINT, "train/loss": float(step)})

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(30):
            samples = scrape(served.port)
            if "sdnet_step" in names(samples):
                assert value(samples, "sdnet_train_loss", 1) == value(samples, "sdnet_step", 1)
    finally:
        stop.set()
        thread.join()


# ---------------------------------------------------------------------- the port


def test_close_frees_the_port_and_is_idempotent():
    port = free_port()
    cfg = PrometheusConfig(port=port, host="127.0.0.1")
    exp = exporter(cfg)
    scrape(port)
    exp.close()
    exp.close()
    with pytest.raises(OSError):
        scrape(port)
    again = exporter(cfg)  # e.g. the next attempt of a restarted rank
    try:
        assert value(scrape(port), "sdnet_world_size", 0) == 2
    finally:
        again.close()


def test_a_taken_port_is_one_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"logging\.prometheus\.port.*rank 0.*:{port}"):
            exporter(PrometheusConfig(port=port, host="127.0.0.1"))


# ---------------------------------------------------------------------- the Pushgateway


class _Gateway(http.server.BaseHTTPRequestHandler):
    pushes: list[tuple[str, str, str]]

    def do_PUT(self) -> None:  # noqa: N802 -- http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        self.pushes.append((self.command, self.path, body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def gateway():
    pushes: list[tuple[str, str, str]] = []
    handler = type("Handler", (_Gateway,), {"pushes": pushes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", pushes
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_pushes_each_write_to_the_gateway(gateway):
    url, pushes = gateway
    exp = exporter(PrometheusConfig(pushgateway=url), rank=1)
    try:
        assert exp.port is None  # pushing only: no server
        exp.write(4, LOG_POINT)
        wait_until(lambda: pushes, timeout=10, what="a push")
        exp.write(6, EVAL)
    finally:
        exp.close()  # a last push with everything
    method, path, body = pushes[-1]
    assert method == "PUT"  # replaces the group: one run, one rank
    segments = path.removeprefix("/metrics/").split("/")
    grouping = dict(zip(segments[::2], segments[1::2]))
    assert grouping == {
        "job": "sdnet_trainer",
        "run": RUN["run"],
        "run_id": RUN["run_id"],
        "rank": "1",
    }
    assert_matches(parse(body), {**LOG_POINT, **EVAL}, rank=1)


def test_an_unreachable_gateway_warns_once_and_training_goes_on(caplog):
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    exp = exporter(PrometheusConfig(pushgateway=url))
    with caplog.at_level(logging.WARNING, logger="sdnet_trainer.observability.prometheus"):
        started = time.perf_counter()
        for step in range(5):
            exp.write(step, LOG_POINT)
        assert time.perf_counter() - started < 2  # the pushes happen on another thread
        exp.close()
    warnings = [r for r in caplog.records if "cannot push" in r.getMessage()]
    assert len(warnings) == 1 and url in warnings[0].getMessage()


# ---------------------------------------------------------------------- hardware


def test_process_and_host_figures_on_the_cpu(served):
    served.write(1, LOG_POINT)
    samples = scrape(served.port)
    rss = value(samples, "sdnet_process_resident_memory_bytes", 1)
    reference = resident_memory_mb() * MB  # /proc/self/status, read independently
    assert rss == pytest.approx(reference, rel=0.2)
    assert value(samples, "sdnet_host_memory_total_bytes", 1) == psutil.virtual_memory().total
    assert (
        0 < value(samples, "sdnet_host_memory_available_bytes", 1) <= psutil.virtual_memory().total
    )
    assert value(samples, "sdnet_process_cpu_usage_ratio", 1) >= 0
    assert not names(samples) & set(GPU_METRICS)  # no NVML on the CPU


class _NvmlError(Exception):
    pass


def _fake_nvml(*, init_fails: bool = False) -> types.SimpleNamespace:
    """A stand-in for pynvml on a machine without NVIDIA's library: a GPU whose power reading is
    not supported (as on some boards)."""
    asked: list[str] = []

    def init() -> None:
        if init_fails:
            raise _NvmlError("Driver Not Loaded")

    def handle_by_uuid(uuid: str) -> str:
        asked.append(uuid)
        return f"handle:{uuid}"

    def power(handle: str) -> int:
        asked.append("power")
        raise _NvmlError("Not Supported")

    return types.SimpleNamespace(
        NVMLError=_NvmlError,
        NVML_TEMPERATURE_GPU=0,
        asked=asked,
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByUUID=handle_by_uuid,
        nvmlDeviceGetIndex=lambda handle: 3,
        nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=87),
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(
            used=5 * 2**30, total=80 * 2**30
        ),
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetTemperature=lambda handle, sensor: 61,
    )


def test_gpu_figures_come_from_the_ranks_own_gpu(monkeypatch):
    nvml = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    properties = types.SimpleNamespace(uuid="5e3c1a2b-0000-1111-2222-333344445555")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    sampler = HardwareSampler(torch.device("cuda", 0))
    try:
        first = {r.name: (r.value, r.labels) for r in sampler.sample()}
        second = {r.name: r.value for r in sampler.sample()}
    finally:
        sampler.close()
    assert "GPU-5e3c1a2b-0000-1111-2222-333344445555" in nvml.asked  # found by UUID, not index
    assert first["sdnet_gpu_utilization_ratio"] == (0.87, {"gpu": "3"})
    assert first["sdnet_gpu_memory_used_bytes"][0] == 5 * 2**30
    assert first["sdnet_gpu_memory_total_bytes"][0] == 80 * 2**30
    assert first["sdnet_gpu_temperature_celsius"][0] == 61
    assert "sdnet_gpu_power_watts" not in first and "sdnet_gpu_power_watts" not in second
    assert nvml.asked.count("power") == 1  # unsupported: asked once, then left out
    assert "sdnet_process_resident_memory_bytes" in second


def test_no_nvml_driver_means_no_gpu_figures(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(init_fails=True))
    with caplog.at_level(logging.WARNING, logger=hardware.__name__):
        sampler = HardwareSampler(torch.device("cuda", 0))
    readings = {r.name for r in sampler.sample()}
    sampler.close()
    assert not readings & set(GPU_METRICS) and "sdnet_host_memory_total_bytes" in readings
    assert "NVML did not start" in caplog.text


def test_no_nvml_library_means_no_gpu_figures(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    sampler = HardwareSampler(torch.device("cuda", 0))
    assert not {r.name for r in sampler.sample()} & set(GPU_METRICS)
    sampler.close()


# ---------------------------------------------------------------------- validation


def _config(monkeypatch, local_world_size: int = 1, **prometheus: object) -> Config:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
    cfg = Config()
    cfg.logging.prometheus = PrometheusConfig(**prometheus)  # type: ignore[arg-type]
    return cfg


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"port": 0}, r"port=0: the 1 rank\(s\) of this node serve on ports 0\.\.0"),
        ({"port": 70000}, r"port=70000"),
        ({"port": 65530, "local_world_size": 8}, r"port=65530: the 8 rank\(s\).*65530\.\.65537"),
        ({"port": 9400, "host": ""}, r"logging\.prometheus\.host is empty"),
        ({"pushgateway": "pushgateway:9091"}, r"pushgateway='pushgateway:9091'.*http\(s\)://"),
        ({"pushgateway": "ftp://gw:9091"}, r"expected http\(s\)://HOST"),
        ({"pushgateway": "http://gw:99999"}, r"is not a URL"),
        ({"pushgateway": "http://gw:9091/?x=1"}, r"without query"),
        ({"pushgateway": "http://user:pw@gw:9091"}, r"credentials"),
        ({"pushgateway": "http://:9091"}, r"expected http\(s\)://HOST"),
    ],
)
def test_validate_rejects(monkeypatch, settings, message):
    local_world_size = settings.pop("local_world_size", 1)
    cfg = _config(monkeypatch, local_world_size, **settings)
    with pytest.raises(ConfigError, match=message):
        validate_prometheus(cfg)


@pytest.mark.parametrize(
    "settings",
    [
        {},  # off
        {"port": 9400},
        {"port": 65528, "local_world_size": 8},  # 65528..65535
        {"port": 1},
        {"pushgateway": "http://pushgateway:9091"},
        {"pushgateway": "https://metrics.example.com/push/"},
        {"port": 9400, "pushgateway": "http://[::1]:9091"},
    ],
)
def test_validate_accepts(monkeypatch, settings):
    local_world_size = settings.pop("local_world_size", 1)
    validate_prometheus(_config(monkeypatch, local_world_size, **settings))


def test_a_missing_client_names_the_extra_to_install(monkeypatch):
    cfg = _config(monkeypatch, port=9400)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    hint = re.escape("pip install 'sdnet_trainer[monitor]'")
    with pytest.raises(ConfigError, match=rf"prometheus_client.*{hint}"):
        validate_prometheus(cfg)
    with pytest.raises(ConfigError, match=hint):
        exporter(PrometheusConfig(port=9400))


# ---------------------------------------------------------------------- deploy/monitoring


def _expressions(node: object) -> list[str]:
    """Every PromQL expression in a Grafana dashboard: panel targets and variable queries."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, item in node.items():
            if key == "expr" and isinstance(item, str):
                found.append(item)
            elif key == "query" and isinstance(item, dict) and isinstance(item.get("query"), str):
                found.append(item["query"])
            else:
                found += _expressions(item)
    elif isinstance(node, list):
        for item in node:
            found += _expressions(item)
    return found


def _metric_names(expression: str) -> set[str]:
    return set(re.findall(r"\bsdnet_[a-zA-Z0-9_]+", expression))


def test_the_dashboard_refers_only_to_metrics_the_exporter_emits(served):
    for step, written in enumerate([LOG_POINT, EVAL, CHECKPOINT, SUMMARY, FT], start=1):
        served.write(step, written)
    emitted = names(scrape(served.port)) | set(GPU_METRICS)  # NVML is absent here
    assert emitted <= metric_names()

    dashboard = json.loads(DASHBOARD.read_text())
    expressions = _expressions(dashboard)
    assert len(expressions) > 20
    used: set[str] = set()
    for expression in expressions:
        referred = _metric_names(expression)
        assert referred, f"no sdnet_ metric in {expression!r}"
        assert referred <= emitted, f"{expression!r} refers to {referred - emitted}"
        used |= referred
    # The panels the issue asks for are there.
    assert {
        "sdnet_train_loss",
        "sdnet_train_learning_rate",
        "sdnet_samples_per_second",
        "sdnet_mfu_ratio",
        "sdnet_step_phase_seconds",
        "sdnet_memory_peak_bytes",
        "sdnet_gpu_utilization_ratio",
        "sdnet_checkpoint_last_timestamp_seconds",
        "sdnet_rank_step_seconds",
    } <= used
    # Fault tolerance's panels: the quorum, recoveries, degraded and skipped steps.
    assert {"sdnet_ft_quorum_groups", "sdnet_ft_in_quorum", "sdnet_ft_skipped_steps"} <= used
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["description"] and panel["targets"], panel["title"]


# The sample names prometheus_client writes for a family of each type: a labelled family has no
# samples until its first labels(...), so the names come from the type, not only the samples.
_SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def test_the_serving_dashboard_refers_only_to_metrics_the_server_emits():
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from sdnet_trainer.serve.args import ServeArgs
    from sdnet_trainer.serve.metrics import ServeMetrics

    emitted: set[str] = set()
    sampled: set[str] = set()
    for family in ServeMetrics(max_batch_size=4).registry.collect():
        emitted |= {family.name + s for s in _SAMPLE_SUFFIXES.get(family.type, ("",))}
        sampled |= {sample.name for sample in family.samples}
    assert sampled <= emitted, sampled - emitted  # the suffixes above are prometheus_client's

    dashboard = json.loads(SERVING_DASHBOARD.read_text())
    training = json.loads(DASHBOARD.read_text())
    # Provisioned from one folder: a uid or title of the training dashboard's would clash.
    assert dashboard["uid"] != training["uid"] and dashboard["title"] != training["title"]
    assert dashboard["tags"] == training["tags"]
    source = {"type": "prometheus", "uid": "${datasource}"}
    variables = dashboard["templating"]["list"]
    assert variables[0] == training["templating"]["list"][0]  # the data source variable
    for variable in variables[1:]:
        assert variable["datasource"] == source, variable["name"]

    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["title"], panel["id"]
        if panel["type"] == "row":
            continue
        assert panel["description"] and panel["targets"], panel["title"]
        assert panel["datasource"] == source, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source, panel["title"]
        if any("kv_cache_usage_perc" in target["expr"] for target in panel["targets"]):
            assert panel["fieldConfig"]["defaults"]["unit"] == "percentunit", panel["title"]

    # Prometheus scrapes the server where it listens by default.
    jobs = yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"]
    (job,) = [job for job in jobs if job["job_name"] == "sdnet_serve"]
    ports = {int(t.rsplit(":", 1)[1]) for g in job["static_configs"] for t in g["targets"]}
    assert ports == {ServeArgs.port}

    unknown: dict[str, list[str]] = {}
    used: set[str] = set()
    expressions = _expressions(dashboard)
    assert len(expressions) > 20
    for expression in expressions:
        referred = _metric_names(expression)
        assert referred, f"no sdnet_ metric in {expression!r}"
        for name in referred - emitted:
            unknown.setdefault(name, []).append(expression)
        if "histogram_quantile" in expression:
            assert all(name.endswith("_bucket") for name in referred), expression
            assert re.search(r"by \([^)]*\ble\b", expression), expression
        used |= referred
    # The panels the issue asks for are there: HTTP, then the language model's.
    assert {
        "sdnet_serve_requests_total",
        "sdnet_serve_errors_total",
        "sdnet_serve_request_duration_seconds_bucket",
        "sdnet_serve_queue_depth",
        "sdnet_serve_ready",
        "sdnet_serve_time_to_first_token_seconds_bucket",
        "sdnet_serve_inter_token_latency_seconds_bucket",
        "sdnet_serve_prompt_tokens_total",
        "sdnet_serve_generation_tokens_total",
        "sdnet_serve_num_requests_running",
        "sdnet_serve_num_requests_waiting",
        "sdnet_serve_kv_cache_usage_perc",
        "sdnet_serve_decode_steps_total",
        "sdnet_serve_requests_finished_total",
        "sdnet_serve_request_abort_steps_bucket",
    } <= used
    # Last, so that the checks above run while ServeMetrics still lacks a name.
    assert not unknown, f"metrics ServeMetrics does not register: {sorted(unknown)}"


# The ranks' spread MetricsHook logs at every log point (training/hooks.py: rank_spread), and a
# key of no table (spelt from its name).
SPREAD = {
    **{f"perf/rank_step_s_{stat}": 0.125 for stat in ("min", "median", "max")},
    **{f"perf/rank_samples_per_s_{stat}": 614.5 for stat in ("min", "median", "max")},
    "perf/slowest_rank": 1.0,
    "perf/custom_wait_s": 0.5,
}
# promtool's "metric names should not contain abbreviated units" (client_golang promlint).
_ABBREVIATED = ("s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d")
PROMTOOL_HINT = "promtool is not installed (Debian/Ubuntu: apt-get install prometheus)"


def _abbreviated_units(name: str) -> list[str]:
    lower = name.lower()
    return [a for a in _ABBREVIATED if f"_{a}_" in lower or lower.endswith(f"_{a}")]


def _training_scrape(served) -> bytes:
    for step, written in enumerate([LOG_POINT, SPREAD, EVAL, CHECKPOINT, SUMMARY, FT], start=1):
        served.write(step, written)
    with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/metrics", timeout=10) as r:
        return r.read()


def _serving_scrape() -> bytes:
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from prometheus_client import generate_latest

    from sdnet_trainer.serve.metrics import ServeMetrics

    metrics = ServeMetrics(max_batch_size=4)
    metrics.record("/v1/completions", 200, 0.25)
    metrics.engine.finished.labels(finish_reason="stop").inc()
    return generate_latest(metrics.registry)


def test_the_ranks_spread_is_exported_in_prometheus_units(served):
    samples = parse(_training_scrape(served).decode())
    assert value(samples, "sdnet_perf_rank_step_seconds_max", 1) == 0.125
    assert value(samples, "sdnet_perf_rank_samples_per_second_min", 1) == 614.5
    assert value(samples, "sdnet_perf_slowest_rank", 1) == 1.0
    assert value(samples, "sdnet_perf_custom_wait_seconds", 1) == 0.5
    assert {f"sdnet_perf_rank_step_seconds_{s}" for s in ("min", "median", "max")} <= set(
        metric_names()
    )


def test_no_exported_name_abbreviates_a_unit(served):
    exported = set(metric_names())
    exported |= {f.name for f in text_string_to_metric_families(_training_scrape(served).decode())}
    exported |= {f.name for f in text_string_to_metric_families(_serving_scrape().decode())}
    assert "sdnet_perf_rank_step_seconds_max" in exported
    offending = {name: _abbreviated_units(name) for name in exported if _abbreviated_units(name)}
    assert not offending, f"abbreviated units in metric names: {offending}"


@pytest.mark.parametrize("exporter", ["training", "serving"])
def test_a_scrape_passes_promtools_lint(exporter, served):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(PROMTOOL_HINT)
    text = _training_scrape(served) if exporter == "training" else _serving_scrape()
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60
    )
    assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()


def test_the_prometheus_config_is_valid():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(PROMTOOL_HINT)
    check = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"],
        cwd=MONITORING,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_compose_mounts_the_files_of_deploy_monitoring():
    compose = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())
    mounted: dict[str, Path] = {}
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (MONITORING / source).exists(), source
                mounted[target] = MONITORING / source
    home = compose["services"]["grafana"]["environment"][
        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"
    ]
    directory, file = home.rsplit("/", 1)
    assert (mounted[directory] / file).resolve() == DASHBOARD.resolve()
    datasources = yaml.safe_load(
        (MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
    assert datasources[0]["url"] == "http://prometheus:9090"  # the compose service
    scrape_ports = {
        int(target.rsplit(":", 1)[1])
        for job in yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"]
        if job["job_name"] == "sdnet_trainer"
        for group in job["static_configs"]
        for target in group["targets"]
    }
    assert scrape_ports == set(
        range(9400, 9408)
    )  # docs/monitoring.md's port=9400, up to 8 local ranks


def _podmonitor_and_job() -> tuple[dict, dict]:
    k8s = REPO / "deploy" / "k8s"
    return (
        yaml.safe_load((k8s / "podmonitor.yaml").read_text()),
        yaml.safe_load((k8s / "pytorchjob.yaml").read_text()),
    )


def test_the_podmonitor_selects_the_pytorchjob():
    monitor, job = _podmonitor_and_job()
    assert monitor["kind"] == "PodMonitor"
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "training.kubeflow.org/job-name": job["metadata"]["name"]
    }
    ports = [endpoint["port"] for endpoint in monitor["spec"]["podMetricsEndpoints"]]
    assert ports == [f"metrics-{i}" for i in range(int(job["spec"]["nprocPerNode"]))]


def test_the_pytorchjob_serves_what_the_podmonitor_scrapes():
    monitor, job = _podmonitor_and_job()
    ports = [endpoint["port"] for endpoint in monitor["spec"]["podMetricsEndpoints"]]
    for name, replica in job["spec"]["pytorchReplicaSpecs"].items():
        (container,) = replica["template"]["spec"]["containers"]
        port_args = [a for a in container["args"] if a.startswith("logging.prometheus.port=")]
        if not port_args:
            pytest.skip("deploy/k8s/pytorchjob.yaml does not set logging.prometheus.port")
        base = int(port_args[0].split("=", 1)[1])
        declared = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        expected = {port: base + i for i, port in enumerate(ports)}
        assert expected.items() <= declared.items(), name
