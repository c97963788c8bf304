"""Stop signals: SIGINT and SIGTERM to torchrun's agent (or its process group, as a terminal's
Ctrl-C) stop every rank at the same step with a checkpoint, and the run resumes bitwise; a repeat
of the same stop is ignored, a later one ends the process at once; a worker dies with its
launcher. SignalTrainer (tests/support.py) paces the runs and sends signals from inside."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sdnet_trainer.runtime import signals as signals_module
from sdnet_trainer.runtime.signals import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    StopSignals,
    die_with_launcher,
)
from tests.support import (
    FINAL_STATE,
    TINY,
    checkpoint_names,
    child_processes,
    kill_processes,
    process_command,
    run_cli,
    run_command,
    start_command,
    torchrun_command,
    wait_until,
)

# 256 samples / global batch 32 = 8 steps per epoch.
COMMON = TINY + [
    "trainer._target_=tests.support.SignalTrainer",
    "loop.global_batch_size=32",
    "loop.eval_at_end=false",
    "sched=cosine",
    "loop.max_steps=12",
    "checkpoint.every_n_steps=2",
]
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _final(run_dir):
    return torch.load(run_dir / FINAL_STATE, weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run that no signal reaches, on 2 processes (forked ready-imported: tests/forked.py)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run = run_cli(COMMON + [f"hydra.run.dir={tmp / 'run'}"], cwd=tmp, nproc=2)
    assert run.returncode == 0, run.output
    return _final(tmp / "run")


def _stop_lines(output: str, what: str) -> list[tuple[str, int]]:
    """(rank prefix, step) of every ``WHAT: stopped at step N after saving a checkpoint`` line."""
    pattern = rf"^(\[rank\d+\])?\[.*\] {re.escape(what)}: stopped at step (\d+) after saving a ch"
    return [(prefix, int(step)) for prefix, step in re.findall(pattern, output, re.MULTILINE)]


def _process_group(pgid: int) -> set[int]:
    """The live processes of process group ``pgid``."""
    members = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.add(int(entry.name))
    return members


# SIGINT to torchrun's process group (Ctrl-C) and SIGTERM to the agent (a scheduler's kill). The
# group holds the agent alone (checked below: torchrun starts each worker in a session of its
# own), so the Ctrl-C case also delivers exactly what SIGINT to the agent would: one launch
# covers both.
@pytest.mark.parametrize("name, target", [("INT", "process group"), ("TERM", "agent")])
def test_signal_to_torchrun_saves_stops_every_rank_and_resumes_bitwise(
    tmp_path, uninterrupted, name, target
):
    run_dir = tmp_path / "run"
    args = COMMON + [f"hydra.run.dir={run_dir}"]
    log = tmp_path / "stopped.log"
    agent = start_command(
        torchrun_command(args, nproc=2), cwd=tmp_path, log=log, env={"SDNET_TEST_STEP_DELAY": "0.3"}
    )
    workers: dict[int, str] = {}
    try:
        wait_until(
            lambda: (
                "step_00000002" in checkpoint_names(run_dir / "checkpoints")
                or agent.poll() is not None
            ),
            timeout=180,
            what="the first checkpoint",
        )
        assert agent.poll() is None, log.read_text()
        workers = child_processes(agent.pid)
        # Were a worker in the agent's group, a terminal's Ctrl-C would reach it too, besides
        # the agent's forwarded copy: that case would need a launch of its own.
        assert _process_group(agent.pid) == {agent.pid}, (workers, _process_group(agent.pid))
        signum = signal.Signals[f"SIG{name}"]
        if target == "agent":
            os.kill(agent.pid, signum)
        else:  # Ctrl-C in a terminal: the foreground process group, here torchrun's session
            os.killpg(agent.pid, signum)
        agent.wait(timeout=120)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        kill_processes(workers)
    output = log.read_text()

    lines = _stop_lines(output, f"SIG{name}")
    assert sorted(prefix for prefix, _ in lines) == ["", "[rank1]"], output  # one line per rank
    (stop,) = {step for _, step in lines}
    assert 2 <= stop < 12 and f"step_{stop:08d}" in checkpoint_names(run_dir / "checkpoints")
    # The workers exit with 128 + the signal; torchrun, signalled itself, raises its
    # SignalException after they are gone: exit status 1, with its own traceback.
    assert agent.returncode == 1, output
    assert "got signal: " in output
    assert "KeyboardInterrupt" not in output and "sdnet_trainer/" not in output, output

    resumed = run_cli(args, cwd=tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.output
    assert "resumed from" in resumed.output and f"step_{stop:08d}" in resumed.output
    got = _final(run_dir)
    for key, value in uninterrupted["params"].items():
        assert torch.equal(got["params"][key], value), key
    assert got["losses"] == uninterrupted["losses"][stop:]


@pytest.mark.parametrize("name, code", [("INT", EXIT_INTERRUPTED), ("TERM", EXIT_TERMINATED)])
def test_single_process_stops_with_a_checkpoint_and_the_signals_exit_code(tmp_path, name, code):
    run = run_cli(
        COMMON + [f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        # Received during step 2, agreed during step 3 (the verdict is read one step late).
        env={"SDNET_TEST_SIGNAL": f"0:2:{name}"},
    )
    assert run.returncode == code == 128 + signal.Signals[f"SIG{name}"], run.output
    assert _stop_lines(run.output, f"SIG{name}") == [("", 3)], run.output
    assert "Traceback" not in run.output and "KeyboardInterrupt" not in run.output
    assert "step_00000003" in checkpoint_names(tmp_path / "run" / "checkpoints")


def test_signal_to_one_worker_stops_the_other_at_the_same_step(tmp_path):
    run = run_cli(
        COMMON + [f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        nproc=2,
        env={"SDNET_TEST_SIGNAL": "1:2:INT"},  # agreed by both ranks during step 3
    )
    assert run.returncode != 0
    assert _stop_lines(run.output, "SIGINT") == [("[rank1]", 3)], run.output
    assert _stop_lines(run.output, "stop signal on another rank") == [("", 3)], run.output
    assert "step_00000003" in checkpoint_names(tmp_path / "run" / "checkpoints")
    assert "KeyboardInterrupt" not in run.output and "sdnet_trainer/" not in run.output


# ---------------------------------------------------------------------- StopSignals alone

# The scripts below run in fresh interpreters that load sdnet_trainer/runtime/signals.py from its
# file, under its own name: it imports only the standard library, and an interpreter that
# imported the package (torch, the CLI) would spend about 7 CPU-seconds before the first line.
LOAD_SIGNALS = f"""
import importlib.util, sys
_spec = importlib.util.spec_from_file_location(
    "sdnet_trainer.runtime.signals", {signals_module.__file__!r}
)
signals = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = signals
_spec.loader.exec_module(signals)
"""

REPEATS = """
import os, signal, sys, time

