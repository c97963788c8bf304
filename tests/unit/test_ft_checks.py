"""fault_tolerance.* before launch: the keys, the refused combinations naming their keys, the
missing extra, and an unreachable lighthouse failing within the connect timeout."""

from __future__ import annotations

import builtins
import socket
import time

import pytest

from sdnet_trainer.config import compose
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.ft import check_lighthouse, validate_ft
from sdnet_trainer.preflight import validate
from tests.support import TINY

pytestmark = pytest.mark.full

FT = [
    *TINY,
    "loop.max_steps=4",
    "loop.global_batch_size=12",
    "fault_tolerance.enabled=true",
    "fault_tolerance.groups=3",
    "fault_tolerance.lighthouse=http://localhost:1",
]


def test_a_valid_config_passes_and_disabled_is_not_checked():
    validate(compose(FT), world_size=1)
    validate_ft(compose([*TINY, "fault_tolerance.groups=0"]), 1)  # disabled: keys unread


def test_fsdp_inside_a_group_is_served_in_sync_mode():
    """HSDP across groups: FSDP2 within each group, the groups averaged by torchft (sync)."""
    validate(compose([*FT, "parallel=fsdp"]), world_size=2)
    validate_ft(compose([*FT, "parallel.strategy=fsdp", "fault_tolerance.mode=sync"]), 2)


@pytest.mark.parametrize(
    "override, keys",
    [
        ("parallel.pp=2", "parallel.pp"),
        ("parallel.strategy=zero1", "parallel.strategy=zero1"),
        ("comm.hook=powersgd", "comm.hook=powersgd"),
        ("comm.hook=local_sgd", "comm.hook=local_sgd"),
        ("elastic.enabled=true", "elastic.enabled"),
        ("loop.grad_accum_steps=2", "loop.grad_accum_steps"),
        ("data.mixup_alpha=0.2", "data.mixup_alpha"),
        ("precision.dtype=fp16", "precision.dtype=fp16"),
    ],
)
def test_combinations_torchft_cannot_serve_name_their_keys(override, keys):
    with pytest.raises(ConfigError) as err:
        validate_ft(compose([*FT, override]), 2 if "pp" in override else 1)
    message = str(err.value)
    assert "fault_tolerance.enabled=true cannot be combined with" in message
    assert keys in message


# The refusals' messages, word for word: the keys and the reason each names.
REFUSED = "fault_tolerance.enabled=true cannot be combined with"
REFUSAL_MESSAGES = {
    "parallel.pp=2": "parallel.pp: pipeline stages cannot be recovered from a peer",
    "parallel.tp=2": "parallel.tp: tensor-parallel shards are not averaged across groups",
    "parallel.strategy=zero1": (
        "parallel.strategy=zero1: ZeRO-1's sharded optimizer state cannot be sent to a joining "
        "group"
    ),
    "comm.hook=powersgd": (
        "comm.hook=powersgd: the gradients cross groups through torchft's process group, not a "
        "DDP comm hook"
    ),
    "elastic.enabled=true": "elastic.enabled: the replica groups replace elastic restarts",
    "loop.grad_accum_steps=2": (
        "loop.grad_accum_steps: each rank's share of a step is one micro-batch (leave "
        "loop.micro_batch_size null)"
    ),
    "data.mixup_alpha=0.2": (
        "data.mixup_alpha/cutmix_alpha: batch mixing is not divided among the groups"
    ),
    "precision.dtype=fp16": (
        "precision.dtype=fp16: the GradScaler's skips are not agreed across groups; use bf16 or "
        "fp32"
    ),
}


@pytest.mark.parametrize("override", list(REFUSAL_MESSAGES))
def test_the_refusals_messages_are_unchanged(override):
    parallel = "pp" in override or "tp" in override
    with pytest.raises(ConfigError) as err:
        validate_ft(compose([*FT, override]), 2 if parallel else 1)
    assert str(err.value) == f"{REFUSED} {REFUSAL_MESSAGES[override]}"


