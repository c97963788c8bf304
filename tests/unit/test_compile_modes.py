"""compile.mode with CUDA graphs (reduce-overhead, max-autotune) is refused before launch where
DDP or FSDP2 wraps the model, through the whole preflight; the other modes, and CUDA graphs on a
single unwrapped process, still pass."""

from __future__ import annotations

import pytest

from sdnet_trainer.config import compose
from sdnet_trainer.distributed.parallelize import validate_compile
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.preflight import validate

GRAPH_MODES = ["reduce-overhead", "max-autotune"]
OTHER_MODES = ["null", "default", "max-autotune-no-cudagraphs"]
# (world size, overrides): DDP over 2 ranks, ZeRO-1 (DDP underneath) over 2, FSDP2 over 2 and
# FSDP2 on one rank (parallel=fsdp asks for the wrapper), HSDP.
WRAPPED = [
    (2, []),
    (2, ["parallel=zero1"]),
    (2, ["parallel=fsdp"]),
    (1, ["parallel=fsdp"]),
    (4, ["parallel=fsdp", "parallel.dp_replicate=2", "parallel.dp_shard=2"]),
]


def _cfg(mode: str, extra: list[str]):
    return compose(["compile=on", f"compile.mode={mode}", "loop.global_batch_size=16", *extra])


@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("world, extra", WRAPPED)
def test_cuda_graphs_under_ddp_or_fsdp_are_refused_naming_the_keys(mode, world, extra):
    with pytest.raises(ConfigError) as excinfo:
        validate(_cfg(mode, extra), world_size=world)
    message = str(excinfo.value)
    assert f"compile.mode={mode}" in message and "CUDA graphs" in message
    assert "parallel.strategy=" in message and "max-autotune-no-cudagraphs" in message


@pytest.mark.parametrize("mode", OTHER_MODES)
@pytest.mark.parametrize("world, extra", WRAPPED)
def test_other_modes_pass_under_every_wrapper(mode, world, extra):
    validate(_cfg(mode, extra), world_size=world)


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_cuda_graphs_pass_where_nothing_wraps_the_model_or_compile_is_off(mode):
    validate(_cfg(mode, []), world_size=1)  # one DDP process: the bare model
    validate(_cfg(mode, ["parallel.tp=2"]), world_size=2)  # tensor parallel alone, no DDP
    off = _cfg(mode, ["parallel=fsdp"])
    off.compile.enabled = False  # the mode of a compile that does not happen
    validate_compile(off, 2)
    validate(off, world_size=2)