window = float(sys.argv[1])
with signals.StopSignals(repeat_after_s=window) as stop:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    print("first", stop.signum, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the same stop again: a launcher's forwarded copy
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    print("repeats ignored", flush=True)
    time.sleep(window)
    os.kill(os.getpid(), signal.SIGINT)  # the user insists
    time.sleep(20)
    print("still running", flush=True)
"""

# The main thread blocks both signals and sleeps inside C: no Python handler can run there, only
# the watcher thread (started before the block) sees the signals.
BLOCKED = """
import ctypes, os, signal, threading

with signals.StopSignals(repeat_after_s=0.5) as stop:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    pid = os.getpid()
    threading.Timer(0.2, os.kill, (pid, signal.SIGTERM)).start()
    threading.Timer(1.2, os.kill, (pid, signal.SIGTERM)).start()
    ctypes.CDLL(None).sleep(30)
    print("still running", flush=True)
"""


def _script(tmp_path, text: str, name: str = "script.py"):
    """``text`` after LOAD_SIGNALS, as a script: ``signals`` is the module under test."""
    path = tmp_path / name
    path.write_text(LOAD_SIGNALS + textwrap.dedent(text))
    return path


def test_a_repeat_within_the_window_is_ignored_a_later_one_ends_at_once(tmp_path):
    run = run_command(
        [sys.executable, str(_script(tmp_path, REPEATS)), "1.0"], cwd=tmp_path, timeout=60
    )
    assert run.returncode == EXIT_INTERRUPTED, run.output
    assert f"first {int(signal.SIGINT)}" in run.output and "repeats ignored" in run.output
    assert "ending at once, without a checkpoint" in run.output
    assert "still running" not in run.output and "Traceback" not in run.output


@LINUX
def test_a_repeat_ends_the_process_while_the_main_thread_is_stuck_in_c(tmp_path):
    run = run_command([sys.executable, str(_script(tmp_path, BLOCKED))], cwd=tmp_path, timeout=25)
    assert run.returncode == EXIT_TERMINATED, run.output
    assert "still running" not in run.output


def test_handlers_and_wakeup_fd_come_back_and_exit_codes(caplog):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    caplog.set_level(logging.WARNING)
    with StopSignals() as stop:
        assert not stop.received
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received and stop.signum == signal.SIGINT
        with pytest.raises(SystemExit) as leaving:
            stop.exit(7, saved=True)
    assert leaving.value.code == EXIT_INTERRUPTED == 130
    assert "SIGINT: stopped at step 7 after saving a checkpoint" in caplog.text
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.set_wakeup_fd(-1) == -1  # ours is gone (and none was set before)

    other_rank = StopSignals()  # the flag came from another rank through the step's agreement
    with pytest.raises(SystemExit) as leaving:
        other_rank.exit(4, saved=False)
    assert leaving.value.code == EXIT_TERMINATED == 143
    assert "stop signal on another rank: stopped at step 4" in caplog.text


# ---------------------------------------------------------------------- dying with the launcher

# A launcher (standing in for torchrun's agent) starts a worker and records its pid; the worker
# binds itself to the launcher, then sleeps.
LAUNCHER = """
import subprocess, sys, time
from pathlib import Path

worker = subprocess.Popen([sys.executable, sys.argv[1], *sys.argv[2:]])
print("worker", worker.pid, flush=True)
if sys.argv[2] == "stay":
    time.sleep(120)
else:  # leave once the worker has recorded its launcher, before it binds itself
    while not Path(sys.argv[3]).exists():
        time.sleep(0.05)
"""
WORKER = """
import os, sys, time
from pathlib import Path

Path(sys.argv[2]).write_text("imported")
if sys.argv[1] == "late":  # bind only once the launcher is gone: the race after the fork
    while os.getppid() == signals._PARENT_AT_IMPORT:
        time.sleep(0.05)
print("bound", signals.die_with_launcher(), flush=True)
Path(sys.argv[3]).write_text("bound")
time.sleep(120)
"""


def _launch(tmp_path, mode: str):
    launcher = tmp_path / "launcher.py"
    launcher.write_text(textwrap.dedent(LAUNCHER))
    worker = _script(tmp_path, WORKER, "worker.py")
    imported, bound, log = tmp_path / "imported", tmp_path / "bound", tmp_path / "log"
    # The worker gets the launcher's arguments after its own path: MODE IMPORTED BOUND.
    cmd = [sys.executable, str(launcher), str(worker), mode, str(imported), str(bound)]
    env = {"TORCHELASTIC_RUN_ID": "test"}
    return start_command(cmd, cwd=tmp_path, log=log, env=env), imported, bound, log


def _worker_pid(log) -> int:
    wait_until(lambda: "worker " in log.read_text(), timeout=30, what="the worker's pid")
    return int(re.search(r"worker (\d+)", log.read_text())[1])


@LINUX
def test_a_worker_dies_with_its_killed_launcher(tmp_path):
    launcher, imported, bound, log = _launch(tmp_path, "stay")
    worker: dict[int, str] = {}
    try:
        pid = _worker_pid(log)
        wait_until(bound.exists, timeout=60, what="the worker to bind itself")
        worker = {pid: process_command(pid) or ""}
        assert "bound True" in log.read_text()
        launcher.kill()
        launcher.wait(timeout=10)
        wait_until(lambda: process_command(pid) is None, timeout=10, what="the worker to die")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        kill_processes(worker)


@LINUX
def test_a_worker_whose_launcher_died_before_it_bound_itself_ends_at_once(tmp_path):
    launcher, imported, bound, log = _launch(tmp_path, "late")
    worker: dict[int, str] = {}
    try:
        pid = _worker_pid(log)
        worker = {pid: process_command(pid) or ""}
        launcher.wait(timeout=30)  # it leaves as soon as the worker is started
        wait_until(lambda: process_command(pid) is None, timeout=60, what="the worker to end")
        assert imported.exists() and not bound.exists(), log.read_text()
        assert "is gone: exiting" in log.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        kill_processes(worker)


def test_without_torchrun_nothing_is_bound(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert die_with_launcher() is False
