"""Runs several parallel layouts in one process group, through the real Trainer.

    torchrun --standalone --nproc_per_node=N tests/distributed/_layout_worker.py OUT CASES_JSON
    python tests/distributed/_layout_worker.py OUT CASES_JSON    (the single-process reference)

CASES_JSON maps a case name to its config overrides. Each case trains with ``LayoutRecorder`` and
rank 0 saves ``OUT/<name>.pt``: the global loss and gradient norm of every step, the full final
parameters (gathered from shards, tensor-parallel pieces and pipeline stages), the final eval
metrics and every rank's training-state bytes. One launch serves many layouts: starting a process
group costs more than training these tiny models.

A case named ``hf_load*`` (with ``model.weights=hf:PATH``) only sets up (the load is what it
checks) and records, per rank, whether each local shard equals its slice of the Hugging Face file
and the whole tensor its file tensor, and the peak resident memory the set-up added.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import Config, DistConfig
from sdnet_trainer.distributed import DistEnv, all_reduce_sum, distributed_session
from sdnet_trainer.distributed.ops import all_gather_objects
from sdnet_trainer.distributed.reduction import StepReduction
from sdnet_trainer.lazy import freeze_imports
from sdnet_trainer.models.hf_folder import hf_weights_folder, weight_files
from sdnet_trainer.models.llama.hf import to_hf_name
from sdnet_trainer.observability.memory import training_state_bytes
from sdnet_trainer.plan.auto import resolve_auto
from sdnet_trainer.preflight import validate


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())[1])


def gather_on_main(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's named tensors merged on rank 0 (the other ranks get theirs back): pipeline
    stages hold different names, data-parallel ranks the same full tensors, so each name is sent
    once, by the lowest rank holding it, to rank 0 alone (not every rank's copy to every rank)."""
    holders = all_gather_objects(sorted(local))
    if len(holders) == 1:
        return local
    sender: dict[str, int] = {}
    for rank, names in enumerate(holders):
        for name in names:
            sender.setdefault(name, rank)
    rank = dist.get_rank()
    mine = {name: value for name, value in local.items() if sender[name] == rank}
    parts: list[Any] | None = [None] * len(holders) if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if parts is None:
        return local
    return {name: value for part in parts for name, value in part.items()}


def _linear_types(model: torch.nn.Module) -> dict[str, tuple[str, str]]:
    """Each Linear layer's class and its weight's class on this rank (a DTensor's local tensor):
    which layers float8 converted, and which weights FSDP gathers in float8."""
    types = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
            local = weight._local_tensor if isinstance(weight, DTensor) else weight
            types[name] = (type(module).__name__, type(local).__name__)
    return types


# Cases named so check the Hugging Face load under their layout and train nothing.
LOAD_ONLY = "hf_load"


