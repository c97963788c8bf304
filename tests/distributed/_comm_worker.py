"""Worker for tests/distributed/test_comm.py, on two ranks (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node=2 _comm_worker.py OUT_DIR

Plain torch DDP + GradientComm, no Trainer. One launch runs every scenario (starting processes is
the slow part) and rank 0 saves what the test checks to OUT_DIR/results.pt:

1. gradients: one backward on identical inputs under each of none/fp16/bf16, next to the
   uncompressed average computed by hand (an fp32 all-reduce of the local gradients) and the
   average of the gradients' magnitudes (the scale of the rounding error).
2. training: every hook trains the same model from the same start on the same per-rank data;
   losses on a shared held-out set, the payload each step actually handed to ``dist.all_reduce``
   (counted by wrapping it) next to ``bytes_per_step``, and under local SGD the largest difference
   between the two replicas' parameters after every step. PowerSGD also runs with DDP buckets
   small enough to split this model, where gloo could see the buckets' collectives out of order.
3. resume: PowerSGD (error feedback + warm start) trains, is checkpointed through
   CheckpointManager (DCP) with the comm state under a per-rank key, trains on; a fresh model,
   DDP wrapper and GradientComm load the checkpoint and train the same steps. DDP's bucket order
   differs between a fresh wrapper and a trained one for this model, so the memories must follow
   the parameters, not the bucket index.
4. nonfinite: PowerSGD skips a step whose gradients are NaN (one rank's loss) and trains on.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from sdnet_trainer.checkpoint import CheckpointManager
from sdnet_trainer.config.schema import CommConfig, LocalSGDConfig, PowerSGDConfig
from sdnet_trainer.distributed.comm import GradientComm
from sdnet_trainer.lazy import freeze_imports

IN, HIDDEN, CLASSES = 16, 64, 4
BATCH = 32  # per rank
STEPS = 60
LR = 0.1
SAMPLES = 1024  # per rank
# Training variants: (name, CommConfig).
VARIANTS = {
    "none": CommConfig(hook="none"),
    "fp16": CommConfig(hook="fp16"),
    "bf16": CommConfig(hook="bf16"),
    "powersgd": CommConfig(hook="powersgd", powersgd=PowerSGDConfig(rank=1, start_iter=2)),
    "local_sgd": CommConfig(hook="local_sgd", local_sgd=LocalSGDConfig(period=4, start_step=2)),
}
# Runs of a variant with DDP buckets of at most this many MB (several buckets for this model).
SMALL_BUCKETS = {"powersgd_buckets": ("powersgd", 0.004)}
RESUME_AT, RESUME_STEPS = 6, 6


class Net(nn.Module):
    """An MLP whose layers are registered in reverse order of use: DDP's initial buckets follow
    reverse registration order, its rebuilt ones the order gradients become ready, so the two
    differ (what the resume scenario needs)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.inp = nn.Linear(IN, HIDDEN)

    def forward(self, x):
        return self.head(F.relu(self.mid(F.relu(self.inp(x)))))


def task(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y) of this rank and a held-out (x, y) shared by all ranks: labels from a
    fixed random teacher network."""
    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(IN, 32, generator=teacher)
    w2 = torch.randn(32, CLASSES, generator=teacher)

    def draw(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, IN, generator=torch.Generator().manual_seed(seed))
        return x, (torch.tanh(x @ w1) @ w2).argmax(dim=1)

    return (*draw(SAMPLES, 100 + rank), *draw(512, 99))


def build(
    cfg: CommConfig, *, bucket_cap_mb: float = 25.0
) -> tuple[DistributedDataParallel, GradientComm, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DistributedDataParallel(Net(), bucket_cap_mb=bucket_cap_mb)
    comm = GradientComm(model, cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return model, comm, optimizer


class PayloadCounter:
    """Wraps dist.all_reduce (the comm hooks and the averager call it through the module) and adds
    up the bytes of every tensor passed to it."""

    def __init__(self) -> None:
        self.bytes = 0
        self._original = dist.all_reduce

    def __enter__(self) -> PayloadCounter:
        def counting(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._original

    def take(self) -> int:
        value, self.bytes = self.bytes, 0
        return value


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def replica_gap(model: nn.Module) -> float:
    """Largest absolute difference between the two ranks' parameters."""
    mine = flat_params(model)
    both = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(both, mine)
    return (both[0] - both[1]).abs().max().item()


