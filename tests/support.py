"""Shared test helpers: launching the real CLI, reading run outputs, recording Trainers."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from sdnet_trainer import HookBase, Trainer
from sdnet_trainer.distributed import all_reduce_sum
from sdnet_trainer.distributed.ddp import is_ddp, unwrap

REPO = Path(__file__).resolve().parents[1]
FINAL_STATE = "final.pt"

# The CPU tests' device, whatever the machine has: dist.device=auto would train on CUDA with NCCL
# on a GPU machine, and a second rank would ask for a GPU that a one-GPU machine lacks
# (tests/conftest.py also hides the GPUs from every process a CPU test starts). CUDA tests
# (tests/cuda/) ask for the GPU explicitly, so that a run silently on the CPU cannot pass.
CPU = ["dist.device=cpu"]
CUDA = ["dist.device=cuda"]

# Small, fast settings shared by the tests that train: a tiny CNN on 16x16 synthetic images, on
# the CPU (TINY) or on any device (TINY_RUN, with CPU or CUDA in front).
TINY_RUN = [
    "model=simple_cnn",
    "data.image_size=16",
    "data.train_size=256",
    "data.val_size=101",
    "optim.lr=0.05",
    "sched=constant",
    "logging.log_every_n_steps=2",
    "loop.eval_at_epoch_end=false",
]
TINY = [*CPU, *TINY_RUN]


@dataclass
class Launch:
    returncode: int
    output: str


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        HYDRA_FULL_ERROR="0",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    return env


def main_in_process(argv: list[str], monkeypatch, capfd) -> tuple[int, str]:
    """``python -m sdnet_trainer ARGV``'s exit code and output, through ``cli.main`` in this
    process: for runs that stop before training, without an interpreter's start-up. The test
    uses the main_in_this_process fixture (tests/conftest.py), which puts back what cli.main
    sets for a process (its logging, the collector's frozen generation)."""
    from sdnet_trainer import cli

    monkeypatch.setattr(sys, "argv", ["sdnet_trainer", *argv])
    try:
        cli.main()
        code = 0
    except SystemExit as ended:
        # The interpreter's rule: None is 0, an int itself, anything else (a message) 1.
        code = ended.code if isinstance(ended.code, int) else int(ended.code is not None)
    captured = capfd.readouterr()
    return code, captured.out + captured.err


def bench_main_in_process(
    name: str, argv: list[str], *, cwd: Path, monkeypatch, capfd
) -> tuple[int, str]:
    """``python scripts/bench/NAME.py ARGV`` run from ``cwd``: the exit code its ``main`` returns
    and its output, through that ``main`` in this process. For the tests of a benchmark's
    machinery, whose launches are processes of their own: they import this tree's package, as
    the tests' processes do. What main sets for its process (its folder on PYTHONPATH) is put
    back after the test, with the arguments and the directory."""
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "bench"))  # as when run as a script
    module = importlib.import_module(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    monkeypatch.setenv("PYTHONPATH", cli_env()["PYTHONPATH"])
    monkeypatch.chdir(cwd)
    code = module.main()
    captured = capfd.readouterr()
    return code, captured.out + captured.err


def run_cli(
    args: list[str],
    *,
    cwd: Path,
    nproc: int | None = None,
    script: Path | None = None,
    timeout: float = 240,
    torchrun_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    fork: bool = True,
) -> Launch:
    """``python -m sdnet_trainer ARGS`` (nproc None) or an ``nproc``-process world of it;
    ``script`` replaces ``-m sdnet_trainer``. By default each process is forked ready-imported
    (tests/forked.py: the ranks get the variables a scheduler sets, the exit code is the first
    failed rank's own). ``fork=False`` starts the command a user types instead, the interpreter or
    ``torchrun --standalone`` (a free port for its rendezvous), for the tests of the launcher and
    of the command itself. The whole process tree is killed on timeout."""
    if fork and not torchrun_args:
        from tests.forked import run_forked

        return run_forked(args, cwd=cwd, nproc=nproc, script=script, timeout=timeout, env=env)
    target = (str(script),) if script else ("-m", "sdnet_trainer")
    if nproc is None:
        cmd = [sys.executable, *target, *args]
    else:
        cmd = torchrun_command(args, nproc=nproc, torchrun_args=torchrun_args, target=target)
    return run_command(cmd, cwd=cwd, timeout=timeout, env=env)


def run_command(
    cmd: list[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> Launch:
    """Run ``cmd`` with the test environment, in its own session: a timeout kills the whole tree."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env={**cli_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except BaseException as exc:
        # The timeout, pytest-timeout's failure, a KeyboardInterrupt (scripts/ci/gpu_check.sh ends
        # pytest with SIGINT when its share runs out): the launch's session would outlive it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise AssertionError(
                f"timed out after {timeout} s: {' '.join(cmd)}\n{output}"
            ) from None
        raise
    return Launch(proc.returncode, output)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_metric(rows: list[dict], key: str) -> float:
    return [row[key] for row in rows if key in row][-1]


class IndexedDataset(Dataset):
    """Adds each sample's index to the sample, so a test can see which samples a rank trained on."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return (*self.dataset[index], index)


class StepCosts:
    """Counts the Python-level collectives (``torch.distributed.*`` calls) and host
    synchronisations (``Tensor.item``/``tolist``/``bool``/``float``/``int``) made while
    ``counting`` is on, by patching them for the process's lifetime. DDP's gradient all-reduces
    run in C++ and are not counted here (RecordingTrainer counts them with a comm hook)."""

    COLLECTIVES = [
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "reduce_scatter_tensor",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "gather",
        "gather_object",
        "reduce",
        "scatter",
        "send",
        "recv",
        "isend",
        "irecv",
        "all_to_all_single",
        "batch_isend_irecv",
        "monitored_barrier",
    ]
    HOST_SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__")

    _installed: StepCosts | None = None

    @classmethod
    def install(cls) -> StepCosts:
        """The process's one counter, reset: tests that build many Trainers in one process must
        not stack a wrapper per Trainer on every collective and tensor read."""
        if cls._installed is None:
            cls._installed = cls()
        counter = cls._installed
        counter.counting = False  # a step that raised may have left it on
        counter.take()
        return counter

    def __init__(self) -> None:
        self.counting = False
        self.collectives = self.host_syncs = 0
        for name in self.COLLECTIVES:
            setattr(torch.distributed, name, self._counted(getattr(torch.distributed, name), "c"))
        for name in self.HOST_SYNCS:
            setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name), "h"))

    def _counted(self, fn, kind: str):
        def counted(*args, **kwargs):
            if self.counting:
                if kind == "c":
                    self.collectives += 1
                else:
                    self.host_syncs += 1
            return fn(*args, **kwargs)

        return counted

    def take(self) -> tuple[int, int]:
        counts = (self.collectives, self.host_syncs)
        self.collectives = self.host_syncs = 0
        return counts


