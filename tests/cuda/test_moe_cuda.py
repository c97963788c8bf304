"""The mixture of experts on a GPU in bf16: torch's grouped matmul (one kernel per projection for
all the experts) against the loop over the experts, which the CPU suite compares only through the
CPU's grouped matmul (tests/unit/test_moe_model.py).

- ``GroupedExperts`` alone: forward and backward of uneven groups, one of them empty, through the
  grouped matmul and through the loop (``grouped_mm_supported`` answering False) agree within
  bf16's rounding, the empty expert's gradients are zero, and the grouped run did call the
  grouped matmul;
- one Trainer step of ``model=moe_debug`` in ``precision=bf16`` on the GPU each way (launch
  ``moe_bf16_step``, tests/cuda/launches.py): the step's update of every parameter agrees within
  bf16's rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sdnet_trainer import Trainer, compose
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.distributed.ddp import unwrap
from sdnet_trainer.models.moe import GroupedExperts, experts
from tests.cuda.launches import LAUNCHES
from tests.support import assert_on_cuda

# The GPU check's second command runs these (tests/cuda/conftest.py).
pytestmark = [pytest.mark.cuda, pytest.mark.gpu_second]

DEVICE = torch.device("cuda", 0)
# Rows of 64 and 32 bf16 elements (128 and 64 bytes): multiples of the 16 bytes the grouped
# matmul's kernels take. Uneven groups, the second empty: an expert no token chose.
DIM, HIDDEN = 64, 32
COUNTS = [5, 0, 17, 10]


def _needs_bf16_grouped_mm() -> None:
    """torch's grouped matmul runs in bf16 from compute capability 8.0 on; below, the layer loops
    (``grouped_mm_supported``) and there is nothing to compare."""
    capability = torch.cuda.get_device_capability(DEVICE)
    if capability < (8, 0):
        pytest.skip(
            f"the grouped matmul needs compute capability 8.0 or later; "
            f"{torch.cuda.get_device_name(DEVICE)} has {capability[0]}.{capability[1]}"
        )
    assert experts._GROUPED_MM is not None, "this torch has no grouped matmul (torch >= 2.11 has)"


@pytest.fixture
def grouped_calls(monkeypatch) -> list[int]:
    """One entry per call of the layer's grouped matmul (``experts._GROUPED_MM``) from now on."""
    calls: list[int] = []
    grouped_mm = experts._GROUPED_MM

    def counted(*args, **kwargs):
        calls.append(1)
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(experts, "_GROUPED_MM", counted)
    return calls


def _loop_over_experts(monkeypatch) -> None:
    """From now on the layer takes its loop over the experts, as where the grouped matmul cannot
    run."""
    monkeypatch.setattr(experts, "grouped_mm_supported", lambda *tensors: False)


def _assert_close_bf16(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal within bf16's rounding: the two paths sum their products in other orders and round
    their intermediate results to bf16 (8 bits of mantissa), so each element may differ by a few
    of its own units in the last place (rtol), and an element that is a small difference of large
    terms by a share of the largest magnitude (atol)."""
    scale = want.abs().max().item()
    torch.testing.assert_close(
        got.float(),
        want.float(),
        rtol=2e-2,
        atol=1e-2 * scale,
        msg=lambda message: f"{what}: {message}",
    )


def test_grouped_experts_on_the_gpu_compute_as_the_loop_in_bf16(monkeypatch, grouped_calls):
    _needs_bf16_grouped_mm()
    torch.manual_seed(0)
    grouped = GroupedExperts(len(COUNTS), DIM, HIDDEN).to(DEVICE)
    looped = copy.deepcopy(grouped)
    rows = sum(COUNTS)
    x = torch.randn(rows, DIM, device=DEVICE, dtype=torch.bfloat16)
    upstream = torch.randn(rows, DIM, device=DEVICE, dtype=torch.bfloat16)
    counts = torch.tensor(COUNTS, device=DEVICE)
    weights = (grouped.w1.bfloat16(), grouped.w3.bfloat16(), grouped.w2.bfloat16())
    assert experts.grouped_mm_supported(x, *weights)

    def forward_backward(module: GroupedExperts) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = x.clone().requires_grad_()
        out = module(inputs, counts)
        (out.float() * upstream.float()).sum().backward()
        return out, inputs.grad

    out_grouped, dx_grouped = forward_backward(grouped)
    # One grouped matmul per projection (gate, up, down); backward runs torch's own.
    assert len(grouped_calls) == 3, grouped_calls
    _loop_over_experts(monkeypatch)
    out_looped, dx_looped = forward_backward(looped)
    assert len(grouped_calls) == 3, "the loop over the experts called the grouped matmul"

    assert_on_cuda(grouped, looped, out_grouped, out_looped)
    assert out_grouped.dtype == out_looped.dtype == torch.bfloat16
    _assert_close_bf16(out_grouped, out_looped, "output")
    _assert_close_bf16(dx_grouped, dx_looped, "input gradient")
    for name, param in grouped.named_parameters():
        assert param.grad is not None, name
        _assert_close_bf16(param.grad, looped.get_parameter(name).grad, f"{name} gradient")
        # The expert without rows: nothing reached it, whatever the kernel leaves in its group.
        assert not param.grad[1].any(), f"{name}: gradient of the empty expert"


class _Stepped(Trainer):
    """Keeps the parameters as set up (``initial``) and after the run (``final``, before
    ``close`` lets the model go): the step's update is compared."""

    def setup(self) -> None:
        super().setup()
        self.initial = self._parameters()

    def fit(self) -> dict[str, float]:
        metrics = super().fit()
        self.final = self._parameters()
        return metrics

    def _parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in unwrap(self.model).named_parameters()}


def _one_step(tmp_path) -> _Stepped:
    """The launch ``moe_bf16_step``, one process on the GPU (the session resolves dist.device=cuda
    to cuda:0)."""
    cfg = compose(LAUNCHES["moe_bf16_step"].keys)
    with distributed_session(cfg.dist) as env:
        assert env.device.type == "cuda"
        trainer = _Stepped(cfg, output_dir=tmp_path, env=env)
        try:
            trainer.fit()
        finally:
            trainer.close()
    return trainer


@pytest.mark.timeout(300)
def test_a_moe_trainer_step_in_bf16_updates_alike_grouped_and_looped(
    tmp_path, monkeypatch, grouped_calls
):
    _needs_bf16_grouped_mm()
    grouped = _one_step(tmp_path / "grouped")
    assert grouped_calls, "the bf16 run on the GPU never called the grouped matmul"
    calls = len(grouped_calls)
    _loop_over_experts(monkeypatch)
    looped = _one_step(tmp_path / "looped")
    assert len(grouped_calls) == calls, "the loop over the experts called the grouped matmul"

    assert grouped.state.step == looped.state.step == 1
    assert_on_cuda(list(grouped.final.values()), list(looped.final.values()))
    assert grouped.final.keys() == looped.final.keys() == grouped.initial.keys()
    assert any(".experts." in name for name in grouped.final), sorted(grouped.final)
    for name, before in grouped.initial.items():
        assert torch.equal(looped.initial[name], before), f"{name}: the runs started apart"
        # SGD without momentum or decay: the update is the learning rate times the gradient.
        update = grouped.final[name] - before
        _assert_close_bf16(update, looped.final[name] - before, f"{name} update")
    moved = [
        name for name, after in grouped.final.items() if (after != grouped.initial[name]).any()
    ]
    assert any(".experts." in name for name in moved), moved  # the experts did train
