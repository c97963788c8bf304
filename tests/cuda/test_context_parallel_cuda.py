"""Context parallel on the GPU: torch's ring attention (``parallel.cp_attention=ring``, CUDA
only) and the K/V all-gather, each on two ranks against one process.

The two ranks share the node's one GPU over gloo with CUDA tensors (tests/cuda/
test_two_ranks_cuda.py says why): the attention kernels, the load-balanced shards, the
positions and the gathers run on the device as on a multi-GPU node; only the transport differs.
The CPU suite proves the same layouts with the all-gather attention
(tests/distributed/test_layouts.py); the ring runs only here.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda._two_rank_worker import FULL_PARAMS
from tests.cuda.test_two_ranks_cuda import _run
from tests.support import FINAL_STATE, assert_on_cuda, read_probe

# The GPU check's second command runs these (tests/cuda/conftest.py).
pytestmark = [pytest.mark.cuda, pytest.mark.gpu_second]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name", [pytest.param("cp_ring", id="ring"), pytest.param("cp_allgather", id="allgather")]
)
def test_context_parallel_on_cuda_matches_one_process(tmp_path, name):
    # Each launch is the shared two-rank run, then the Llama's keys, then context parallel's,
    # each key once (tests/cuda/launches.py): model=llama3_debug in place of the shared run's
    # model=simple_cnn, which, put after the Llama's, won and trained the CNN on tokens.
    single = _run(tmp_path, "cp_single")
    double = _run(tmp_path, name)
    reference = torch.load(single / FINAL_STATE, weights_only=True)
    run = torch.load(double / FINAL_STATE, weights_only=True)
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-3, abs=1e-5)
    want = torch.load(single / FULL_PARAMS, weights_only=True)
    got = torch.load(double / FULL_PARAMS, weights_only=True)
    assert got.keys() == want.keys() and got
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-3, atol=1e-5, msg=name)
    for rank in (0, 1):
        probe = read_probe(double, rank)
        assert_on_cuda(probe["device"], probe["batch_devices"])
        assert probe["world_size"] == 2, probe