class _StepCostsHook(HookBase):
    """Last hook: closes the step's counting window (train_step and every hook before this)."""

    def __init__(self, trainer: RecordingTrainer) -> None:
        self.trainer = trainer

    def after_step(self, state, result) -> None:
        costs = self.trainer.costs
        costs.counting = False
        self.trainer.step_costs.append((state.step, *costs.take()))


class RecordingTrainer(Trainer):
    """Records the global loss of every step, the number of DDP gradient all-reduce calls and
    the Trainer's own collectives and host synchronisations per step (``StepCosts``), and saves
    them with the final parameters to ``final.pt`` (rank 0)."""

    def setup(self) -> None:
        self.costs = StepCosts.install()
        self.step_costs: list[tuple[int, int, int]] = []  # (step, collectives, host syncs)
        super().setup()
        # The loader works on host tensors before their copy to the device (a label's int() is
        # no synchronisation): it is not counted.
        next_batch = self.data.next_batch

        def uncounted_next_batch():
            counting, self.costs.counting = self.costs.counting, False
            try:
                return next_batch()
            finally:
                self.costs.counting = counting

        self.data.next_batch = uncounted_next_batch
        self.losses: list[float] = []
        self.allreduce_calls: list[int] = []  # per optimizer step
        self._calls = 0
        if is_ddp(self.model):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(state, bucket):
                self._calls += 1
                # DDP's own gradient all-reduce, issued from Python only because of this hook.
                counting, self.costs.counting = self.costs.counting, False
                try:
                    return allreduce_hook(state, bucket)
                finally:
                    self.costs.counting = counting

            self.model.register_comm_hook(None, counting_hook)

    def build_hooks(self):
        return [*super().build_hooks(), _StepCostsHook(self)]

    def train_step(self):
        self.costs.counting = True
        out = super().train_step()
        self.costs.counting = False  # this recording is the test's, not the Trainer's
        loss = all_reduce_sum(out.loss.detach().clone()) / self.env.world_size
        self.losses.append(loss.item())
        self.allreduce_calls.append(self._calls)
        self._calls = 0
        self.costs.counting = True  # the hooks' share, until _StepCostsHook
        return out

    def fit(self):
        metrics = super().fit()
        if self.env.is_main:
            params = {
                k: v.detach().cpu().clone() for k, v in unwrap(self.model).state_dict().items()
            }
            torch.save(
                {
                    "params": params,
                    "losses": self.losses,
                    "allreduce_calls": self.allreduce_calls,
                    "step_costs": self.step_costs,
                    "metrics": metrics,
                    "ema": {k: v.detach().cpu().clone() for k, v in self.ema.state_dict().items()}
                    if self.ema is not None
                    else {},
                },
                self.output_dir / FINAL_STATE,
            )
        return metrics


