"""On a GPU, continuous batching's state (the KV cache of a transformers Llama) stays in GPU
memory while rows join and leave it between steps, and each row gets the tokens it gets alone."""

from __future__ import annotations

import pytest
import torch

from sdnet_trainer.serve.decoding import CausalLMDecoder, Job, RunningBatch, _kv_pairs, generate
from tests.support import assert_on_cuda, tiny_llama_config

pytestmark = pytest.mark.cuda


def test_rows_join_and_leave_a_batch_held_on_the_gpu():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(
        tiny_llama_config(vocab_size=96, intermediate_size=64, max_position_embeddings=64)
    )
    with torch.no_grad():  # peaked logits: no near-ties for kernels' rounding to flip
        lm.lm_head.weight.mul_(20)
    decoder = CausalLMDecoder(lm, torch.device("cuda"))
    assert_on_cuda(decoder.lm)
    jobs = [Job([5, 17, 3], 10, 0.0, None), Job(list(range(30, 45)), 6, 0.0, None)]
    alone = [generate(decoder, [job])[0] for job in jobs]
    batch = RunningBatch(decoder)
    [first] = batch.add([jobs[0]])
    batch.step()
    [second] = batch.add([jobs[1]])
    assert_on_cuda([k for k, _ in _kv_pairs(batch._state)])  # the joined cache, on the GPU
    while batch.rows:
        batch.step()
    assert [first.tokens, second.tokens] == alone
