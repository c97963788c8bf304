"""Live metrics of a real 2-process run: with ``logging.prometheus.port`` every rank serves
/metrics while it trains; each scrape, parsed with prometheus_client's parser, matches
``metrics.jsonl`` at the same step. Where a Prometheus server is installed, it scrapes the run
too: its stored loss series matches the log, and every expression of the Grafana dashboard is
valid PromQL that finds the run's series."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.forked import ForkedLaunch
from tests.support import (
    TINY,
    free_port,
    read_jsonl,
    wait_until,
)
from tests.unit.test_prometheus import (
    DASHBOARD,
    EXPECTED,
    Samples,
    _expressions,
    _metric_names,
    parse,
)

STEPS = 40
ARGS = TINY + [
    "trainer._target_=tests.support.SignalTrainer",
    f"loop.max_steps={STEPS}",
    "loop.global_batch_size=32",
    "logging.log_every_n_steps=1",
    "loop.eval_every_n_steps=10",
    "loop.eval_at_end=false",
    "checkpoint.every_n_steps=10",
    "logging.prometheus.host=127.0.0.1",
    # Every rank's figures in metrics.jsonl too, to compare with each rank's own gauges.
    "logging.per_rank_metrics=true",
]
# SignalTrainer sleeps this long in every step, so the run trains for several seconds: long
# enough to be scraped many times (a log point per step).
STEP_DELAY_S = "0.15"
RUN_TIMEOUT_S = 240


def _scrape(port: int) -> Samples | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return parse(response.read().decode())
    except (OSError, http.client.HTTPException):
        return None  # not serving (yet, or any more)


def _one(samples: Samples, metric: str, **labels: str) -> float | None:
    found = [v for (name, have), v in samples.items() if name == metric and labels.items() <= have]
    assert len(found) <= 1, (metric, labels, found)
    return found[0] if found else None


def _labels(samples: Samples, metric: str) -> dict[str, str]:
    return dict(next(labels for name, labels in samples if name == metric))


class _Prometheus:
    """A real Prometheus server scraping the run's ranks every second (where installed)."""

    def __init__(self, binary: str, ports: list[int], directory: Path) -> None:
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {
                    "job_name": "sdnet_trainer",
                    "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}],
                }
            ],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(directory / "prometheus.log", "wb"),  # noqa: SIM115 -- lives with the server
            start_new_session=True,
        )
        wait_until(self._ready, timeout=60, what="Prometheus to start")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except (OSError, http.client.HTTPException):
            return False

    def query(self, expression: str, at: float) -> list[dict]:
        """The instant query's result vector at unix time ``at``; raises on invalid PromQL."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expression, "time": f"{at:.3f}"}
        )
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as error:
            raise AssertionError(f"{expression!r}: {error.read().decode()}") from None
        assert answer["status"] == "success", (expression, answer)
        return answer["data"]["result"]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def test_every_rank_serves_what_the_run_logs(tmp_path):
    base = free_port(2)
    ports = [base, base + 1]
    run_dir = tmp_path / "run"
    binary = shutil.which("prometheus")
    server = _Prometheus(binary, ports, tmp_path) if binary else None
    args = [*ARGS, f"logging.prometheus.port={base}", f"hydra.run.dir={run_dir}"]
    log = tmp_path / "run.log"
    # Two ranks forked ready-imported (tests/forked.py): the exporter, not the launcher, is
    # what is checked, and each rank's identity comes from the variables any launcher sets.
    agent = ForkedLaunch(
        args, cwd=tmp_path, log=log, nproc=2, env={"SDNET_TEST_STEP_DELAY": STEP_DELAY_S}
    )
    scrapes: list[tuple[int, Samples]] = []  # (rank, one scrape)
    stored: list[tuple[float, float, float]] = []  # Prometheus' (time, step, loss) of rank 0
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while agent.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            for rank, port in enumerate(ports):
                samples = _scrape(port)
                if samples is not None and _one(samples, "sdnet_step") is not None:
                    scrapes.append((rank, samples))
            if server is not None and scrapes:
                # One selector, so both values come from the same scrape; a second ago, so no
                # scrape is still being stored for that moment.
                at = time.time() - 1
                pair = server.query('{__name__=~"sdnet_step|sdnet_train_loss", rank="0"}', at)
                values = {r["metric"]["__name__"]: float(r["value"][1]) for r in pair}
                if len(values) == 2:
                    stored.append((at, values["sdnet_step"], values["sdnet_train_loss"]))
            time.sleep(0.2)
        output = log.read_text()
        assert agent.returncode == 0, output
        assert scrapes, (
            "no rank served /metrics while training: is PrometheusExporter passed to the "
            f"MetricsWriter in Trainer._setup_observability?\n{output}"
        )
        if server is not None:
            _check_prometheus(server, stored, run_dir, last_training_time=stored[-1][0])
    finally:
        if agent.poll() is None:
            agent.kill()
        if server is not None:
            server.stop()

    rows = read_jsonl(run_dir / "metrics.jsonl")
    _check_scrapes(scrapes, rows)


def _row(rows: list[dict], step: float, key: str) -> dict:
    matching = [row for row in rows if row["step"] == step and key in row]
    assert len(matching) == 1, (step, key, matching)
    return matching[0]


def _check_scrapes(scrapes: list[tuple[int, Samples]], rows: list[dict]) -> None:
    steps = {rank: {_one(s, "sdnet_step") for r, s in scrapes if r == rank} for rank in (0, 1)}
    for rank in (0, 1):
        assert len(steps[rank]) >= 3, f"rank {rank} was scraped at too few steps: {steps}"
    identities = set()
    seen_eval = seen_checkpoint = False
    for rank, samples in scrapes:
        identity = _labels(samples, "sdnet_step")
        assert identity["rank"] == str(rank) and identity["node"] == socket.gethostname()
        identities.add((identity["run"], identity["run_id"]))
        step = _one(samples, "sdnet_step")
        assert step is not None
        # The scrape's training figures are those of metrics.jsonl at that step.
        row = _row(rows, step, "train/loss")
        for key, logged in row.items():
            if key in EXPECTED:
                name, labels, scale = EXPECTED[key]
                assert _one(samples, name, **labels) == pytest.approx(logged * scale), (key, step)
        assert _one(samples, "sdnet_rank_step_seconds", rank=str(rank)) == pytest.approx(
            row[f"perf/step_s_rank{rank}"]
        )
        published = {
            dict(labels)["rank"] for name, labels in samples if name.startswith("sdnet_rank_")
        }
        assert published == {str(rank)}  # each rank publishes only its own per-rank figures
        assert (_one(samples, "sdnet_process_resident_memory_bytes") or 0) > 0
        assert _one(samples, "sdnet_world_size") == 2
        # Evaluations and checkpoints: the latest one's figures.
        eval_step = _one(samples, "sdnet_eval_step")
        if eval_step is not None:
            seen_eval = True
            val = _row(rows, eval_step, "val/top1")
            for name in ("loss", "top1", "top5"):
                assert _one(samples, "sdnet_eval_metric", name=name) == pytest.approx(
                    val[f"val/{name}"]
                )
        checkpoint_step = _one(samples, "sdnet_checkpoint_last_step")
        if checkpoint_step is not None:
            seen_checkpoint = True
            saved = _row(rows, checkpoint_step, "checkpoint/step")
            assert (_one(samples, "sdnet_checkpoint_size_bytes") or 0) > 0
            if rank == 0:  # metrics.jsonl holds rank 0's figures
                assert _one(samples, "sdnet_checkpoint_size_bytes") == saved["checkpoint/bytes"]
                assert _one(samples, "sdnet_checkpoint_save_seconds") == pytest.approx(
                    saved["checkpoint/save_seconds"]
                )
    assert len(identities) == 1, identities  # one run, the same identity on both ranks
    assert seen_eval and seen_checkpoint


def _check_prometheus(
    server: _Prometheus,
    stored: list[tuple[float, float, float]],
    run_dir: Path,
    *,
    last_training_time: float,
) -> None:
    """Prometheus' own copy of the loss series matches the log; every dashboard expression is
    valid and those over series this run has find them."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len({step for _, step, _ in stored}) >= 2, stored
    for _, step, loss in stored:
        assert loss == pytest.approx(_row(rows, step, "train/loss")["train/loss"])
    series = server.query('{__name__=~"sdnet_.+"}', last_training_time)
    present = {result["metric"]["__name__"] for result in series}
    for expression in _expressions(json.loads(DASHBOARD.read_text())):
        if expression.startswith("label_values("):
            continue  # a Grafana function, not PromQL
        expression = re.sub(r"\$(run_id|run)\b", ".*", expression)  # Grafana's variables: all
        result = server.query(expression, last_training_time)
        if _metric_names(expression) <= present:
            assert result, f"{expression!r} found nothing; the run has {sorted(present)}"