class FaultTrainer(RecordingTrainer):
    """Faults on request, for the resume tests. Environment variables (``RANK:STEP``):

    - ``SDNET_TEST_KILL_IN_UPLOAD``: SIGKILL that rank in the middle of the save of that step,
      once its own shard is written and before the save's last collective (under async_save, in
      the background while the loop goes on), on torchrun's first attempt only;
    - ``SDNET_TEST_SIGTERM``: deliver SIGTERM to that rank during that step;
    - ``SDNET_TEST_NAN``: make that rank's loss NaN on that step;
    - ``SDNET_TEST_SLEEP``: that rank hangs inside that step (600 s in ``compute_loss``), its
      last progress 2 s after its peers' so that theirs run out first.

    It also records the dataset indices each rank trained on, to ``seen_rank{R}.pt``, and uses a
    model with dropout so that random streams matter.
    """

    def build_model(self):
        return nn.Sequential(
            super().build_model(), nn.Dropout(float(os.environ.get("SDNET_TEST_DROPOUT", "0.2")))
        )

    def build_datasets(self):
        train, val = super().build_datasets()
        return IndexedDataset(train), val

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[int] = []

    def setup(self) -> None:
        super().setup()
        step = _fault("SDNET_TEST_KILL_IN_UPLOAD", self.env.rank)
        if step is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        from sdnet_trainer.checkpoint.files import step_name

        writer = self.checkpointer.manager._writer
        write_data = writer.write_data

        def killed_after_writing(plan, planner):
            written = write_data(plan, planner)
            if step_name(step) in str(writer.path):
                os.kill(os.getpid(), signal.SIGKILL)
            return written

        writer.write_data = killed_after_writing

    def compute_loss(self, batch):
        inputs, targets, indices = batch
        self.seen += indices.tolist()
        if _fault("SDNET_TEST_SLEEP", self.env.rank) == self.state.step + 1:
            # Progress 2 s after the peers' last: their watchdogs fire first, deterministically,
            # while they wait in a collective (on gloo a peer that exits first would instead end
            # that collective at once with "Connection closed by peer").
            time.sleep(2.0)
            if self.watchdog:
                self.watchdog.beat()
            time.sleep(600)
        if _fault("SDNET_TEST_SIGTERM", self.env.rank) == self.state.step + 1:
            os.kill(
                os.getpid(), signal.SIGTERM
            )  # arrives during the step, as a preemption notice would
        loss = super().compute_loss((inputs, targets))
        if _fault("SDNET_TEST_NAN", self.env.rank) == self.state.step + 1:
            loss = loss * math.nan
        return loss

    def fit(self):
        try:
            return super().fit()
        finally:
            torch.save(
                self.seen, self.output_dir / f"seen_rank{self.env.rank}_{os.getpid()}_{id(self)}.pt"
            )


