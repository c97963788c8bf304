"""Dynamic batching: requests that arrive close together run through the model as one batch.

One asyncio queue and one task. The task takes the first waiting request, then collects more
until ``max_batch_size`` are together or ``max_wait_ms`` have passed since it took the first, and
runs the batch in the model's thread (one thread: the model runs one batch at a time, and
torch's own threads parallelize inside it). Requests that arrive meanwhile wait in the queue for
the next batch. ``max_batch_size=1`` or ``max_wait_ms=0`` turns batching off: every request runs
by itself, in arrival order.

The batch function returns one result per item, in order; an item's result may be an exception,
which only that item's caller receives. A caller that went away (its client disconnected) is
skipped when its batch is formed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar, Union

In = TypeVar("In")
Out = TypeVar("Out")


class QueueFull(RuntimeError):
    """More requests are waiting than the server takes (``max_queue``)."""


class Stopped(RuntimeError):
    """The server is shutting down."""


class Batcher(Generic[In, Out]):
    def __init__(
        self,
        run: Callable[[list[In]], Sequence[Union[Out, BaseException]]],
        *,
        max_batch_size: int,
        max_wait_ms: float,
        max_queue: int = 1024,
        observe: Callable[[int], None] | None = None,
    ) -> None:
        self.run = run
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000
        self.max_queue = max_queue
        self.observe = observe  # called with each batch's size
        self._queue: asyncio.Queue[tuple[In, asyncio.Future[Out]]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: asyncio.Future[Any] | None = None

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 1 and self.max_wait > 0

    def start(self) -> None:
        """Start the batching task on the running event loop."""
        self._queue = asyncio.Queue()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="sdnet-serve-model")
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="sdnet-batcher")

    async def stop(self) -> None:
        """Stop taking batches: the batch in flight finishes and answers its callers, the
        requests still waiting get Stopped."""
        task, queue, executor = self._task, self._queue, self._executor
        self._task = None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._inflight is not None:
            await asyncio.wait([self._inflight])
        while queue is not None and not queue.empty():
            _, future = queue.get_nowait()
            if not future.done():
                future.set_exception(Stopped("the server is shutting down"))
        if executor is not None:
            executor.shutdown(wait=False)  # idle: the batch in flight has finished

    @property
    def waiting(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    async def submit(self, item: In) -> Out:
        """The result of ``item``, once its batch has run."""
        if self._task is None or self._queue is None:
            raise Stopped("the model is not serving")
        if self._queue.qsize() >= self.max_queue:
            raise QueueFull(f"{self._queue.qsize()} requests are waiting (max_queue)")
        future: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((item, future))
        return await future

    async def _loop(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            if self.batching:
                deadline = loop.time() + self.max_wait
                while len(batch) < self.max_batch_size:
                    if not self._queue.empty():
                        batch.append(self._queue.get_nowait())
                        continue
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        # Cancelling a waiting get() leaves the queue untouched: nothing is lost.
                        batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                    except asyncio.TimeoutError:
                        break
            live = [(item, future) for item, future in batch if not future.done()]
            if live:
                await self._run(loop, live)

    async def _run(
        self, loop: asyncio.AbstractEventLoop, live: list[tuple[In, asyncio.Future[Out]]]
    ) -> None:
        if self.observe is not None:
            self.observe(len(live))
        inflight = loop.run_in_executor(self._executor, self.run, [item for item, _ in live])
        # The callers are answered by the batch's own callback: when stop() cancels the loop
        # while the model runs, the batch still finishes and answers them.
        inflight.add_done_callback(lambda done: _answer(live, done))
        self._inflight = inflight
        await asyncio.wait([inflight])  # cancelling this wait leaves the batch running
        self._inflight = None


def _answer(live: list[tuple[Any, asyncio.Future[Any]]], done: asyncio.Future[Any]) -> None:
    """Each caller's result, or the batch's error for every caller when it failed as a whole."""
    error = done.exception() if not done.cancelled() else Stopped("the server is shutting down")
    results = None if error is not None else done.result()
    if results is not None and len(results) != len(live):
        error = RuntimeError(f"{len(results)} results for a batch of {len(live)}")
    for i, (_, future) in enumerate(live):
        if future.done():
            continue
        result = error if error is not None else results[i]  # type: ignore[index]
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
