"""Worker for tests/distributed/test_gpt_tp.py, on 2 ranks (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node=2 _gpt_tp_worker.py OUT.json

Builds the same small GPT on every rank, once as the single-process reference and once per
combination of loss_parallel / sequence_parallel sharded over a 2-rank TP mesh, and records how
far the TP logits, loss, gradients (as full tensors) and the parameters after one SGD step with
gradient clipping are from the reference; also a pruned last pipeline stage sharded after the
split, dropout under sequence parallel, and the Trainer's LM loss with -100 targets. Rank 0
writes every rank's numbers to OUT.json (a list, one entry per rank); the test holds the
tolerances. Everything shares one launch, as
starting processes is the slow part.
"""

from __future__ import annotations

import itertools
import json
import sys
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

from sdnet_trainer.data.token_cache import IGNORE_INDEX
from sdnet_trainer.lazy import freeze_imports
from sdnet_trainer.models.gpt import GPT
from sdnet_trainer.training.evaluation import token_cross_entropy

# Small, but with more than one head per rank, a vocabulary that splits unevenly (32 + 31 rows),
# and a sequence shorter than the context (12 < 16), which sequence parallel cuts into two halves.
SIZES = dict(vocab_size=63, seq_len=16, dim=32, n_layers=2, n_heads=4)
BATCH, LENGTH = 3, 12


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train_step(
    model: GPT,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    *,
    loss_parallel: bool,
    loss_fn=F.cross_entropy,
) -> dict:
    """One forward/backward/SGD step; returns full-tensor logits, loss, grads and new params.

    Clipping and the (foreach) optimizer step are there to show that every parameter is a
    DTensor: they refuse a mix of DTensors and plain tensors."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    with loss_parallel_context() if loss_parallel else nullcontext():
        logits = model(tokens)
        loss = loss_fn(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    layout = repr(logits.placements) if isinstance(logits, DTensor) else None
    grads = {name: full(p.grad).clone() for name, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    optimizer.step()
    params = {name: full(p.detach()).clone() for name, p in model.named_parameters()}
    return {
        "logits": full(logits.detach()),
        "logits_layout": layout,
        "loss": full(loss.detach()),
        "grads": grads,
        "params": params,
    }


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def pruned_stage_error(
    mesh, inputs: torch.Tensor, logits: torch.Tensor, *, sequence_parallel: bool
) -> float:
    """A last pipeline stage (embed and blocks.0 pruned to None, as the pipeline split leaves it)
    sharded after the split: fed the reference's hidden state after blocks.0 (this rank's slice
    of the sequence under sequence parallel), it must give the reference logits."""
    torch.manual_seed(0)
    model = GPT(**SIZES)
    with torch.no_grad():
        hidden = model.blocks[0](model.embed(inputs))
    model._modules["embed"] = None
    model.blocks._modules["0"] = None
    model.apply_tensor_parallel(mesh, loss_parallel=False, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        hidden = hidden.chunk(mesh.size(), dim=1)[mesh.get_local_rank()]
    x = hidden
    with torch.no_grad():
        for name in model.pipeline_units()[2:]:
            x = model.get_submodule(name)(x)
    return (x - logits).abs().max().item()


def main(out_path: str) -> None:
    # DTensor's random ops say on every call that their CPU support is partial (dropout runs
    # locally).
    warnings.filterwarnings("ignore", message="DTensor random operators")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    data = torch.Generator().manual_seed(7)
    tokens = torch.randint(SIZES["vocab_size"], (BATCH, LENGTH + 1), generator=data)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    torch.manual_seed(0)
    reference = train_step(GPT(**SIZES), inputs, targets, loss_parallel=False)

    results = {}
    for loss_parallel, sequence_parallel in itertools.product([False, True], repeat=2):
        torch.manual_seed(0)
        model = GPT(**SIZES)
        model.apply_tensor_parallel(
            mesh, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel
        )
        lengths = []
        model.blocks[0].register_forward_pre_hook(
            lambda module, args, lengths=lengths: lengths.append(args[0].shape[1])
        )
        sharded = {
            name
            for name, p in model.named_parameters()
            if isinstance(p, DTensor) and p.to_local().shape != p.shape
        }
        plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
        out = train_step(model, inputs, targets, loss_parallel=loss_parallel)
        results[f"loss_parallel={loss_parallel},sequence_parallel={sequence_parallel}"] = {
            # None: a plain tensor; else the DTensor placements.
            "logits_layout": out["logits_layout"],
            "logits": (out["logits"] - reference["logits"]).abs().max().item(),
            "loss": abs(out["loss"].item() - reference["loss"].item()),
            "grads": max_diff(out["grads"], reference["grads"]),
            "params_after_step": max_diff(out["params"], reference["params"]),
            "plain_params": plain,
            # Tokens per sequence in the residual stream a block sees: all, or this rank's share.
            "block_input_length": lengths[0],
            "sharded_params": sorted(sharded),
        }
    for sequence_parallel in (False, True):
        results[f"pipeline_stage,sequence_parallel={sequence_parallel}"] = pruned_stage_error(
            mesh, inputs, reference["logits"], sequence_parallel=sequence_parallel
        )
    # Targets of -100 (chat prompts, masked document boundaries) under the Trainer's LM loss, on
    # full logits and on vocabulary shards: the same loss and gradients as one process, whose
    # loss is the plain cross-entropy of the targets that count.
    masked = targets.clone()
    masked[:, ::3] = IGNORE_INDEX
    torch.manual_seed(0)
    plain = train_step(
        GPT(**SIZES), inputs, masked, loss_parallel=False, loss_fn=token_cross_entropy
    )
    kept = masked != IGNORE_INDEX
    results["ignore_index_reference"] = abs(
        plain["loss"].item() - F.cross_entropy(plain["logits"][kept], masked[kept]).item()
    )
    for loss_parallel in (False, True):
        torch.manual_seed(0)
        model = GPT(**SIZES)
        model.apply_tensor_parallel(mesh, loss_parallel=loss_parallel, sequence_parallel=False)
        out = train_step(
            model, inputs, masked, loss_parallel=loss_parallel, loss_fn=token_cross_entropy
        )
        results[f"ignore_index,loss_parallel={loss_parallel}"] = {
            "loss": abs(out["loss"].item() - plain["loss"].item()),
            "grads": max_diff(out["grads"], plain["grads"]),
            "differs_from_unmasked": abs(out["loss"].item() - reference["loss"].item()),
        }
    # Dropout is allowed with sequence parallel: each rank drops in its own slice of the sequence.
    torch.manual_seed(0)
    model = GPT(**SIZES, dropout=0.1).train()
    model.apply_tensor_parallel(mesh, loss_parallel=False, sequence_parallel=True)
    out = train_step(model, inputs, targets, loss_parallel=False)
    results["dropout_sequence_parallel_loss"] = out["loss"].item()
    results["reference_loss"] = reference["loss"].item()
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, results)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(every_rank, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main(sys.argv[1])
