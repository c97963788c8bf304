"""Which ``compile.mode`` values go with which data-parallel wrappers.

``reduce-overhead`` and ``max-autotune`` have inductor record CUDA graphs of the compiled blocks.
A graph replays fixed memory addresses and kernels, while DDP's bucketed all-reduce and FSDP2's
per-block all-gather / reduce-scatter run collectives on their own streams and buffers around
those blocks; torch documents neither combination as supported and no test here has run one. So
the pair is refused before launch rather than left to fail (or to give wrong gradients) on the
first multi-GPU step; ``max-autotune-no-cudagraphs`` keeps the tuned kernels without graphs.
"""

from __future__ import annotations

import logging

from sdnet_trainer.config.schema import Config
from sdnet_trainer.distributed.mesh import parallel_dims
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

# The compile.mode values under which inductor records CUDA graphs.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def validate_compile_graphs(cfg: Config, world_size: int) -> None:
    """Refuse CUDA graphs (``compile.mode``) where the model is wrapped by DDP or FSDP2:
    ``parallel.strategy=fsdp``, or more than one data-parallel rank under any strategy."""
    mode = cfg.compile.mode
    if not cfg.compile.enabled or mode not in CUDA_GRAPH_MODES:
        return
    dims = parallel_dims(cfg.parallel, world_size)
    strategy = cfg.parallel.strategy
    if strategy != "fsdp" and dims.dp == 1:
        return
    wrapper = "FSDP2" if strategy == "fsdp" else "DDP"
    raise ConfigError(
        f"compile.enabled=true with compile.mode={mode} records CUDA graphs, which this project "
        f"does not run under {wrapper} (parallel.strategy={strategy}, {dims.dp} data-parallel "
        f"rank(s) of world size {world_size}): use compile.mode=default or "
        f"max-autotune-no-cudagraphs, or a single process with parallel.strategy=ddp"
    )