def eval_loss(model: DistributedDataParallel, x: torch.Tensor, y: torch.Tensor) -> float:
    """Held-out loss, averaged over ranks (replicas differ between local SGD's averages)."""
    with torch.no_grad():
        loss = F.cross_entropy(model.module(x), y)
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def train_step(model, comm, optimizer, x, y, step: int) -> float:
    start = (step * BATCH) % SAMPLES
    xb, yb = x[start : start + BATCH], y[start : start + BATCH]
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    comm.after_optimizer_step(model.parameters())
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def gradients(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """Scenario 1: one backward per hook on the same inputs; the hand-made fp32 average."""
    torch.manual_seed(0)
    plain = Net()
    F.cross_entropy(plain(x[:BATCH]), y[:BATCH]).backward()
    local = [p.grad.detach().clone() for p in plain.parameters()]
    reference, magnitude = [], []
    for g in local:
        total, size = g.clone(), g.abs()
        dist.all_reduce(total)
        dist.all_reduce(size)
        reference.append(total / dist.get_world_size())
        magnitude.append(size / dist.get_world_size())
    out: dict[str, Any] = {"reference": reference, "magnitude": magnitude}
    for name in ("none", "fp16", "bf16"):
        model, _, _ = build(VARIANTS[name])
        F.cross_entropy(model(x[:BATCH]), y[:BATCH]).backward()
        out[name] = [p.grad.detach().clone() for p in model.parameters()]
    return out


def training(x, y, x_val, y_val) -> dict[str, Any]:
    """Scenario 2: every variant trains STEPS steps from the same start."""
    results: dict[str, Any] = {}
    runs = {name: (cfg, 25.0) for name, cfg in VARIANTS.items()}
    runs.update({name: (VARIANTS[variant], cap) for name, (variant, cap) in SMALL_BUCKETS.items()})
    for name, (cfg, bucket_cap_mb) in runs.items():
        model, comm, optimizer = build(cfg, bucket_cap_mb=bucket_cap_mb)
        run: dict[str, Any] = {
            "val_loss": [eval_loss(model, x_val, y_val)],
            "payload": [],
            "predicted": [],
            "gap": [],
            "synchronized": [],
            "steady_bytes": comm.bytes_per_step(),
        }
        with PayloadCounter() as counter:
            for step in range(1, STEPS + 1):
                train_step(model, comm, optimizer, x, y, step - 1)
                run["payload"].append(counter.take())
                run["predicted"].append(comm.bytes_per_step(step))
                if name == "local_sgd":
                    run["gap"].append(replica_gap(model))
                    run["synchronized"].append(comm.synchronized_after(step))
        run["val_loss"].append(eval_loss(model, x_val, y_val))
        run["state"] = {
            k: v
            for k, v in comm.state_dict().items()
            if k in ("hook_iter", "averager_step", "iter")
        }
        run["buckets"] = len(comm._layouts)
        results[name] = run
    return results


def resume(x, y, out_dir: Path) -> dict[str, Any]:
    """Scenario 3: exact resume of PowerSGD through a DCP checkpoint."""
    cfg = CommConfig(hook="powersgd", powersgd=PowerSGDConfig(rank=2, start_iter=2))
    rank = dist.get_rank()
    model, comm, optimizer = build(cfg)
    for step in range(RESUME_AT):
        train_step(model, comm, optimizer, x, y, step)
    trained_layout = dict(comm._layouts)
    manager = CheckpointManager(
        out_dir / "ckpt", keep_last=1, async_save=False, rank=rank, world_size=dist.get_world_size()
    )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    manager.save(
        RESUME_AT, {"model": model_sd, "optim": optim_sd, f"comm/rank{rank}": comm.state_dict()}
    )
    for step in range(RESUME_AT, RESUME_AT + RESUME_STEPS):
        train_step(model, comm, optimizer, x, y, step)
    uninterrupted = flat_params(model)

    resumed, layouts = resume_from(manager, cfg, x, y, load_comm=True)
    # The control: the same resume without the comm state must not match (so the check above
    # does depend on the restored memories).
    without, _ = resume_from(manager, cfg, x, y, load_comm=False)
    manager.close()
    return {
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "resumed_without_comm_state": without,
        "trained_layout": trained_layout,
        "first_resumed_layout": layouts[0],
        "later_resumed_layout": layouts[-1],
        "iter": comm._powersgd.iter,
    }


def resume_from(
    manager: CheckpointManager, cfg: CommConfig, x, y, *, load_comm: bool
) -> tuple[torch.Tensor, list[dict[int, tuple[int, ...]]]]:
    """Fresh model, DDP wrapper, GradientComm and optimizer (as in a new process), loaded from the
    latest checkpoint, trained RESUME_STEPS steps: the final parameters and the bucket layouts
    the hook saw after each step."""
    rank = dist.get_rank()
    torch.manual_seed(1)  # other initial weights, which the checkpoint must overwrite
    model = DistributedDataParallel(Net())
    comm = GradientComm(model, cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    optimizer.state.clear()  # as the Trainer does: no zero-lr step materialised
    state = {"model": model_sd, "optim": optim_sd, f"comm/rank{rank}": comm.state_dict()}
    manager.load(manager.latest(), state)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    if load_comm:
        comm.load_state_dict(state[f"comm/rank{rank}"])
    layouts = []
    for step in range(RESUME_AT, RESUME_AT + RESUME_STEPS):
        train_step(model, comm, optimizer, x, y, step)
        layouts.append(dict(comm._layouts))
    return flat_params(model), layouts


NAN_AT, NAN_STEPS = 4, 10


def nonfinite(x, y) -> list[float]:
    """Scenario 4: PowerSGD (error feedback and warm start) past its start, rank 1's loss NaN at
    step NAN_AT: the step is skipped as the Trainer skips it (no update, the hook's memories of
    that step discarded); the losses of every step, whose later ones must stay finite."""
    model, comm, optimizer = build(VARIANTS["powersgd"])
    losses = []
    for step in range(NAN_STEPS):
        start = (step * BATCH) % SAMPLES
        loss = F.cross_entropy(model(x[start : start + BATCH]), y[start : start + BATCH])
        if step == NAN_AT and dist.get_rank() == 1:
            loss = loss * float("nan")
        loss.backward()
        if step == NAN_AT:
            comm.discard_error_feedback()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    try:
        x, y, x_val, y_val = task(dist.get_rank())
        results = {
            "gradients": gradients(x, y),
            "training": training(x, y, x_val, y_val),
            "resume": resume(x, y, out_dir),
            "nonfinite": nonfinite(x, y),
        }
        if dist.get_rank() == 0:
            torch.save(results, out_dir / "results.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main()