def test_a_mixture_of_experts_balanced_by_its_routing_bias_is_refused():
    """The auxiliary loss's weight counts the groups (tests/distributed/test_ft.py); the bias
    would move by each group's load alone."""
    moe = [*FT, "model=moe_debug", "data=tokens", "data.vocab_size=256", "data.seq_len=64"]
    validate_ft(compose(moe), 1)
    with pytest.raises(ConfigError) as err:
        validate_ft(compose([*moe, "model.moe.load_balance=bias"]), 1)
    assert str(err.value) == (
        f"{REFUSED} model.moe.load_balance=bias: the experts' load is summed inside a group "
        f"only, so the groups' routing biases would drift apart; use "
        f"model.moe.load_balance=aux_loss"
    )


@pytest.mark.parametrize("mode", ["local_sgd", "diloco"])
def test_fsdp_is_still_refused_in_the_semi_sync_modes(mode):
    cfg = compose([*FT, "parallel=fsdp", f"fault_tolerance.mode={mode}"])
    with pytest.raises(ConfigError) as err:
        validate_ft(cfg, 2)
    assert str(err.value) == (
        f"{REFUSED} parallel.strategy=fsdp under fault_tolerance.mode={mode}: LocalSGD and "
        f"DiLoCo are not set up for FSDP's sharded parameters; FSDP inside a group (HSDP across "
        f"groups) needs fault_tolerance.mode=sync, or use parallel.strategy=ddp"
    )


@pytest.mark.parametrize(
    "override, match",
    [
        ("fault_tolerance.mode=diloko", r"fault_tolerance.mode='diloko'.*did you mean 'diloco'"),
        ("fault_tolerance.min_groups=4", r"min_groups=4 exceeds fault_tolerance.groups=3"),
        ("fault_tolerance.replica_group=3", r"replica_group=3 must be in \[0, "),
        ("fault_tolerance.timeouts.step_s=5", r"connect_s \(10\) <= step_s \(5\)"),
        ("fault_tolerance.timeouts.quorum_s=20", r"step_s \(30\) <= quorum_s \(20\)"),
        ("fault_tolerance.outer_momentum=1.0", r"outer_momentum=1.0 must be in \[0, 1\)"),
        # sync: every quorum of 1..3 groups divides the batch, so it must be a multiple of 6
        ("loop.global_batch_size=8", r"global_batch_size=8 must be a multiple of 6"),
        ("fault_tolerance.lighthouse=null", r"needs the lighthouse's address"),
    ],
)
def test_bad_keys_are_named(override, match, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=match):
        validate(compose([*FT, override]), world_size=1)


def test_semi_sync_shares_need_only_the_group_count():
    validate_ft(compose([*FT, "fault_tolerance.mode=diloco", "loop.global_batch_size=6"]), 1)
    with pytest.raises(ConfigError, match="multiple of 6 under fault_tolerance.mode=local_sgd"):
        validate_ft(compose([*FT, "fault_tolerance.mode=local_sgd", "loop.global_batch_size=8"]), 2)


def test_missing_torchft_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_torchft(name, *args, **kwargs):
        if name == "torchft" or name.startswith("torchft."):
            raise ImportError("No module named 'torchft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchft)
    with pytest.raises(ConfigError, match=r"needs torchft.*pip install 'sdnet_trainer\[ft\]'"):
        validate(compose(FT), world_size=1)


def _refused_port() -> int:
    with socket.socket() as sock:  # bound, then closed: nothing listens there
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def test_unreachable_lighthouse_fails_within_the_connect_timeout():
    address = f"http://localhost:{_refused_port()}"
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        check_lighthouse(address, connect_s=1.5)
    elapsed = time.monotonic() - started
    assert address in str(err.value) and "timeouts.connect_s=1.5" in str(err.value)
    assert elapsed < 1.5 + 5  # the timeout, plus the client's own start-up on a loaded machine


def test_a_group_advertises_its_store_by_a_name_other_hosts_reach():
    """torchrun --standalone sets MASTER_ADDR=localhost: the other groups, maybe on other hosts,
    are given this host's name instead; a real address passes as it is."""
    from sdnet_trainer.ft.room import reachable

    for loopback in ("localhost", "127.0.0.1", "::1"):
        assert reachable(loopback) == socket.gethostname()
    assert reachable("node-7.cluster") == "node-7.cluster"
