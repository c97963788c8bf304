"""Shared test helpers: launching the real CLI, reading run outputs, recording Trainers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from sdnet_trainer import Trainer
from sdnet_trainer.distributed import all_reduce_sum
from sdnet_trainer.distributed.ddp import is_ddp, unwrap

REPO = Path(__file__).resolve().parents[1]
FINAL_STATE = "final.pt"

# Small, fast settings shared by the tests that train: a tiny CNN on 16x16 synthetic images.
TINY = ["model=simple_cnn", "data.image_size=16", "data.train_size=256", "data.val_size=101",
        "optim.lr=0.05", "sched=constant", "logging.log_every_n_steps=2", "loop.eval_at_epoch_end=false"]


@dataclass
class Launch:
    returncode: int
    output: str


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    return env


def run_cli(args: list[str], *, cwd: Path, nproc: int | None = None, script: Path | None = None,
            timeout: float = 240) -> Launch:
    """Run ``python -m sdnet_trainer`` (nproc None) or ``torchrun --standalone`` with ``nproc``
    processes; ``script`` replaces ``-m sdnet_trainer``. The whole process tree is killed on
    timeout. torchrun's --standalone picks a free port for its rendezvous."""
    target = [str(script)] if script else ["-m", "sdnet_trainer"]
    if nproc is None:
        cmd = [sys.executable, *target, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", *target, *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n{output}") from None
    return Launch(proc.returncode, output)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_metric(rows: list[dict], key: str) -> float:
    return [row[key] for row in rows if key in row][-1]


class RecordingTrainer(Trainer):
    """Records the global loss of every step and the number of DDP gradient all-reduce calls,
    and saves them with the final parameters to ``final.pt`` (rank 0)."""

    def setup(self) -> None:
        super().setup()
        self.losses: list[float] = []
        self.allreduce_calls: list[int] = []  # per optimizer step
        self._calls = 0
        if is_ddp(self.model):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(state, bucket):
                self._calls += 1
                return allreduce_hook(state, bucket)

            self.model.register_comm_hook(None, counting_hook)

    def train_step(self):
        out = super().train_step()
        loss = all_reduce_sum(out["loss"].detach().clone()) / self.env.world_size
        self.losses.append(loss.item())
        self.allreduce_calls.append(self._calls)
        self._calls = 0
        return out

    def fit(self):
        metrics = super().fit()
        if self.env.is_main:
            params = {k: v.detach().cpu().clone() for k, v in unwrap(self.model).state_dict().items()}
            torch.save({"params": params, "losses": self.losses, "allreduce_calls": self.allreduce_calls,
                        "metrics": metrics}, self.output_dir / FINAL_STATE)
        return metrics
