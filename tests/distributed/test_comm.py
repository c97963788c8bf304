"""sdnet_trainer.distributed.comm and comm_hooks: DDP communication hooks on two ranks (gloo).

One launch of tests/distributed/_comm_worker.py (plain DDP + GradientComm, no Trainer) runs every
scenario; each test checks one part of its results against a reference computed in the same
launch: the hand-made fp32 gradient average, the uncompressed run's loss, the payload actually
passed to ``dist.all_reduce``, the uninterrupted run. The config checks at the end need no
processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sdnet_trainer.config.schema import (
    CommConfig,
    Config,
    LocalSGDConfig,
    ParallelConfig,
    PowerSGDConfig,
)
from sdnet_trainer.distributed.comm_hooks import batched_powersgd_works, validate_comm
from sdnet_trainer.errors import ConfigError
from tests.distributed import _comm_worker as worker
from tests.support import run_cli

WORKER = Path(worker.__file__)
# Final held-out loss of PowerSGD (rank 1, error feedback) over that of the uncompressed run, at
# most: a rank-1 approximation of every gradient matrix costs some progress in 60 steps (about
# 1.12 here), but error feedback keeps it close.
POWERSGD_LOSS_MARGIN = 1.2
# 16-bit gradient all-reduce: the final loss within this fraction of the fp32 run's.
COMPRESSED_LOSS_MARGIN = 0.02


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("comm")
    launch = run_cli([str(out_dir)], cwd=out_dir, nproc=2, script=WORKER, timeout=240)
    assert launch.returncode == 0, launch.output
    return torch.load(out_dir / "results.pt", weights_only=False)


# ---------------------------------------------------------------------- gradients


def test_without_a_hook_ddp_gradients_are_the_fp32_average(results):
    grads = results["gradients"]
    for got, want in zip(grads["none"], grads["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("hook, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_compressed_gradients_differ_from_the_average_only_by_rounding(results, hook, dtype):
    # With two ranks the hook rounds each local gradient g_r to `dtype` (relative error u = eps/2),
    # halves it (exact) and adds the halves in `dtype` (one more rounding of u): at most
    # u (|g_0| + |g_1|) / 2 + u |g_0 + g_1| / 2 <= eps * mean|g_r|, plus the spacing of subnormal
    # numbers for each of the three roundings (fp16 flushes tiny gradients to multiples of 2^-24).
    grads = results["gradients"]
    info = torch.finfo(dtype)
    spacing = info.smallest_normal * info.eps
    changed = False
    for got, want, magnitude in zip(grads[hook], grads["reference"], grads["magnitude"]):
        bound = 1.25 * info.eps * magnitude + 2 * spacing
        excess = (got - want).abs() - bound
        assert excess.max() <= 0, f"{hook}: error exceeds the rounding bound by {excess.max():.3g}"
        changed |= not torch.equal(got, want)
    assert changed, f"{hook}: gradients identical to fp32; the hook did not compress"


# ---------------------------------------------------------------------- training


@pytest.mark.parametrize("hook", list(worker.VARIANTS))
def test_every_hook_trains(results, hook):
    start, end = results["training"][hook]["val_loss"]
    assert end < 0.65 * start, (hook, start, end)


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_compressed_all_reduce_trains_like_fp32(results, hook):
    final = results["training"][hook]["val_loss"][-1]
    reference = results["training"]["none"]["val_loss"][-1]
    assert final == pytest.approx(reference, rel=COMPRESSED_LOSS_MARGIN)


def test_powersgd_with_error_feedback_ends_close_to_the_uncompressed_loss(results):
    final = results["training"]["powersgd"]["val_loss"][-1]
    reference = results["training"]["none"]["val_loss"][-1]
    assert final <= POWERSGD_LOSS_MARGIN * reference, (final, reference)


def test_powersgd_over_several_buckets_keeps_the_ranks_collectives_in_step(results):
    # gloo runs the hook's follow-up all-reduces on its own threads; unless each bucket finishes
    # before the next starts, the ranks issue them in different orders and the launch dies with a
    # collective mismatch. Compression is per matrix, so the bytes do not depend on the buckets.
    runs = results["training"]
    several = runs["powersgd_buckets"]
    assert several["buckets"] >= 2 and runs["powersgd"]["buckets"] == 1
    assert several["payload"] == runs["powersgd"]["payload"]
    # The same up to the random starting Q (drawn per bucket).
    assert several["val_loss"][-1] == pytest.approx(runs["powersgd"]["val_loss"][-1], rel=0.02)


def test_local_sgd_replicas_are_equal_exactly_after_averaging_and_differ_between(results):
    run = results["training"]["local_sgd"]
    cfg = worker.VARIANTS["local_sgd"].local_sgd
    gaps, synchronized = run["gap"], run["synchronized"]
    for step, (gap, synced) in enumerate(zip(gaps, synchronized), start=1):
        # All-reduced gradients up to start_step; from there an average every `period` steps,
        # the first right after the first local step.
        expected = step <= cfg.start_step or (step - 1 - cfg.start_step) % cfg.period == 0
        assert synced == expected, step
        if synced:
            assert gap == 0.0, f"step {step}: replicas differ by {gap} right after averaging"
        else:
            assert gap > 0.0, f"step {step}: replicas equal although each stepped on its own data"
    assert run["state"] == {"hook_iter": cfg.start_step, "averager_step": worker.STEPS}


# ---------------------------------------------------------------------- bytes


def test_bytes_per_step_is_the_payload_handed_to_all_reduce(results):
    runs = results["training"]
    full = runs["none"]["steady_bytes"]
    params = sum(p.numel() for p in worker.Net().parameters())
    assert full == 4 * params
    # DDP's own all-reduce runs in C++, out of the counter's sight; the hooks call dist.all_reduce.
    assert runs["none"]["payload"] == [0] * worker.STEPS
    for hook in ("fp16", "bf16"):
        assert runs[hook]["steady_bytes"] == full / 2
        assert runs[hook]["payload"] == [full / 2] * worker.STEPS
    # PowerSGD: plain all-reduce for start_iter steps, then rank-1 factors of the three weight
    # matrices and the raw biases (compressing a vector would save nothing).
    psgd = runs["powersgd"]
    start = worker.VARIANTS["powersgd"].powersgd.start_iter
    factors = (
        (worker.CLASSES + worker.HIDDEN)
        + (worker.HIDDEN + worker.HIDDEN)
        + (worker.HIDDEN + worker.IN)
    )
    biases = worker.CLASSES + 2 * worker.HIDDEN
    assert psgd["steady_bytes"] == 4 * (factors + biases)
    assert psgd["payload"] == [full] * start + [psgd["steady_bytes"]] * (worker.STEPS - start)
    assert psgd["predicted"] == psgd["payload"]
    # Local SGD: all of the parameters once per period; nothing in between.
    local = runs["local_sgd"]
    cfg = worker.VARIANTS["local_sgd"].local_sgd
    assert local["steady_bytes"] == full / cfg.period
    after = local["payload"][cfg.start_step :]
    whole_periods = len(after) // cfg.period * cfg.period
    assert sum(after[:whole_periods]) / whole_periods == local["steady_bytes"]
    assert local["payload"][: cfg.start_step] == [full] * cfg.start_step
    assert local["predicted"][: cfg.start_step] == [full] * cfg.start_step


# ---------------------------------------------------------------------- resume


def test_powersgd_resumes_exactly_although_ddp_reorders_its_buckets(results):
    resume = results["resume"]
    # The situation that needs care: a fresh DDP wrapper's first step uses other buckets than
    # the trained one, and the one after it the same as the trained one.
    assert resume["first_resumed_layout"] != resume["trained_layout"]
    assert resume["later_resumed_layout"] == resume["trained_layout"]
    assert torch.equal(resume["resumed"], resume["uninterrupted"])
    # Without the comm state (error feedback, warm-start Q, counter) the run goes elsewhere.
    assert not torch.allclose(
        resume["resumed_without_comm_state"], resume["uninterrupted"], rtol=0, atol=1e-4
    )
    assert resume["iter"] == worker.RESUME_AT + worker.RESUME_STEPS


# ---------------------------------------------------------------------- config rules


def _config(hook: str, **parallel) -> Config:
    return Config(comm=CommConfig(hook=hook), parallel=ParallelConfig(**parallel))


def test_powersgd_trains_on_after_a_skipped_non_finite_step(results):
    """A NaN step's compressed gradients reach PowerSGD's memories (the error feedback and the
    warm-started factors); ``discard_error_feedback`` drops them all, so the steps after the
    skipped one train on finite values."""
    losses = results["nonfinite"]
    nan_at = worker.NAN_AT
    assert all(torch.isfinite(torch.tensor(losses[:nan_at]))), losses
    assert all(torch.isfinite(torch.tensor(losses[nan_at + 1 :]))), losses


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd", "local_sgd"])
def test_hooks_need_ddp(hook):
    with pytest.raises(
        ConfigError,
        match=f"comm.hook={hook} needs parallel.strategy=ddp or zero1; "
        "FSDP reduces gradients itself",
    ):
        validate_comm(_config(hook, strategy="fsdp"), world_size=2)
    for degree in ({"tp": 2}, {"pp": 2}):
        with pytest.raises(ConfigError, match="parallel.tp|parallel.pp"):
            validate_comm(_config(hook, **degree), world_size=4)
    validate_comm(_config(hook), world_size=2)


def test_none_is_valid_everywhere():
    validate_comm(_config("none", strategy="fsdp", tp=2), world_size=4)


def test_local_sgd_rejects_zero1_and_powersgd_accepts_it():
    with pytest.raises(ConfigError, match="local_sgd cannot run with parallel.strategy=zero1"):
        validate_comm(_config("local_sgd", strategy="zero1"), world_size=2)
    validate_comm(_config("powersgd", strategy="zero1"), world_size=2)


def test_unknown_hook_and_bad_numbers():
    with pytest.raises(ConfigError, match="comm.hook='powerSGD' is not one of"):
        validate_comm(_config("powerSGD"), world_size=2)
    bad = [
        CommConfig(hook="powersgd", powersgd=PowerSGDConfig(rank=0)),
        CommConfig(hook="powersgd", powersgd=PowerSGDConfig(start_iter=1)),
        CommConfig(hook="powersgd", powersgd=PowerSGDConfig(min_compression_rate=0)),
        CommConfig(hook="local_sgd", local_sgd=LocalSGDConfig(period=0)),
        CommConfig(hook="local_sgd", local_sgd=LocalSGDConfig(start_step=-1)),
    ]
    keys = [
        "comm.powersgd.rank=0",
        "comm.powersgd.start_iter=1",
        "comm.powersgd.min_compression_rate=0",
        "comm.local_sgd.period=0",
        "comm.local_sgd.start_step=-1",
    ]
    for comm, key in zip(bad, keys):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate_comm(Config(comm=comm), world_size=2)
    # Without error feedback and warm start, PowerSGD may compress from the first step.
    validate_comm(
        Config(
            comm=CommConfig(
                hook="powersgd",
                powersgd=PowerSGDConfig(start_iter=0, use_error_feedback=False, warm_start=False),
            )
        ),
        world_size=2,
    )


def test_batched_powersgd_is_refused_while_torch_cannot_run_it():
    cfg = Config(comm=CommConfig(hook="powersgd", powersgd=PowerSGDConfig(batched=True)))
    if batched_powersgd_works():
        validate_comm(cfg, world_size=2)
    else:
        with pytest.raises(ConfigError, match="comm.powersgd.batched=true"):
            validate_comm(cfg, world_size=2)
