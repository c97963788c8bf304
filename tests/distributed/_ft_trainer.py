"""The Trainer the fault-tolerance tests launch (``trainer._target_``): it records what each
committed step trained and where the parameters went, and faults on request.

Records, in the run directory: ``committed_rankR.jsonl`` (one line per committed step: the
step, the dataset indices rank R trained, the loss, and how the step's bucketed gradients
compared with the flat reduction of the same gradients, run just before them in every group:
``flat_bitwise``, ``flat_diff`` the largest difference, ``grad_max`` the largest gradient;
appended and flushed, so a SIGKILL keeps every committed step), and ``ft_final.pt`` at the end
(the final parameters and optimizer state, the parameters after each step, the run's metrics).

Under FSDP the recorded parameters and optimizer state are gathered whole (every rank takes
part; rank 0 writes ``ft_final.pt``).

Environment: ``SDNET_FT_KILL_AT=S`` SIGKILLs this process during step S as its gradients start
crossing the groups (the other groups are then entering the same all-reduce), and its group's
other ranks first (under torchrun its agent, the other ranks dying with it by their parent-death
signal; forked ranks, tests/forked.py, by the pids they wrote at setup): the whole group dies at
once, as when a node is pulled; ``SDNET_FT_FREEZE=S:SECONDS`` stops this process
(SIGSTOP, every thread: its heartbeats too) during step S for SECONDS, then lets it go on
(SIGCONT), as a slow but live group;
``SDNET_FT_PAUSE=S:PATH`` waits after step S until PATH exists;
``SDNET_FT_READY=PATH`` is written once set up, before the first quorum;
``SDNET_FT_START=PATH,...`` then waits until every one of those files exists (so that groups
launched together are all in the first quorum).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from sdnet_trainer import HookBase, Trainer
from sdnet_trainer.distributed.ddp import unwrap
from sdnet_trainer.ft.room import reduce_in_buckets
from sdnet_trainer.runtime.signals import launched_by_torchrun
from tests.support import IndexedDataset

RECORD, FINAL, PID = "committed_rank{rank}.jsonl", "ft_final.pt", "pid_rank{rank}"
ALL_AT_ONCE = 2**62  # a bucket as large as every gradient: the flat reduction
PAUSE_LIMIT_S = 240.0


def _wait_for(paths: list[Path]) -> None:
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{paths} did not all appear")
        time.sleep(0.05)


def _full(tree: object) -> object:
    """``tree`` with every DTensor (FSDP's shards) gathered whole: collective, on every rank."""
    if isinstance(tree, DTensor):
        return tree.full_tensor()
    if isinstance(tree, dict):
        return {key: _full(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_full(value) for value in tree]
    return tree


def _tensors(state: dict) -> dict:
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return {k: v.detach().cpu().clone() for k, v in _full(state).items()}


class _Recorder(HookBase):
    def __init__(self, trainer: FTRecorder) -> None:
        self.trainer = trainer
        path = trainer.output_dir / RECORD.format(rank=trainer.env.rank)
        self.file = open(path, "a")  # noqa: SIM115 (closed in close)
        pause = os.environ.get("SDNET_FT_PAUSE")
        self.pause = (int(pause.split(":", 1)[0]), Path(pause.split(":", 1)[1])) if pause else None

    def after_step(self, state, result) -> None:
        t = self.trainer
        row = {
            "step": state.step,
            "indices": t.indices,
            "loss": float(result.loss),
            "time": time.time(),
            **t.flat_check,
        }
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        t.snapshots.append(_tensors(unwrap(t.model).state_dict()))
        if self.pause is not None and state.step == self.pause[0]:
            _wait_for([self.pause[1]])

    def close(self) -> None:
        self.file.close()


class FTRecorder(Trainer):
    def build_datasets(self):
        train, val = super().build_datasets()
        return IndexedDataset(train), val

    def setup(self) -> None:
        self.indices: list[int] = []
        self.snapshots: list[dict] = []
        self.flat_check: dict = {}
        self.kill_at = int(os.environ.get("SDNET_FT_KILL_AT", "0"))
        self.agent = os.getppid() if launched_by_torchrun() else None
        super().setup()
        if self.kill_at:  # the group's pids, for _die
            (self.output_dir / PID.format(rank=self.env.rank)).write_text(str(os.getpid()))
        if ready := os.environ.get("SDNET_FT_READY"):
            Path(ready).write_text("set up")
        if start := os.environ.get("SDNET_FT_START"):
            _wait_for([Path(path) for path in start.split(",")])

    def build_hooks(self):
        return [*super().build_hooks(), _Recorder(self)]

    def _setup_fault_tolerance(self) -> None:
        super()._setup_fault_tolerance()
        ft = self.cfg.fault_tolerance
        if ft.enabled and ft.mode == "sync":
            room = self.source.room  # type: ignore[attr-defined]  # FaultTolerantSource
            room.reduce_gradients = self._against_flat(room)
        if self.kill_at:
            room = self.source.room  # type: ignore[attr-defined]  # FaultTolerantSource
            reduce_gradients = room.reduce_gradients

            def dying(model):
                if self.state.step + 1 == self.kill_at:
                    self._die()
                reduce_gradients(model)

            room.reduce_gradients = dying

    def _against_flat(self, room):
        """The room's bucketed reduction, preceded by the flat one (one bucket holding every
        gradient, as the room reduced before buckets) of the same gradients; the two results
        compared (the weights follow from the gradients, so equal gradients every step are equal
        weights). Every group does both, so the collectives pair up."""
        bucketed = room.reduce_gradients

        @torch.no_grad()
        def reduce(model):
            grads = room.local_gradients(model)
            before = [g.clone() for g in grads]
            reduce_in_buckets(grads, room.manager.allreduce, bucket_bytes=ALL_AT_ONCE)
            flat = [g.clone() for g in grads]
            for g, b in zip(grads, before, strict=True):
                g.copy_(b)
            bucketed(model)
            grads = room.local_gradients(model)
            self.flat_check = {
                "flat_bitwise": all(map(torch.equal, grads, flat)),
                "flat_diff": max(
                    float((g - f).abs().max()) for g, f in zip(grads, flat, strict=True)
                ),
                "grad_max": max(float(f.abs().max()) for f in flat),
            }

        return reduce

    def _die(self) -> None:
        # torchrun's agent first (still this process's parent): the whole launch dies, its other
        # ranks with the agent (their parent-death signal).
        if self.agent is not None and os.getppid() == self.agent:
            os.kill(self.agent, signal.SIGKILL)
        elif self.agent is None:
            # Forked ranks have no common parent: this rank kills its group's others (each in a
            # session of its own, with its loader workers), which reach this point at the same
            # step anyway, then itself.
            for path in self.output_dir.glob(PID.format(rank="*")):
                pid = int(path.read_text())
                if pid != os.getpid():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def count_targets(self, batch):
        return super().count_targets(batch[:2])  # without the samples' indices

    def compute_loss(self, batch):
        inputs, targets, index = batch
        self.indices = index.tolist()
        freeze = os.environ.get("SDNET_FT_FREEZE")
        if freeze and self.state.step + 1 == int(freeze.split(":")[0]):
            seconds = float(freeze.split(":")[1])
            pid = os.getpid()  # a process cannot wake itself: a shell stops and continues it
            subprocess.Popen(
                ["/bin/sh", "-c", f"kill -STOP {pid}; sleep {seconds}; kill -CONT {pid}"]
            )
            time.sleep(seconds + 0.5)  # stopped in here
        return self.loss_fn(self.model(inputs), targets)

    def fit(self):
        metrics = super().fit()
        params = _tensors(unwrap(self.model).state_dict())  # whole, under FSDP too
        optim = _full(self.optimizer.state_dict())
        if self.env.is_main:
            final = {
                "params": params,
                "optim": optim,
                "snapshots": self.snapshots,
                "metrics": metrics,
            }
            torch.save(final, self.output_dir / FINAL)
        return metrics