class LayoutRecorder(Trainer):
    def setup(self) -> None:
        load_only = self.output_dir.name.startswith(LOAD_ONLY)
        self.hf_folder = hf_weights_folder(self.cfg.model.weights) if load_only else None
        if self.hf_folder is not None:
            Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from now
            before = _status_kib("VmRSS")
        super().setup()
        if self.hf_folder is not None:
            self.setup_peak_bytes = (_status_kib("VmHWM") - before) * 1024
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def fit(self) -> dict[str, float]:
        if self.output_dir.name.startswith(LOAD_ONLY):
            self.setup()  # the Hugging Face load is the check: no training
            return {}
        return super().fit()

    def train_step(self):
        out = super().train_step()
        pair = torch.stack(
            [
                out.loss.detach().float() * self.metric_weight,
                torch.tensor(self.metric_weight, device=self.device),
            ]
        )
        loss, weight = all_reduce_sum(pair).tolist()
        self.losses.append(loss / weight)
        self.grad_norms.append(float(out.grad_norm))
        return out

    def record(self, metrics: dict[str, float]) -> dict:
        if self.hf_folder is not None:
            return self.record_hf_load()
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        params = gather_on_main({k: v.detach().float().cpu() for k, v in state.items()})
        ema: dict[str, torch.Tensor] = {}
        if self.ema is not None:
            ema = gather_on_main(
                {
                    k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu()
                    for k, v in self.ema.state_dict().items()
                }
            )
        return {
            "losses": self.losses,
            "ema": ema,
            "grad_norms": self.grad_norms,
            "metrics": metrics,
            "params": params,
            "layout": {
                k: getattr(self.cfg.parallel, k)
                for k in ("strategy", "dp_replicate", "dp_shard", "tp", "pp")
            },
            "state_bytes": all_gather_objects(training_state_bytes(self.model, self.optimizer)),
            "linear_types": _linear_types(self.model),
        }

    def record_hf_load(self) -> dict:
        """Each parameter's local shard against the file read whole (safetensors' load_file,
        not the loader's lazy slices), and the gathered tensor against the file tensor."""
        from safetensors.torch import load_file
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        assert self.hf_folder is not None
        files = weight_files(self.hf_folder)
        stored: dict[str, torch.Tensor] = {}
        for file in sorted(set(files.values())):
            stored.update(load_file(self.hf_folder / file))
        shards_equal, full_equal, local_bytes = [], [], 0
        for name, param in self.model.state_dict().items():
            expected = stored[to_hf_name(name)]
            assert isinstance(param, DTensor), name  # FSDP x TP: every parameter is sharded
            local = param.to_local()
            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements
            )
            block = expected[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
            shards_equal.append(torch.equal(local, block) and local.numel() < expected.numel())
            full_equal.append(torch.equal(param.full_tensor(), expected))
            local_bytes += local.numel() * local.element_size()
        model_bytes = sum(t.numel() * t.element_size() for t in stored.values())
        return {
            "hf_load": all_gather_objects(
                {
                    "shards_equal": all(shards_equal) and len(shards_equal) == len(stored),
                    "full_equal": all(full_equal),
                    "peak_bytes": self.setup_peak_bytes,
                    "local_bytes": local_bytes,
                    "model_bytes": model_bytes,
                }
            )
        }


# Cases named so train with the step's reduction contract's gradient divisor doubled: a reducer
# that reads it (FSDP2, HSDP, expert parallel) divides by it as the loss weights multiply by it,
# so the step is unchanged; one whose divisor torch fixes (DDP's group size; none without a
# reducer) is refused by the contract's check before training.
DIVISOR_TWICE = "_divisor2"


@contextmanager
def divisor_scaled(factor: int) -> Iterator[None]:
    original = StepReduction.gradient_divisor
    if factor != 1:
        StepReduction.gradient_divisor = property(lambda self: factor * self.batch_ranks)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        StepReduction.gradient_divisor = original  # type: ignore[method-assign]


def run_cases(out: Path, cases: dict[str, list[str]], recorder: type[Trainer]) -> None:
    """Train every case in one process group, each with a Trainer of class ``recorder`` (whose
    ``record(fit_result)`` says what to keep); rank 0 saves each record as ``out/<case>.pt``.

    Rank 0 composes each case's config and sends it to the others: every rank would compose the
    same config from the same overrides (most of a second each, times ranks, times cases).
    A ``parallel=auto`` case is planned by every rank before the process group starts, as the
    command line plans it (the planner's dry run runs on a fake process group of its own)."""
    out.mkdir(parents=True, exist_ok=True)
    planned = {name: _planned(o, out / name) for name, o in cases.items() if "parallel=auto" in o}
    with distributed_session(DistConfig()) as env:
        for name, overrides in cases.items():
            cfg = planned[name] if name in planned else composed_on_main(overrides, env)
            validate(cfg, world_size=env.world_size)
            trainer = recorder(cfg, output_dir=out / name, env=env)
            try:
                with divisor_scaled(2 if name.endswith(DIVISOR_TWICE) else 1):
                    record = trainer.record(trainer.fit())  # type: ignore[attr-defined]
            except RuntimeError as refusal:
                if not name.endswith(DIVISOR_TWICE):
                    raise
                record = {"refused": str(refusal)}  # a reducer that checks the divisor
            finally:
                trainer.close()
            if env.is_main:
                torch.save(record, out / f"{name}.pt")


def _planned(overrides: list[str], run_dir: Path) -> Config:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return resolve_auto(
        compose(overrides),
        world_size,
        checkpoint_dir=run_dir / "checkpoints",
        device=torch.device("cpu"),
    )


def composed_on_main(overrides: list[str], env: DistEnv) -> Config:
    """The config of ``overrides``, composed by rank 0 alone and broadcast to every rank (every
    rank would compose the same one, most of a second each)."""
    cfg = [compose(overrides) if env.is_main else None]
    if env.world_size > 1:
        dist.broadcast_object_list(cfg, src=0)
    assert cfg[0] is not None
    return cfg[0]


def main(out: Path, cases: dict[str, list[str]]) -> None:
    run_cases(out, cases, LayoutRecorder)


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
