"""Several Trainer runs of one model in one launch: scripts/bench/bench_gpu.py's sections that
compare variants of a run (float8 recipes against bf16, eager and compiled; FSDP2 against the
plain model; the MoE's grouped matmul against its loop over experts; context parallel).

    torchrun --standalone --nproc_per_node=N scripts/bench/_variants_worker.py OUT SPEC_JSON
    python scripts/bench/_variants_worker.py OUT SPEC_JSON        (one process, no group)

SPEC_JSON: ``{"variants": [{"name": ..., "keys": [...], "moe_loop": false}, ...],
"share_gpu": false}``. Each variant is the Trainer's own run of its keys, in order, in this
process (and its process group, where torchrun started one); its metrics are the Trainer's
(``OUT/<name>/metrics.jsonl``, the loss at each log point among them). After every variant rank
0 rewrites ``OUT/results.json`` with what has finished, so a launch stopped at the end of its
share keeps the variants it finished.

Why one process: a process start with CUDA takes some seconds, and the imports, the data and
the model's build more; one process pays them once. The first variant is built
as the Trainer builds any run; every later one starts from a CPU copy of the first's initial
model (the Trainer's override path for a model with values: moved to the device, then
parallelized as usual: float8 conversion, compile, FSDP2). Throughput does not depend on the
values, and every variant starts from the same ones, so their losses compare too.

``moe_loop``: the mixture of experts' loop over experts (one matmul per expert) instead of
torch's grouped matmul, as on a device without the grouped kernel. results.json says, per
variant, what ran: the grouped matmul's calls, FSDP2 or not, the float8 and compiled modules.
``share_gpu``: every rank on the one visible GPU (LOCAL_RANK 0, as tests/cuda/_two_rank_worker.py
does; the group is gloo).
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
from torch import nn

from sdnet_trainer import Trainer, compose
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.distributed.ddp import unwrap
from sdnet_trainer.lazy import freeze_imports
from sdnet_trainer.observability import setup_logging
from sdnet_trainer.preflight import validate

RESULTS = "results.json"


class FirstVariant(Trainer):
    """The Trainer as any run builds it, keeping a CPU copy of its initial model (taken before
    the first step changes it) for the variants after it."""

    initial_copy: nn.Module | None = None

    def setup(self) -> None:
        super().setup()
        if self.pipeline is None:
            self.initial_copy = copy.deepcopy(unwrap(self.model)).to("cpu")


class LaterVariant(Trainer):
    """The Trainer starting from a copy of ``initial``, a CPU model with values: the override
    path of ``Trainer.build_model`` (moved to the device, then parallelized)."""

    def __init__(self, *args: Any, initial: nn.Module, **kwargs: Any) -> None:
        self.initial = initial
        super().__init__(*args, **kwargs)

    def build_model(self) -> nn.Module:
        if torch.get_default_device().type == "meta":
            # The FLOP counter's shape-only build (observability/flops.py): a copy of the CPU
            # model would not be on the meta device, and the counter would fall back to a real
            # forward and backward on the CPU, minutes for a 1B model.
            return super().build_model()
        return copy.deepcopy(self.initial)


@contextmanager
def experts_path(*, loop: bool) -> Iterator[list[int]]:
    """While open, the MoE experts take the loop over experts (``loop``: grouped_mm_supported
    answers False) or their usual path; yields a one-item list counting the grouped matmul's
    calls, so the results say which path ran."""
    from sdnet_trainer.models.moe import experts

    calls = [0]
    grouped, supported = experts._GROUPED_MM, experts.grouped_mm_supported

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return grouped(*args, **kwargs)

    experts._GROUPED_MM = counted if grouped is not None else None
    if loop:
        experts.grouped_mm_supported = lambda *args, **kwargs: False
    try:
        yield calls
    finally:
        experts._GROUPED_MM, experts.grouped_mm_supported = grouped, supported


def built(model: nn.Module) -> dict[str, Any]:
    """What the Trainer built, for the table to show the variant ran as named: sharded by FSDP2,
    how many linear layers float8 converted, how many modules were compiled."""
    from torch.distributed.fsdp import FSDPModule

    modules = list(model.modules())
    return {
        "fsdp": any(isinstance(m, FSDPModule) for m in modules),
        "float8_linears": sum(type(m).__name__ == "Float8Linear" for m in modules),
        # Module.compile (compile.enabled) sets _compiled_call_impl on each block it compiles.
        "compiled": sum(getattr(m, "_compiled_call_impl", None) is not None for m in modules),
    }


def release_device() -> None:
    """Between variants: the previous run's compiled graphs, then its memory (compiled blocks
    are held in reference cycles, which the collection after the reset frees), the peak reset."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(out: Path, spec: dict[str, Any]) -> None:
    if spec.get("share_gpu"):
        os.environ["LOCAL_RANK"] = "0"  # every rank on the one visible GPU
    variants = spec["variants"]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # As the command line sets it up: the console (the launch's log) and OUT/train.log.
    setup_logging(out, rank=int(os.environ.get("RANK", "0")))
    configs = [compose(variant["keys"]) for variant in variants]
    for cfg in configs:
        validate(cfg, world_size=world_size)  # what the command line checks before it starts
    results: dict[str, Any] = {}
    initial: nn.Module | None = None
    inductor_config = torch._inductor.config.save_config()
    with distributed_session(configs[0].dist, output_dir=out) as env:
        for variant, cfg in zip(variants, configs, strict=True):
            run_dir = out / variant["name"]
            run_dir.mkdir(parents=True, exist_ok=True)
            started = time.perf_counter()
            # A run may set inductor's options for the process (float8 rowwise compiled sets
            # emulate_precision_casts): each variant starts from the launch's own.
            torch._inductor.config.load_config(inductor_config)
            with experts_path(loop=bool(variant.get("moe_loop"))) as grouped_calls:
                trainer: Trainer
                if initial is None:
                    trainer = FirstVariant(cfg, output_dir=run_dir, env=env)
                else:
                    trainer = LaterVariant(cfg, output_dir=run_dir, env=env, initial=initial)
                try:
                    trainer.fit()
                    record = built(trainer.model)  # before close() lets the model go
                finally:
                    trainer.close()
            if isinstance(trainer, FirstVariant):
                initial = trainer.initial_copy
            results[variant["name"]] = {
                "seconds": time.perf_counter() - started,
                "grouped_mm_calls": grouped_calls[0],
                **record,
            }
            del trainer
            release_device()
            if env.is_main:
                (out / RESULTS).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    freeze_imports()  # as the command line does in its processes
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
