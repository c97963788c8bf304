"""FSDP2 on a one-rank world (a process group of one, as ``torchrun --nproc_per_node=1`` starts),
in this process over gloo: the model is wrapped, trains as the bare model does, reduce-scatters
its gradients on every accumulation micro-step by default, and allocates an offloaded model's
parameters in CPU memory.

CPU offload on the CPU is a degenerate case (the "device" is the CPU already), so the offload
tests prove what the CPU can: which device each tensor is allocated on, with the meta device
standing in for the GPU, and that an offloaded one-rank model passes FSDP's lazy init and trains
as the bare model does. The GPU run is tests/cuda/test_fsdp_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.models import init as model_init

GPT_ACCUM = [
    "dist.device=cpu",
    "model=gpt_tiny",
    "data=tokens",
    "data.train_size=64",
    "optim=sgd",
    "optim.lr=0.2",
    "optim.momentum=0.9",
    "sched=constant",
    "loop.max_steps=3",
    "loop.global_batch_size=8",
    "loop.grad_accum_steps=2",
    "loop.eval_at_end=false",
    "loop.eval_at_epoch_end=false",
    "logging.trackers=[jsonl]",
    "checkpoint.save_on_exit=false",
]


class MicroStepRecorder(Trainer):
    """Records every step's loss, and the gradients' state after the first micro-step's backward
    (read when the second micro-step's forward starts): per parameter, whether ``.grad`` is set
    and whether it is a DTensor."""

    def setup(self) -> None:
        super().setup()
        self.losses: list[float] = []
        self.after_first_microstep: list[list[tuple[bool, bool]]] = []
        self._micro = 0

    def compute_loss(self, batch):
        if self._micro % self.layout.grad_accum_steps == 1:
            self.after_first_microstep.append(
                [(p.grad is not None, isinstance(p.grad, DTensor)) for p in self.model.parameters()]
            )
        self._micro += 1
        return super().compute_loss(batch)

    def train_step(self):
        out = super().train_step()
        self.losses.append(out.loss.item())
        return out

    def full_params(self) -> dict[str, torch.Tensor]:
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().clone() for k, v in state.items()}


def _train(tmp_path, overrides, env=None) -> MicroStepRecorder:
    trainer = MicroStepRecorder(compose(overrides), output_dir=tmp_path, env=env)
    try:
        trainer.fit()
        trainer.params = trainer.full_params()
        trainer.built = trainer.model  # close() lets go of the model
    finally:
        trainer.close()
    return trainer


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> MicroStepRecorder:
    """The reference: the same run in a plain process, no process group, the bare model."""
    return _train(tmp_path_factory.mktemp("bare"), [*GPT_ACCUM, "parallel=fsdp"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("grad_sync", [None, "every_microstep", "last_microstep"])
def test_one_rank_fsdp_wraps_and_trains_as_the_bare_model(tmp_path, one_rank, bare, grad_sync):
    extra = [] if grad_sync is None else [f"parallel.fsdp.grad_sync={grad_sync}"]
    trainer = _train(tmp_path, [*GPT_ACCUM, "parallel=fsdp", *extra], env=one_rank)

    assert not isinstance(bare.built, FSDPModule)
    assert isinstance(trainer.built, FSDPModule), type(trainer.built)
    blocks = [m for m in trainer.built.modules() if isinstance(m, FSDPModule)]
    assert len(blocks) > 1  # one unit per transformer block, then the root
    assert all(isinstance(p, DTensor) for p in trainer.built.parameters())

    # The default reduce-scatters after the first micro-step already: every parameter holds its
    # gradient shard (a DTensor). Deferring leaves the shards' gradients unset: the unsharded
    # gradients are held inside FSDP until the last micro-step.
    assert len(trainer.after_first_microstep) == 3  # one reading per step
    for reading in trainer.after_first_microstep:
        if grad_sync == "last_microstep":
            assert reading == [(False, False)] * len(reading), reading
        else:
            assert reading == [(True, True)] * len(reading), reading

    torch.testing.assert_close(trainer.losses, bare.losses)
    assert trainer.params.keys() == bare.params.keys()  # FSDP keeps the parameter names
    for name, value in bare.params.items():
        torch.testing.assert_close(trainer.params[name], value, msg=name)


class _WithBuffer(nn.Module):
    """Two FSDP units and a BatchNorm (buffers: running statistics, FSDP does not manage them)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _offloaded_on_meta() -> _WithBuffer:
    with torch.device("meta"):
        model = _WithBuffer()
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model.block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model


def test_offloaded_parameters_are_allocated_in_cpu_memory_and_buffers_on_the_device(one_rank):
    model = _offloaded_on_meta()
    # The meta device stands in for the GPU: whatever is meant for "the device" stays there,
    # and only what allocate() puts in CPU memory is on the CPU.
    model_init.allocate(model, torch.device("meta"), cpu_offload=True)
    params = dict(model.named_parameters())
    assert params and all(isinstance(p, DTensor) for p in params.values())
    assert {n: p.to_local().device.type for n, p in params.items()} == dict.fromkeys(params, "cpu")
    buffers = dict(model.named_buffers())
    assert set(buffers) == {
        "block.1.running_mean",
        "block.1.running_var",
        "block.1.num_batches_tracked",
    }
    assert {b.device.type for b in buffers.values()} == {"meta"}

    # Without offload, everything goes to the device: the plain to_empty.
    with torch.device("meta"):
        plain = _WithBuffer()
    fully_shard(plain, mesh=init_device_mesh("cpu", (1,)))
    model_init.allocate(plain, torch.device("meta"), cpu_offload=False)
    assert {t.device.type for t in [*plain.parameters(), *plain.buffers()]} == {"meta"}


def test_offloaded_model_from_meta_passes_lazy_init_and_trains(one_rank):
    torch.manual_seed(0)
    reference = _WithBuffer()
    model = _offloaded_on_meta()
    model_init.allocate(model, torch.device("cpu"), cpu_offload=True)
    with torch.no_grad():  # one rank: a shard is the whole tensor
        for param, value in zip(model.parameters(), reference.parameters()):
            param.to_local().copy_(value)
        for buffer, value in zip(model.buffers(), reference.buffers()):
            buffer.copy_(value)
    inputs = torch.randn(6, 8)
    for module in (reference, model):
        module(inputs).square().mean().backward()  # FSDP's lazy init runs on the first forward
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, param in model.named_parameters():
        assert isinstance(param.grad, DTensor) and param.grad.to_local().device.type == "cpu"
        torch.testing.assert_close(param.grad.full_tensor(), grads[name], msg=name)


@pytest.mark.timeout(300)
def test_trainer_builds_offloaded_fsdp_from_meta_on_one_rank(tmp_path, one_rank, bare):
    """The Trainer's own path: meta build, fully_shard with CPUOffloadPolicy, allocate, init,
    train. (The config check refuses cpu_offload on a CPU run; the Trainer is built directly.)"""
    trainer = _train(
        tmp_path, [*GPT_ACCUM, "parallel=fsdp", "parallel.fsdp.cpu_offload=true"], env=one_rank
    )
    assert isinstance(trainer.built, FSDPModule)
    torch.testing.assert_close(trainer.losses, bare.losses)
    for name, value in bare.params.items():
        torch.testing.assert_close(trainer.params[name], value, msg=name)
