"""Worker for tests/cuda/test_two_ranks_cuda.py: a training run whose two ranks share one GPU.

    python -m torch.distributed.run --standalone --nproc_per_node=2 _two_rank_worker.py OUT KEY=V...
    python _two_rank_worker.py OUT KEY=V...       # the single-process reference

NCCL refuses two ranks on one device, but gloo reduces CUDA tensors (staging them through host
memory): two processes on the one GPU of a node run the CUDA side of the data-parallel path, the
DDP wrapper around a CUDA module, its bucketed gradient all-reduce, the step's agreement, the
metrics' gathers and the checkpoint's collectives with the state on the device.

Each rank sees the GPU as its device 0, as a rank does under per-task GPU binding (SLURM's
``--gpus-per-task``): ``main`` sets ``LOCAL_RANK`` to 0 before the session reads it, so that both
ranks resolve ``dist.device=cuda`` to ``cuda:0``.

The Trainer records (tests.support.RecordingTrainer and ProbeTrainer) the per-step global
losses and DDP's all-reduce calls per step (``final.pt``, rank 0), what each rank was built as and
trained on, batches' devices included (``probe_rank{R}.json``), and the whole final parameters,
gathered from the shards under FSDP (``full_params.pt``, rank 0).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from sdnet_trainer import compose
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.distributed.ddp import unwrap
from sdnet_trainer.lazy import freeze_imports
from tests.support import ProbeTrainer, RecordingTrainer

FULL_PARAMS = "full_params.pt"


class TwoRankTrainer(RecordingTrainer, ProbeTrainer):
    """RecordingTrainer's losses and all-reduce counts; ProbeTrainer's layout; the whole final
    parameters on the CPU (a collective under FSDP: every rank takes part)."""

    def fit(self):
        metrics = super().fit()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(unwrap(self.model), options=options)
        if self.env.is_main:
            torch.save(full, self.output_dir / FULL_PARAMS)
        return metrics


def main(out_dir: Path, overrides: list[str]) -> None:
    os.environ["LOCAL_RANK"] = "0"  # both ranks on the one visible GPU
    cfg = compose(overrides)
    with distributed_session(cfg.dist, output_dir=out_dir) as env:
        TwoRankTrainer(cfg, output_dir=out_dir, env=env).fit()


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main(Path(sys.argv[1]), sys.argv[2:])
