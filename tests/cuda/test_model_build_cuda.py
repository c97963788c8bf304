"""On a GPU the stock models are built on the meta device and initialised straight into GPU memory,
with the weights a CPU build with the same seed gives (models/init.py): no whole CPU copy first.
The decoders' counter-based values (models/init_values.py) are computed on the GPU itself, with
integer operations, table lookups and correctly rounded float32 ones only: bitwise the CPU's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdnet_trainer import Trainer, compose
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.models import build_model, init_values
from tests.cuda.launches import LAUNCHES
from tests.support import assert_on_cuda

pytestmark = pytest.mark.cuda

# gpt_tiny; and resnet18 with BatchNorm buffers, a replaced stem, channels_last parameters.
BUILDS = [
    pytest.param("build_gpt_tiny", id="gpt_tiny"),
    pytest.param("build_resnet18", id="resnet18"),
]


@pytest.mark.parametrize(
    "dist",
    [
        init_values.Normal(0.02),
        init_values.Normal(1.5, mean=-1.0),
        init_values.Uniform(-0.1, 0.3),
        init_values.TruncatedNormal(0.5),
    ],
    ids=repr,
)
def test_counter_based_values_on_the_gpu_are_the_cpus_bitwise(dist):
    """A whole tensor, and a block whose rows start at odd indices (computed through the
    generator's other path), on the GPU and on the CPU."""
    on_gpu = torch.empty(301, 257, device="cuda")
    on_cpu = torch.empty(301, 257)
    for tensor in (on_gpu, on_cpu):
        generated = init_values.fill(tensor, dist, seed=17, key="blocks.3.attn.wq.weight")
        assert generated >= tensor.numel()
    assert_on_cuda(on_gpu)
    assert torch.equal(on_gpu.cpu(), on_cpu)
    block = on_cpu[5:77, 3:200]
    bases, inner = init_values._rows([[(5, 77)], [(3, 200)]], on_cpu.shape, on_gpu.device)
    values = torch.empty(block.shape, device="cuda")
    key = init_values.stream(17, "blocks.3.attn.wq.weight")
    for r0, r1, c0, c1 in init_values._chunks(bases.numel(), inner):
        view = values.view(-1)[r0 * inner : r1 * inner].view(r1 - r0, inner)[:, c0:c1]
        init_values._fill_rows(view, bases[r0:r1] + c0, dist, key)
    assert torch.equal(values.cpu(), block)


@pytest.mark.parametrize("name", BUILDS)
def test_stock_model_initialised_on_the_gpu_equals_the_cpu_build(tmp_path, monkeypatch, name):
    cfg = compose(LAUNCHES[name].keys)  # loop.seed=13: the CPU build below draws from seed 13
    allocated: list[torch.device] = []
    to_empty = nn.Module.to_empty

    def record(self, *, device, recurse=True):
        allocated.append(torch.device(device))
        return to_empty(self, device=device, recurse=recurse)

    monkeypatch.setattr(nn.Module, "to_empty", record)
    with distributed_session(cfg.dist) as env:
        assert env.device.type == "cuda"
        trainer = Trainer(cfg, output_dir=tmp_path, env=env)
        trainer.setup()
        try:
            assert_on_cuda(trainer.model)
            state = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
            devices = {p.device.type for p in trainer.model.parameters()}
        finally:
            trainer.close()
    assert [d.type for d in allocated] == ["cuda"]  # built on meta, allocated on the GPU once
    assert devices == {"cuda"}
    torch.manual_seed(13)
    expected = build_model(cfg.model).state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_a_layout_larger_than_the_free_gpu_memory_is_refused_before_allocating(tmp_path):
    """training/fits.py on a GPU: the rank's memory is the device's free memory, and a model
    whose training state exceeds it is refused before anything is allocated on the device."""
    from sdnet_trainer.errors import ConfigError
    from sdnet_trainer.training.fits import available_bytes, in_units

    cfg = compose(LAUNCHES["fits_gpt_tiny"].keys)
    device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    room = available_bytes(cfg, device)
    assert room is not None and room[1] == f"free memory of {device}"
    assert 0 < room[0] <= total
    # A GPT as wide as the whole device's memory, in fp32 weights alone: it cannot fit.
    dim = int((total / 4 / 12) ** 0.5 // 64 * 64) + 64
    wide = [*LAUNCHES["fits_gpt_tiny"].keys, f"model.gpt.dim={dim}"]
    before = torch.cuda.memory_allocated(device)
    with distributed_session(cfg.dist) as env:
        assert env.device.type == "cuda"
        trainer = Trainer(compose(wide), output_dir=tmp_path, env=env)
        with pytest.raises(ConfigError, match="training state needs .* GiB") as err:
            trainer.setup()
        trainer.close()
    assert f"free memory of {device}" in str(err.value)
    assert torch.cuda.memory_allocated(device) == before, in_units(free)
