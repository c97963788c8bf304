"""The dry run's start section (``plan/start_cost.py``): what a rank's initialisation and a
Hugging Face load would touch and allocate, rehearsed on the meta device from the same init
steps and the same state-dict adapter, against the rank's shards, against a real
initialisation and a real load of the same rank (the Trainer's model set-up under torch's fake
process group, in this process), and as the ranks grow."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.distributed import DistEnv
from sdnet_trainer.models import build_model, init_values
from sdnet_trainer.models.init import Draw, init_steps
from sdnet_trainer.models.init_values import Constant
from sdnet_trainer.models.registry import model_family
from sdnet_trainer.plan import dry_run
from sdnet_trainer.plan.dry_run import RankPlan, fake_group, plan_rank
from sdnet_trainer.plan.start_cost import STORED_DTYPE, StartCost

LLAMA = [
    "model=llama3_debug",
    "data=tokens",
    "data.seq_len=32",
    "data.vocab_size=256",
    "loop.global_batch_size=16",
]
MOE = [("model=moe_debug" if o == "model=llama3_debug" else o) for o in LLAMA]
# Every parameter of these layouts is sharded over 4 ranks: FSDP over dp_shard 4, and a MoE's
# experts by expert over ep 2 then by FSDP over the 2 ranks that hold the same ones.
SHARDED_OVER_4 = {
    "llama_fsdp4": LLAMA + ["parallel=fsdp"],
    "moe_ep2_fsdp4": MOE + ["parallel=fsdp", "parallel.ep=2"],
}
# What a real rank of these layouts initialises and reads is compared with the rehearsal.
LAYOUTS = {
    **{name: (overrides, 4) for name, overrides in SHARDED_OVER_4.items()},
    "llama_tp2_fsdp2": (LLAMA + ["parallel=fsdp", "parallel.tp=2"], 4),
}


def _start(plan: RankPlan) -> StartCost:
    assert plan.start is not None and plan.start.init is not None and plan.start.load is not None
    return plan.start


def _meta_model(overrides: list[str]) -> nn.Module:
    with torch.device("meta"):
        return build_model(compose(overrides).model)


def _local_bytes(tensors) -> int:
    unique = {id(t): t for t in tensors}.values()
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in unique)


@pytest.mark.parametrize("layout", SHARDED_OVER_4)
def test_init_values_and_device_bytes_are_the_ranks_shards(layout):
    """Every parameter a quarter per rank: the values generated are the quarter of every
    parameter drawn at random (the norms' constants generate none), the device bytes the
    parameters' quarter and the buffers (whole on every rank)."""
    overrides = SHARDED_OVER_4[layout]
    plan = plan_rank(compose(overrides), 0, 4)
    start = _start(plan)
    model = _meta_model(overrides)
    draws = [s.fn for s in init_steps(model) or [] if isinstance(s.fn, Draw)]
    constant = {d.key for d in draws if isinstance(d.dist, Constant)}
    params = dict(model.named_parameters())
    drawn = sum(params[d.key].numel() for d in draws if d.key not in constant)
    assert all(params[name].numel() % 4 == 0 for name in params)
    assert start.init.values == drawn // 4
    assert start.init.draws == len(draws)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert plan.params * 4 == sum(p.numel() * p.element_size() for p in params.values())
    assert start.init.device == plan.params + buffers
    # Read from a bf16 folder: every parameter's quarter, at 2 bytes an element.
    assert start.load.read == plan.params // 4 * STORED_DTYPE.itemsize


def test_host_bytes_per_rank_fall_as_the_ranks_grow(tmp_path, capsys):
    """``--dry-run`` with FSDP over 4 then 16 ranks: each rank reads a quarter as much, its
    largest read (the host buffer) shrinks with it, and the replayed steps' stand-ins (the
    rotary frequencies) stay what they are, so the host's peak falls; the report prints the
    start and its JSON carries it."""
    starts = {}
    for world in (4, 16):
        out = tmp_path / f"plan{world}.json"
        assert dry_run([f"world_size={world}", *LLAMA, "parallel=fsdp", f"json={out}"]) == 0
        printed = capsys.readouterr().out
        assert "start, init: device" in printed and "start, Hugging Face load: reads" in printed
        (plan,) = json.loads(out.read_text())
        starts[world] = plan["start"]
    small, large = starts[4], starts[16]
    assert large["host_peak"] < small["host_peak"]
    assert large["load"]["host"] < small["load"]["host"]
    assert large["load"]["largest"] * 4 == small["load"]["largest"]
    assert large["load"]["read"] * 4 == small["load"]["read"]
    assert large["init"]["host"] == small["init"]["host"] > 0
    assert large["init"]["values"] * 4 == small["init"]["values"]
    assert large["init"]["device"] < small["init"]["device"]


def test_under_cpu_offload_the_parameters_and_their_fills_are_on_the_host():
    """FSDP's CPU offload keeps the sharded parameters in host memory: the device keeps the
    buffers, the host the parameters and their fills' scratch; a load's reads are copied into
    host tensors, converted by the copy itself, with no second host buffer as on the way to a
    GPU."""
    on_device = _start(plan_rank(compose(LLAMA + ["parallel=fsdp"]), 0, 4))
    offloaded = _start(
        plan_rank(compose(LLAMA + ["parallel=fsdp", "parallel.fsdp.cpu_offload=true"]), 0, 4)
    )
    params = on_device.init.device - offloaded.init.device
    assert offloaded.init.host_params == params > 0
    assert offloaded.init.values == on_device.init.values
    assert offloaded.load.host == offloaded.load.largest < on_device.load.host
    assert offloaded.host_peak == params + max(
        offloaded.init.host + offloaded.init.scratch, offloaded.load.host
    )


def _set_up(overrides: list[str], rank: int, world: int) -> tuple[nn.Module, int, int]:
    """Rank ``rank``'s model as the Trainer sets it up (built on the meta device, parallelized,
    allocated on the CPU, initialised or read from a folder): the model, the values the
    generator computed, the bytes a Hugging Face folder's reader read."""
    import sdnet_trainer.models.llama.hf as llama_hf
    import sdnet_trainer.models.moe.weights as moe_weights

    generated: list[int] = []
    read: list[int] = []
    real_read = llama_hf.read_folder

    def counted(*args, **kwargs):
        read.append(real_read(*args, **kwargs))
        return read[-1]

    patch = pytest.MonkeyPatch()
    patch.setattr(llama_hf, "read_folder", counted)
    patch.setattr(moe_weights, "read_folder", counted)
    stop = init_values.observe(generated.append)
    try:
        with fake_group(rank, world):
            trainer = Trainer(
                compose(overrides), env=DistEnv(rank=rank, world_size=world, backend="fake")
            )
            trainer._setup_model()
    finally:
        stop()
        patch.undo()
    return trainer.model, sum(generated), sum(read)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """The families' single-process initial weights as Hugging Face folders (``format=hf``)."""
    pytest.importorskip("safetensors", reason="the llm extra is not installed")
    from sdnet_trainer.export.hf import write_hf

    out = {}
    for name, overrides in (("llama", LLAMA), ("moe", MOE)):
        model, _, _ = _set_up(overrides, 0, 1)
        folder = tmp_path_factory.mktemp(f"{name}_hf")
        write_hf(model, folder, family=model_family(name))
        out[name] = str(folder)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_rehearsal_counts_what_a_real_rank_initialises_and_reads(layout, folders):
    """Rank 1 of the layout set up for real: the values its initialisation generated and the
    bytes its parameters and buffers hold are the rehearsal's; reading a Hugging Face folder
    (stored in the model's fp32) it reads the elements the rehearsal plans to read."""
    overrides, world = LAYOUTS[layout]
    start = _start(plan_rank(compose(overrides), 1, world))
    model, generated, _ = _set_up(overrides, 1, world)
    assert generated == start.init.values > 0
    assert _local_bytes([*model.parameters(), *model.buffers()]) == start.init.device
    folder = folders["moe" if overrides[0] == "model=moe_debug" else "llama"]
    _, generated, read = _set_up([*overrides, f"model.weights=hf:{folder}"], 1, world)
    assert generated == 0  # the folder sets every parameter
    assert read // torch.float32.itemsize == start.load.read // STORED_DTYPE.itemsize > 0
