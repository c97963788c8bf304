"""The checkpoint lock is fenced: a holder whose lock another run took over writes nothing more.

On the local S3 API (moto's server on 127.0.0.1, through s3fs): holder A stalls past its lease,
B takes the lock over, A wakes; A's renewal cannot write B's lock back, and A's next save (or the
commit of a save it started before the takeover) is refused naming the lock and B's run, with
nothing of A's written after the takeover. On a local disk the same, for a lock deleted by hand
(what the refusal of a second run advises when the first is thought gone)."""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from sdnet_trainer.checkpoint import MANIFEST, CheckpointManager, disk
from sdnet_trainer.checkpoint import lock as lock_module
from sdnet_trainer.checkpoint.lock import LOCK, LeaseLost

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# A lease of about a second, renewed five times in it: the stall and the takeover take seconds.
LEASE_S = 1.0


@pytest.fixture
def short_lease(monkeypatch):
    monkeypatch.setattr(lock_module, "LEASE_RENEW_S", LEASE_S / 5)
    monkeypatch.setattr(lock_module, "LEASE_EXPIRES_S", LEASE_S)


def manager(directory, run_id: str, *, async_save: bool = False) -> CheckpointManager:
    return CheckpointManager(
        directory, keep_last=5, async_save=async_save, rank=0, world_size=1, run_id=run_id
    )


def state(step: int) -> dict:
    return {"w": torch.full((100,), float(step)), "count": step}


@contextmanager
def stalled(m: CheckpointManager):
    """``m``'s holder stalls: its lease thread cannot renew (as in a process stopped, or one cut
    off from the store) until the block ends."""
    lease = m._lock.lock  # type: ignore[union-attr]
    with lease._renewing:
        yield


def take_over(directory, caplog) -> CheckpointManager:
    """Wait until the stalled holder's lease has expired, then start run-b on the folder."""
    time.sleep(LEASE_S + 0.3)
    with caplog.at_level(logging.WARNING, logger="sdnet_trainer.checkpoint"):
        taker = manager(directory, "run-b")
    assert "has not renewed its lease" in caplog.text
    return taker


def bucket(s3, url: str) -> dict[str, str]:
    """{object key: ETag} of every object under ``url`` but the lock (which run-b renews)."""
    found = s3.fs.find(s3.key(url), detail=True, refresh=True)
    return {key: info["ETag"] for key, info in found.items() if not key.endswith(LOCK)}


def lock_holder(s3, url: str) -> dict:
    return json.loads(s3.fs.cat(s3.key(f"{url}/{LOCK}")))


def test_a_holder_that_stalled_past_its_lease_cannot_save_or_renew_after_a_takeover(
    s3, short_lease, caplog
):
    url = f"{s3.url}/fenced"
    a = manager(url, "run-a")
    a.save(1, state(1))
    with stalled(a):
        b = take_over(url, caplog)
        after_takeover = bucket(s3, url)
        b_holder = lock_holder(s3, url)
        assert (b_holder["run_id"], b_holder["generation"]) == ("run-b", 2)
    # A wakes: its lease thread's renewal is refused (it does not write B's lock back) and says so.
    deadline = time.monotonic() + 5
    while "lost the checkpoint lock" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"run 'run-a' lost the checkpoint lock {url}/{LOCK} (generation 1)" in caplog.text
    assert "run 'run-b'" in caplog.text
    lock = f"{url}/{LOCK}"
    with pytest.raises(LeaseLost, match=f"lost the checkpoint lock {lock}.*run 'run-b'"):
        a._lock.fence()  # type: ignore[union-attr]  # a renewal, as the save makes first
    with pytest.raises(LeaseLost, match=f"lost the checkpoint lock {lock}.*run 'run-b'") as refused:
        a.save(2, state(2))
    assert "generation 2" in str(refused.value) and "writes nothing more" in str(refused.value)
    # Nothing of A's landed after the takeover; the lock is still B's, and B saves on.
    assert bucket(s3, url) == after_takeover
    assert lock_holder(s3, url)["token"] == b_holder["token"]
    b.save(2, state(2))
    assert [c.step for c in b.checkpoints()] == [1, 2]
    a.close()  # not A's lock any more: it stays
    assert lock_holder(s3, url)["token"] == b_holder["token"]
    b.close()
    s3.fs.invalidate_cache()  # the listings above are cached
    assert not s3.fs.exists(s3.key(lock))


def test_a_save_that_outlives_its_lease_is_never_committed(s3, short_lease, caplog, monkeypatch):
    """A's async upload stalls with A's lease; B takes over; the upload finishes, and the commit
    (the manifest, which alone makes a step count) is refused."""
    url = f"{s3.url}/fenced"
    a = manager(url, "run-a", async_save=True)
    gate = threading.Event()
    write = disk._ChecksummedStream.write

    def stalled_write(self, data):
        assert gate.wait(30), "the test never opened the gate"
        return write(self, data)

    monkeypatch.setattr(disk._ChecksummedStream, "write", stalled_write)
    a.save(1, state(1))  # staged in host memory; the upload waits at the gate
    with stalled(a):
        b = take_over(url, caplog)
    gate.set()
    with pytest.raises(LeaseLost, match=f"lost the checkpoint lock {url}/{LOCK}.*run 'run-b'"):
        a.wait()
    assert not s3.fs.exists(s3.key(f"{url}/step_00000001/{MANIFEST}"))
    assert b.checkpoints() == []
    a.close()
    b.close()


def test_a_disk_holder_whose_lock_was_replaced_cannot_save(tmp_path):
    a = manager(tmp_path, "run-a")
    a.save(1, state(1))
    (tmp_path / LOCK).unlink()  # "if that run is gone, delete checkpoint.lock": it was not
    b = manager(tmp_path, "run-b")
    after_takeover = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(LeaseLost, match=f"lost the checkpoint lock {tmp_path / LOCK}.*'run-b'"):
        a.save(2, state(2))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == after_takeover
    a.close()
    assert json.loads((tmp_path / LOCK).read_text())["run_id"] == "run-b"
    b.close()
