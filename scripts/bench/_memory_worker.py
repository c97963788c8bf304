"""One parallel layout's per-rank memory, through the real Trainer: the run
``scripts/bench/bench_memory.py`` launches once per layout.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=N \
        scripts/bench/_memory_worker.py OUT_JSON OVERRIDES_JSON

OVERRIDES_JSON holds the config overrides (a JSON list). The Trainer trains ``loop.max_steps``
steps; afterwards every rank counts its training state (``training_state_bytes``: parameters,
gradients and optimizer state from local shards) and reads its peak RSS (``peak_memory_mb``), and
rank 0 writes all ranks' figures to OUT_JSON.

It also records the parameter bytes FSDP holds unsharded from the end of forward to backward:
the one difference between ZeRO-2 (``reshard_after_forward=false``: every block stays gathered)
and ZeRO-3 (blocks are freed after forward and gathered again in backward). At rest, between
steps, the two hold the same shards.

Under gradient accumulation it records the gradient bytes held after the first micro-step's
backward (read as the second micro-step starts): every tensor alive in the process that has a
``.grad``, counted once by its local storage. That covers the parameters' shards and, while
FSDP waits for the last micro-step to reduce (``parallel.fsdp.grad_sync=last_microstep``), the
unsharded parameters it keeps their full-size gradients on.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.distributed.ops import all_gather_objects
from sdnet_trainer.observability import peak_memory_mb
from sdnet_trainer.observability.memory import training_state_bytes
from sdnet_trainer.preflight import validate


class MemoryRecorder(Trainer):
    def setup(self) -> None:
        super().setup()
        self.unsharded_in_backward = 0
        self.grads_after_first_microstep = 0
        self._micro = 0
        if self.cfg.parallel.strategy == "fsdp":
            # Registered after FSDP's own hooks, so it runs once the blocks that reshard after
            # forward have done so: what is still gathered now stays gathered into backward.
            self.model.register_forward_hook(self._count_unsharded)

    def _count_unsharded(self, module, inputs, output) -> None:
        # FSDP swaps a gathered module's parameters for plain full-size tensors and back to
        # DTensor shards when it reshards; the shards themselves stay allocated throughout.
        gathered = sum(
            p.numel() * p.element_size()
            for p in self.model.parameters()
            if not isinstance(p, DTensor)
        )
        self.unsharded_in_backward = max(self.unsharded_in_backward, gathered)

    def compute_loss(self, batch):
        if self._micro == 1 and self.layout.grad_accum_steps > 1:
            self.grads_after_first_microstep = _gradient_bytes_alive()
        self._micro += 1
        return super().compute_loss(batch)

    def record(self) -> list[dict]:
        """Every rank's figures, in rank order (on every rank)."""
        mine = {
            **training_state_bytes(self.model, self.optimizer),
            "unsharded_in_backward": self.unsharded_in_backward,
            "grads_after_first_microstep": self.grads_after_first_microstep,
            "peak_rss_mb": peak_memory_mb(self.device),
        }
        return all_gather_objects(mine)


def _gradient_bytes_alive() -> int:
    """Bytes of the ``.grad`` of every tensor alive in this process, each storage once."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        grad = obj.grad if isinstance(obj, torch.Tensor) else None
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def main(out_json: Path, overrides: list[str]) -> None:
    cfg = compose(overrides)
    # The run's own dist.* (dist.pin_cpu_malloc=false: glibc returns freed blocks, so the peak
    # RSS follows what is live rather than the heap's high-water mark).
    with distributed_session(cfg.dist) as env:
        validate(cfg, world_size=env.world_size)
        trainer = MemoryRecorder(cfg, output_dir=out_json.with_suffix(""), env=env)
        try:
            trainer.fit()
            ranks = trainer.record()
        finally:
            trainer.close()
        if env.is_main:
            out_json.write_text(
                json.dumps({"world_size": env.world_size, "ranks": ranks}, indent=1)
            )


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