def _fault(name: str, rank: int) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    fault_rank, step = (int(v) for v in value.split(":"))
    return step if fault_rank == rank else None


def seen_samples(run_dir: Path) -> list[int]:
    """Every dataset index trained on, over all ranks and all legs of a run."""
    return [i for path in sorted(run_dir.glob("seen_rank*.pt")) for i in torch.load(path)]


# ---------------------------------------------------------------------- signals and launchers
# Helpers for tests that act on a running launch from outside (signals, a killed torchrun agent)
# and for checkpoint errors: tests/distributed/test_signals.py and test_faults.py.


class SignalTrainer(FaultTrainer):
    """FaultTrainer plus (environment variables):

    - ``SDNET_TEST_STEP_DELAY``: sleep that many seconds in every step, so that a test acting
      from outside (a signal, a kill) finds the run mid-training;
    - ``SDNET_TEST_SIGNAL``: ``RANK:STEP:NAME``: that rank sends itself signal NAME (INT, TERM)
      during that step;
    - ``SDNET_TEST_CHECKPOINT_ERROR``: ``STEP``: the save of that step fails on every rank with
      the CheckpointError of a full disk.
    """

    def setup(self) -> None:
        super().setup()
        fail_at = os.environ.get("SDNET_TEST_CHECKPOINT_ERROR")
        if not fail_at:
            return
        from sdnet_trainer.checkpoint import CheckpointError

        manager = self.checkpointer.manager
        save = manager.save

        def failing_save(step, state_dict, **kwargs):
            if step == int(fail_at):
                raise CheckpointError(
                    f"cannot save step {step} to {manager.directory}: "
                    "OSError: [Errno 28] No space left on device"
                )
            return save(step, state_dict, **kwargs)

        manager.save = failing_save

    def compute_loss(self, batch):
        delay = float(os.environ.get("SDNET_TEST_STEP_DELAY", "0"))
        if delay:
            time.sleep(delay)
        request = os.environ.get("SDNET_TEST_SIGNAL")
        if request:
            rank, step, name = request.split(":")
            if (int(rank), int(step)) == (self.env.rank, self.state.step + 1):
                os.kill(os.getpid(), signal.Signals[f"SIG{name}"])
        return super().compute_loss(batch)


_PORTS = random.SystemRandom()


def free_port(count: int = 1) -> int:
    """A port p with p..p+count-1 free now, below the kernel's ephemeral range: ports from that
    range are handed out to every bind(0), gloo's and the rendezvous store's included, so one
    of them could take a port of ours between this probe and the bind of whoever it is for.
    Drawn from the operating system's randomness: the module-level random is seeded by every
    in-process run (seed_everything(0)), so two pytest workers that had each just run one drew
    the same port at the same time and one launch failed with EADDRINUSE."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        base = _PORTS.randrange(10000, max(low, 10000 + count + 1) - count)
        if all(_bindable(port) for port in range(base, base + count)):
            return base
    raise AssertionError(f"no {count} consecutive free ports")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def torchrun_command(
    args: list[str],
    *,
    nproc: int,
    torchrun_args: tuple[str, ...] = (),
    target: tuple[str, ...] = ("-m", "sdnet_trainer"),
) -> list[str]:
    """``torchrun --standalone`` (a free port for its rendezvous) running ``target``, by default
    ``-m sdnet_trainer``; run_cli launches the same command."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *torchrun_args,
        *target,
        *args,
    ]


