"""FSDP2 with gradient accumulation, through the real Trainer: one case per config.

    torchrun --standalone --nproc_per_node=N tests/distributed/_fsdp_accum_worker.py OUT CASES_JSON
    python tests/distributed/_fsdp_accum_worker.py OUT CASES_JSON    (the single-process reference)

CASES_JSON maps a case name to its config overrides. Rank 0 saves ``OUT/<name>.pt``: every step's
global loss, the full final parameters, and what each rank held after the first micro-step's
backward of every step (read as the second micro-step starts): per parameter, whether its
``.grad`` is set, and the numbers of elements of this rank's gradient and of the full gradient.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from sdnet_trainer import Trainer
from sdnet_trainer.distributed import all_reduce_sum
from sdnet_trainer.distributed.ops import all_gather_objects
from sdnet_trainer.lazy import freeze_imports
from tests.distributed._layout_worker import run_cases


class AccumulationRecorder(Trainer):
    def setup(self) -> None:
        super().setup()
        self.losses: list[float] = []
        self.after_first_microstep: list[list[tuple[bool, int, int]]] = []
        self._micro = 0

    def compute_loss(self, batch):
        if self._micro % self.layout.grad_accum_steps == 1:
            self.after_first_microstep.append([_held(p) for p in self.model.parameters()])
        self._micro += 1
        return super().compute_loss(batch)

    def train_step(self):
        out = super().train_step()
        self.losses.append((all_reduce_sum(out.loss.detach().clone()) / self.env.world_size).item())
        return out

    def record(self, _fit_result: object = None) -> dict:
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {
            "losses": self.losses,
            "params": {k: v.detach().float().cpu() for k, v in state.items()},
            "after_first_microstep": all_gather_objects(self.after_first_microstep),
        }


def _held(param: torch.Tensor) -> tuple[bool, int, int]:
    grad = param.grad
    if grad is None:
        return False, 0, 0
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    return True, local.numel(), grad.numel()


def main(out: Path, cases: dict[str, list[str]]) -> None:
    run_cases(out, cases, AccumulationRecorder)


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
