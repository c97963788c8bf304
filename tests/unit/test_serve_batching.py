"""Dynamic batching (sdnet_trainer.serve.batching) on an event loop of its own, no HTTP."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sdnet_trainer.serve.batching import Batcher, QueueFull, Stopped


class Recorder:
    """A batch function that doubles each item and records the batches it was given."""

    def __init__(self, fail_on: object = None, item_error: object = None) -> None:
        self.batches: list[list[int]] = []
        self.threads: set[str] = set()
        self.fail_on, self.item_error = fail_on, item_error

    def __call__(self, items: list[int]) -> list[object]:
        self.batches.append(list(items))
        self.threads.add(threading.current_thread().name)
        if self.fail_on in items:
            raise RuntimeError("the model broke")
        return [ValueError(f"bad {i}") if i == self.item_error else 2 * i for i in items]


async def _submit_all(batcher: Batcher, items: list[int], *, spacing: float = 0.0) -> list:
    batcher.start()
    try:
        tasks = []
        for item in items:
            tasks.append(asyncio.ensure_future(batcher.submit(item)))
            await asyncio.sleep(spacing)
        return await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await batcher.stop()


def test_requests_within_the_wait_run_as_one_batch_in_the_model_thread():
    run = Recorder()
    batcher = Batcher(run, max_batch_size=8, max_wait_ms=200)
    results = asyncio.run(_submit_all(batcher, [1, 2, 3, 4, 5], spacing=0.005))
    assert results == [2, 4, 6, 8, 10]
    assert run.batches == [[1, 2, 3, 4, 5]]
    assert len(run.threads) == 1 and run.threads.pop().startswith("sdnet-serve-model")


def test_a_batch_holds_at_most_max_batch_size():
    run = Recorder()
    batcher = Batcher(run, max_batch_size=4, max_wait_ms=200)
    results = asyncio.run(_submit_all(batcher, [*range(10)]))
    assert results == [2 * i for i in range(10)]
    assert [len(b) for b in run.batches] == [4, 4, 2]
    assert [i for b in run.batches for i in b] == list(range(10))  # arrival order


@pytest.mark.parametrize("size, wait", [(1, 200), (8, 0)])
def test_batch_size_one_or_no_wait_runs_every_request_alone(size, wait):
    run = Recorder()
    batcher = Batcher(run, max_batch_size=size, max_wait_ms=wait)
    results = asyncio.run(_submit_all(batcher, [1, 2, 3]))
    assert results == [2, 4, 6]
    assert run.batches == [[1], [2], [3]]


def test_the_wait_is_counted_from_the_first_request():
    """A request arriving after max_wait_ms of the first goes to the next batch."""
    run = Recorder()

    async def scenario() -> list:
        batcher = Batcher(run, max_batch_size=8, max_wait_ms=30)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.3)
        second = asyncio.ensure_future(batcher.submit(2))
        results = await asyncio.gather(first, second)
        await batcher.stop()
        return results

    assert asyncio.run(scenario()) == [2, 4]
    assert run.batches == [[1], [2]]


def test_an_items_error_reaches_only_its_caller():
    run = Recorder(item_error=2)
    results = asyncio.run(_submit_all(Batcher(run, max_batch_size=8, max_wait_ms=100), [1, 2, 3]))
    assert results[0] == 2 and results[2] == 6
    assert isinstance(results[1], ValueError) and str(results[1]) == "bad 2"


def test_a_failed_batch_fails_its_callers_and_the_next_batch_runs():
    run = Recorder(fail_on=2)

    async def scenario() -> tuple[list, int]:
        batcher = Batcher(run, max_batch_size=8, max_wait_ms=100)
        batcher.start()
        failed = await asyncio.gather(batcher.submit(1), batcher.submit(2), return_exceptions=True)
        after = await batcher.submit(5)
        await batcher.stop()
        return failed, after

    failed, after = asyncio.run(scenario())
    assert all(isinstance(r, RuntimeError) for r in failed) and after == 10


def test_callers_that_went_away_are_skipped():
    run = Recorder()

    async def scenario() -> int:
        batcher = Batcher(run, max_batch_size=8, max_wait_ms=100)
        batcher.start()
        gone = asyncio.ensure_future(batcher.submit(1))
        kept = asyncio.ensure_future(batcher.submit(2))
        await asyncio.sleep(0)  # both queued
        gone.cancel()  # a client that disconnected
        result = await kept
        await batcher.stop()
        return result

    assert asyncio.run(scenario()) == 4
    assert run.batches == [[2]]


def test_a_full_queue_and_a_stopped_batcher_refuse():
    run = Recorder()

    async def scenario() -> None:
        batcher = Batcher(run, max_batch_size=2, max_wait_ms=50, max_queue=2)
        with pytest.raises(Stopped):
            await batcher.submit(1)  # not started
        batcher.start()
        waiting = [asyncio.ensure_future(batcher.submit(i)) for i in range(3)]
        await asyncio.sleep(0)
        assert isinstance(waiting[2].exception(), QueueFull)
        assert await asyncio.gather(*waiting[:2]) == [0, 2]
        await batcher.stop()
        with pytest.raises(Stopped):
            await batcher.submit(1)

    asyncio.run(scenario())


def test_stopping_fails_the_requests_still_waiting():
    release = threading.Event()

    def slow(items: list[int]) -> list[int]:
        release.wait(5)
        return items

    async def scenario() -> list:
        batcher = Batcher(slow, max_batch_size=1, max_wait_ms=0)
        batcher.start()
        running = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.05)  # in the model thread
        waiting = asyncio.ensure_future(batcher.submit(2))
        await asyncio.sleep(0)
        stopping = asyncio.ensure_future(batcher.stop())
        await asyncio.sleep(0.05)
        release.set()
        await stopping
        return await asyncio.gather(running, waiting, return_exceptions=True)

    results = asyncio.run(scenario())
    assert results[0] == 1  # the batch in flight finished and answered
    assert isinstance(results[1], Stopped)