def start_command(
    cmd: list[str], *, cwd: Path, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (its process group is the launcher's alone, as a
    terminal's foreground job is), output to ``log``. The caller ends it: ``kill_processes``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**cli_env(), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def process_command(pid: int) -> str | None:
    """The command line of a live (not zombie) process, or None."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):
            return None
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, IndexError):
        return None


def child_processes(pid: int) -> dict[int, str]:
    """Live children of ``pid``: their command lines by pid."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            command = process_command(int(entry.name))
            if command is not None:
                children[int(entry.name)] = command
    return children


def kill_processes(processes: dict[int, str]) -> None:
    """SIGKILL each process still running the command it was found with (a reused pid is not)."""
    for pid, command in processes.items():
        if process_command(pid) == command:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_until(condition, *, timeout: float, what: str, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def checkpoint_names(directory: Path) -> set[str]:
    """The committed checkpoint folders (``step_*``) in ``directory``."""
    if not directory.is_dir():
        return set()
    return {path.name for path in directory.iterdir() if path.name.startswith("step_")}


# ---------------------------------------------------------------------- object storage

# What a process needs to reach the local S3 server (with AWS_ENDPOINT_URL): moto accepts any
# credentials; the SDK needs some.
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing-key-id",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3Bucket:
    """A fresh bucket on the local S3 server (``url``: ``s3://NAME``); ``env`` reaches it from any
    process (credentials and AWS_ENDPOINT_URL, as a user's environment would), ``fs`` from this
    one (s3fs, as a run does)."""

    url: str
    endpoint: str
    env: dict[str, str]
    fs: Any

    def key(self, url: str) -> str:
        """The s3fs path of a URL in this bucket."""
        return url.removeprefix("s3://")


def new_bucket(endpoint: str) -> S3Bucket:
    """A bucket of a random name on the S3 server at ``endpoint``."""
    import uuid

    import s3fs

    fs = s3fs.S3FileSystem(
        endpoint_url=endpoint,
        key=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        skip_instance_cache=True,
    )
    name = f"bucket-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    env = {**S3_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    return S3Bucket(url=f"s3://{name}", endpoint=endpoint, env=env, fs=fs)


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """A real S3 API on 127.0.0.1 at a free port (moto's server, in a thread of this process):
    its endpoint URL. Its request log is left out of the test's output."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


# ---------------------------------------------------------------------- what a run was built as

PROBE_FILE = "probe_rank{rank}.json"


class ProbeTrainer(Trainer):
    """Records what the run was actually built as, so a test of the real CLI (``trainer._target_=
    tests.support.ProbeTrainer``) can check the layout rather than trust the config: each rank
    writes ``probe_rank{R}.json`` to its output directory after ``fit``."""

    def fit(self):
        metrics = super().fit()
        self.write_probe()
        return metrics

    def compute_loss(self, batch):
        # Where the training batches were when the model saw them (inputs and targets).
        if not hasattr(self, "batch_devices"):
            self.batch_devices: set[str] = set()
        self.batch_devices.update(str(t.device) for t in batch if isinstance(t, torch.Tensor))
        return super().compute_loss(batch)

    def write_probe(self) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        params = list(unwrap(self.model).parameters())
        conv = next((p for p in params if p.dim() == 4), None)
        probe = {
            "device": str(params[0].device),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "world_size": self.env.world_size,
            "model_class": type(self.model).__name__,
            "ddp": is_ddp(self.model),
            "fsdp": any(isinstance(m, FSDPModule) for m in self.model.modules()),
            "dtensor_params": sum(isinstance(p, DTensor) for p in params),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "optimizer_class": type(self.optimizer).__name__,
            # Module.compile (compile.enabled) sets _compiled_call_impl on each block it compiles.
            "compiled_modules": sum(
                getattr(m, "_compiled_call_impl", None) is not None for m in self.model.modules()
            ),
            # Graphs dynamo captured in this process: compilation did happen, not just wrapping.
            "dynamo_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
            "conv_weight_channels_last": (
                None if conv is None else conv.is_contiguous(memory_format=torch.channels_last)
            ),
            "skipped_steps": self.state.skipped_steps,
            "nonfinite_steps": self.state.nonfinite_steps,
            "steps": self.state.step,
            "batch_devices": sorted(getattr(self, "batch_devices", ())),
        }
        path = self.output_dir / PROBE_FILE.format(rank=self.env.rank)
        path.write_text(json.dumps(probe, indent=1))


def read_probe(run_dir: Path, rank: int = 0) -> dict:
    return json.loads((run_dir / PROBE_FILE.format(rank=rank)).read_text())


# ---------------------------------------------------------------------- CUDA tests: device check


def assert_on_cuda(*things: object) -> None:
    """Every CUDA test calls this (or asserts ``<x>.type == "cuda"`` itself) on what it trained
    or computed, so a run that fell back to the CPU fails instead of passing: the lint in
    tests/unit/test_cuda_test_lint.py checks that each test in tests/cuda/ does. Accepts tensors,
    modules (every parameter and buffer; at least one), devices, device strings (``"cuda:0"``,
    as a probe records them) and lists or sets of these (at least one item)."""
    for thing in things:
        if isinstance(thing, (list, tuple, set, frozenset)):
            assert thing, "nothing to check: an empty collection of devices"
            assert_on_cuda(*thing)
        elif isinstance(thing, nn.Module):
            tensors = [*thing.parameters(), *thing.buffers()]
            assert tensors, f"{type(thing).__name__} has no parameters or buffers"
            off = sorted({str(t.device) for t in tensors if t.device.type != "cuda"})
            assert not off, f"{type(thing).__name__} has tensors on {off}, not on CUDA"
        elif isinstance(thing, torch.Tensor):
            assert thing.device.type == "cuda", f"a tensor on {thing.device}, not on CUDA"
        elif isinstance(thing, (torch.device, str)):
            assert torch.device(thing).type == "cuda", f"{thing!r} is not a CUDA device"
        else:
            raise TypeError(f"assert_on_cuda cannot read a device from {type(thing).__name__}")


# ---------------------------------------------------------------------- real data, shards, HTTP
# The digits of scikit-learn (scripts/data/make_digits.py) as an ImageFolder, its shards, and a
# local HTTP server: tests/e2e/test_real_data.py and tests/distributed/test_data_resume.py.

DIGITS_TRAIN, DIGITS_VAL, DIGITS_CLASSES = 1437, 360, 10


def tiny_llama_config(**overrides: Any) -> Any:
    """A ``transformers.LlamaConfig`` of the tests' tiny Llama: width 32, 2 layers, 4 query heads
    over 2 key/value heads; ``overrides`` give the vocabulary, the MLP and context sizes and
    anything else a test varies. Built by transformers itself (the llm extra): nothing is
    downloaded."""
    import transformers

    sizes = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return transformers.LlamaConfig(**{**sizes, **overrides})


# The edited Hugging Face folders of lying_hf_folders, and what a refusal of each names (the
# tensor, the shapes, the file), whichever family reads it.
LYING_FOLDERS = {
    # config.json claims the model 2,048 times as wide (heads that divide it): 137 GB in fp32.
    "wider": [
        "model-00001-of-00003.safetensors: tensor model.embed_tokens.weight has shape [96, 32]",
        "[96, 65536]",
    ],
    # config.json's num_hidden_layers is one more than the files hold.
    "extra_layer": ["lacks tensors", "model.layers.2.self_attn.q_proj.weight"],
    # model.norm.weight stored as model.final_norm.weight.
    "renamed": ["lacks tensors", "model.norm.weight", "no place for: model.final_norm.weight"],
    # The last shard cut 100 bytes short.
    "truncated": ["model-00003-of-00003.safetensors is not a safetensors file"],
    # The index names a shard that is not in the folder.
    "missing_shard": ["model-00001-of-00003.safetensors does not exist (named by the index)"],
}


def lying_hf_folders(root: Path) -> dict[str, Path]:
    """A tiny Llama saved by transformers in two shards with their index (``root/ok``), and a
    copy of it edited as a user's wrong or altered folder would be (``LYING_FOLDERS``)."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=96, intermediate_size=48, max_position_embeddings=64)
    ok = root / "ok"
    transformers.LlamaForCausalLM(config).save_pretrained(ok, max_shard_size="40KB")
    index = json.loads((ok / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2, shards
    folders = {}
    for name in LYING_FOLDERS:
        folders[name] = root / name
        shutil.copytree(ok, folders[name])
    config_file = folders["wider"] / "config.json"
    wider = json.loads(config_file.read_text())
    wider.update(
        hidden_size=65536,
        num_attention_heads=4096,
        num_key_value_heads=4096,
        head_dim=16,
    )
    config_file.write_text(json.dumps(wider))
    config_file = folders["extra_layer"] / "config.json"
    deeper = json.loads(config_file.read_text())
    deeper["num_hidden_layers"] += 1
    config_file.write_text(json.dumps(deeper))
    renamed = folders["renamed"]
    shard = index["weight_map"]["model.norm.weight"]
    tensors = load_file(renamed / shard)
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, renamed / shard, metadata={"format": "pt"})
    weight_map = dict(index["weight_map"])
    weight_map["model.final_norm.weight"] = weight_map.pop("model.norm.weight")
    renamed_index = {**index, "weight_map": weight_map}
    (renamed / "model.safetensors.index.json").write_text(json.dumps(renamed_index))
    cut = folders["truncated"] / shards[-1]
    os.truncate(cut, cut.stat().st_size - 100)
    (folders["missing_shard"] / shards[0]).unlink()
    return {"ok": ok, **folders}


def make_digits(out: Path, *, size: int = 16, timeout: float = 120) -> Path:
    """``out`` made an ImageFolder of the digits by ``scripts/data/make_digits.py`` (its command
    line, as a user runs it): ``out/train/<class>/*.png`` (1,437) and ``out/val/<class>/*.png``
    (360), RGB PNG of ``size`` px."""
    made = run_command(
        [
            sys.executable,
            str(REPO / "scripts" / "data" / "make_digits.py"),
            str(out),
            f"--size={size}",
        ],
        cwd=out.parent,
        timeout=timeout,
    )
    assert made.returncode == 0, made.output
    return out


def convert_to_shards(src: Path, out: Path, *, shard_size: int) -> Path:
    """``src`` (an ImageFolder) written as shards under ``out`` by the converter's command line
    (``python -m sdnet_trainer.data.shards``'s ``main``, called in this process: the command
    itself is tested in tests/e2e/test_shards_cli.py)."""
    from sdnet_trainer.data.shards.cli import main as convert

    assert convert([str(src), str(out), f"shard_size={shard_size}"]) == 0
    return out


def image_folder_to_hf(src: Path, out: Path) -> Path:
    """The ImageFolder ``src`` saved as a Hugging Face ``DatasetDict`` (``save_to_disk``) under
    ``out``: splits ``train`` and ``validation`` with an ``Image`` column of the files' bytes and
    a ``ClassLabel``, rows in ImageFolder's order (row ``i`` is the folder's sample ``i``)."""
    import datasets
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    classes, class_to_idx = find_classes(str(src / "train"))
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)}
    )
    splits = {}
    for split, name in (("train", "train"), ("val", "validation")):
        samples = make_dataset(str(src / split), class_to_idx, extensions=IMG_EXTENSIONS)
        table = {
            "image": [{"bytes": Path(path).read_bytes(), "path": None} for path, _ in samples],
            "label": [label for _, label in samples],
        }
        splits[name] = datasets.Dataset.from_dict(table, features=features)
    progress = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        datasets.DatasetDict(splits).save_to_disk(str(out))
    finally:
        if progress:
            datasets.enable_progress_bars()
    return out


# A language nothing needs to download: a byte-level BPE tokenizer trained on generated lines
# (tests/unit/test_text_data.py, tests/distributed/test_data_resume.py).
EOS_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
_SENTENCE = "the cat sat on a mat while dogs ran far away from home and birds sang loud"
_WORDS = _SENTENCE.split()


def corpus_line(i: int) -> str:
    """Line ``i`` of the generated corpus: 4 to 8 of its 17 words."""
    return " ".join(_WORDS[(i * 7 + k * 3) % len(_WORDS)] for k in range(4 + i % 5))


def write_bpe_tokenizer(folder: Path, *, template: str | None) -> Path:
    """A byte-level BPE of 300 tokens (EOS, then the ChatML markers, as ids 0, 1, 2) trained on
    the corpus, saved as transformers saves one: ``tokenizer.json`` and a
    ``tokenizer_config.json`` naming EOS and ``template`` (the chat template; None: none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([corpus_line(i) for i in range(200)], trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {"eos_token": EOS_TOKEN, "bos_token": None}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@contextlib.contextmanager
def http_server(directory: Path) -> Iterator[str]:
    """``directory`` served read-only over HTTP on a free port of 127.0.0.1 by aiohttp (range
    requests, directory listings for fsspec's glob), from a thread of this process; yields the
    base URL. Processes the test starts read from it too."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_static("/", directory, show_index=True)
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, name="http_server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


# ---------------------------------------------------------------------- a GPU image's Python
# scripts/ci/gpu_check.sh runs on GPU nodes whose Python comes with torch and most of what the
# project uses, but not Hydra: tests/unit/test_gpu_check_offline.py simulates such a Python here.

# Top-level names (packages, modules, distributions, normalized) that a GPU image's Python lacks.
GPU_IMAGE_LACKS = frozenset(
    {
        "hydra",
        "hydra_core",
        "hydra_plugins",
        "hydra_submitit_launcher",
        "hydra_optuna_sweeper",
        "omegaconf",
        "antlr4",
        "antlr4_python3_runtime",
        "fastapi",
        "uvicorn",
        "python_multipart",
        "multipart",
        "mlflow",
        "mlflow_skinny",
        "ruff",
        "mypy",
        "mypyc",
        "sdnet_trainer",
        # Nor these, which no CUDA test needs (torchao comes from the wheel folder).
        "torchao",
        "torchft",
        "openai",
        "s3fs",
        "moto",
    }
)


def _site_entry_name(name: str) -> str:
    """``hydra_core-1.3.8.dist-info`` -> ``hydra_core``; ``omegaconf`` -> ``omegaconf``."""
    for suffix in (".dist-info", ".egg-info", ".egg-link", ".pth", ".py"):
        name = name.removesuffix(suffix)
    return name.split("-")[0].lower().replace(".", "_")


def gpu_image_python(root: Path, *, lacking: frozenset[str] = GPU_IMAGE_LACKS) -> Path:
    """A Python, ``root/venv/bin/python``, that sees the packages of the site-packages folder this
    process's torch comes from, except ``lacking`` and every editable install: a symlink for each
    kept entry in ``root/site``, added by a ``.pth`` as a site folder (its ``.pth`` files run).
    pip comes from there too. Returns the interpreter's path."""
    source = Path(torch.__file__).resolve().parents[1]
    site = root / "site"
    site.mkdir(parents=True)
    for entry in source.iterdir():
        name = _site_entry_name(entry.name)
        if name in lacking or entry.name.startswith("__editable__") or name == "__pycache__":
            continue
        (site / entry.name).symlink_to(entry)
    venv = root / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    own_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    (Path(own_site) / "_gpu_image.pth").write_text(f"import site; site.addsitedir({str(site)!r})\n")
    return python


CHAT_VOCAB = 320  # chat_data's tokenizer's vocabulary


def chat_data(folder: Path, *, conversations: int) -> list[str]:
    """Chat data whose windows count very different numbers of targets (the prompts' are -100):
    ``conversations`` of a long prompt and a one-word answer or the reverse, a BPE tokenizer with
    ChatML's template (written once into ``folder``); the overrides that train on them in windows
    of 32 tokens."""
    from sdnet_trainer.data.chat import TEMPLATES

    tokenizer, chats = folder / "chat_tokenizer", folder / "chat.jsonl"
    if not chats.exists():
        write_bpe_tokenizer(tokenizer, template=TEMPLATES["chatml"])
        with chats.open("w") as f:
            for i in range(conversations):
                long = " ".join(corpus_line(i + k) for k in range(4))
                short = corpus_line(i).split()[0]
                user, assistant = (long, short) if i % 2 else (short, long)
                messages = [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": assistant},
                ]
                f.write(json.dumps({"messages": messages}) + "\n")
    return [
        "data=chat",
        f"data.root={chats}",
        f"data.tokenizer={tokenizer}",
        f"data.vocab_size={CHAT_VOCAB}",
        "data.seq_len=32",
    ]
