"""Context parallel (``parallel.cp``) without a process group: the load-balanced shard of each
sequence and its positions, and every refusal before launch. Training under it is compared with
one process in tests/distributed/test_layouts.py (Llama and GPT, alone, beside FSDP and TP,
masked targets, a checkpoint resumed without it)."""

from __future__ import annotations

import pytest
import torch

from sdnet_trainer.config import compose
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.preflight import validate

LLAMA = ["model=llama3_debug", "data=tokens", "data.seq_len=32", "data.vocab_size=256"]


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["parallel.cp=2", "data.seq_len=30"], 2, r"data.seq_len=30 is not a multiple of 4"),
        (
            ["model=resnet18", "data=synthetic", "parallel.cp=2"],
            2,
            r"model.name='resnet18' has no context-parallel attention",
        ),
        (["parallel.cp=2", "parallel.pp=2"], 4, r"parallel.cp=2 with parallel.pp=2"),
        (["parallel.cp=2", "parallel=zero1"], 2, r"parallel.strategy=zero1 with parallel.cp=2"),
        (["parallel.cp=2", "parallel.cp_attention=ring"], 2, r"cp_attention=ring .* CUDA"),
        (["parallel.cp=2", "parallel.cp_attention=rings"], 2, r"parallel.cp_attention"),
        (["parallel.cp=2", "parallel.tp=2"], 4, r"parallel.cp=2 gradient replicas"),
        (["parallel.cp=3"], 2, r"parallel.cp \(3\)"),
        (
            [
                "model=gpt_tiny",  # 4 heads: tensor parallel over 4
                "data.vocab_size=64",
                "parallel=fsdp",
                "parallel.cp=2",
                "parallel.tp=4",
                "parallel.tensor_parallel.sequence_parallel=true",
                "data.seq_len=12",
            ],
            8,
            r"each rank's 6 tokens .* multiple of parallel.cp x parallel.tp = 8",
        ),
    ],
)
def test_bad_context_parallel_is_refused_before_launch(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose([*LLAMA, *overrides]), world_size=world_size)


def test_the_shards_balance_causal_work_and_carry_their_positions(monkeypatch):
    """Rank r of cp holds chunks r and 2cp-1-r of the sequence (head-tail), its positions say
    so, and its mask lets each query see exactly the keys at its own and earlier positions."""
    from sdnet_trainer.distributed import context_parallel

    class Mesh:  # the two methods ContextParallel asks of its 1-D mesh
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def size(self) -> int:
            return 4

        def get_local_rank(self) -> int:
            return self.rank

    seq_len = 16
    held, work = [], []
    for rank in range(4):
        cp = context_parallel.ContextParallel(
            Mesh(rank), seq_len=seq_len, method="allgather", device=torch.device("cpu")
        )
        chunk = seq_len // 8
        expected = [*range(rank * chunk, (rank + 1) * chunk)]
        expected += [*range(seq_len - (rank + 1) * chunk, seq_len - rank * chunk)]
        assert cp.positions.tolist() == expected
        assert sorted(cp.key_positions.tolist()) == list(range(seq_len))
        for i, position in enumerate(cp.positions.tolist()):
            visible = cp.key_positions[cp.mask[i]].tolist()
            assert sorted(visible) == list(range(position + 1))
        held += cp.positions.tolist()
        work.append(int(cp.mask.sum()))
    assert sorted(held) == list(range(seq_len))  # every token on exactly one rank
    assert len(set(work)) == 1  # the same attention work on every rank
