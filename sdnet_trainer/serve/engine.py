"""Continuous batching: requests join the decoding batch at the next step and leave when they end.

One thread runs the model (torch's own threads parallelize inside each step). It loops while
there is work: the requests waiting join the batch (:class:`~sdnet_trainer.serve.decoding.
RunningBatch`: prefilled together, each picks its first token), then every row of the batch
generates one token (a decode step). A row leaves as soon as it ends: a stop token, its
``max_new_tokens``, or its caller aborted (a streaming client that disconnected: it leaves at
the next step). At most ``max_batch_size`` rows run; more requests wait, and beyond
``max_queue`` waiting a request is refused (QueueFull: 503 with Retry-After).

``continuous=False`` is static batching, the reference the benchmark compares against: requests
join only an empty batch (the first waits up to ``max_wait_ms`` for others), which then runs
until its last row ends.

Each request is a :class:`Stream`: an async iterator of its token ids, on the event loop that
submitted it; :attr:`Stream.finish_reason` says how it ended. The model's errors reach every
request of the batch that failed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from sdnet_trainer.serve.args import ServeArgs
from sdnet_trainer.serve.batching import QueueFull, Stopped
from sdnet_trainer.serve.decoding import (
    ABORT,
    LENGTH,
    STOP,
    Decoder,
    Job,
    Row,
    RunningBatch,
    splittable,
)
from sdnet_trainer.serve.errors import ModelError
from sdnet_trainer.serve.language import LanguageModel
from sdnet_trainer.serve.metrics import EngineMetrics

logger = logging.getLogger(__name__)


class _Finished:
    """The last item of a request's queue."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


@dataclass(eq=False)
class _Request:
    job: Job
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    arrived: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    sent: int = 0  # tokens handed to the caller
    aborted_at: int | None = None  # the engine's step count when the caller aborted
    row: Row | None = None

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its event loop has closed: nobody is listening any more
            pass


class Stream:
    """One request's generated token ids, as they come (``async for``); then
    :attr:`finish_reason`: ``stop``, ``length`` (or ``abort`` after :meth:`abort`)."""

    def __init__(self, engine: Engine, request: _Request) -> None:
        self._engine = engine
        self._request = request
        self._next: Any = None  # the end (or an error) that ready() took off the queue
        self.finish_reason: str | None = None

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> int:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        item, self._next = self._next, None
        if item is None:
            item = await self._request.queue.get()
        if isinstance(item, _Finished):
            self.finish_reason = item.reason
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finish_reason = ABORT
            raise item
        return int(item)

    def ready(self) -> list[int]:
        """The tokens that came already, without waiting: a reader that fell behind the decode
        steps takes them together (a stream sends them as one chunk)."""
        tokens: list[int] = []
        queue = self._request.queue
        while self._next is None and not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, int):
                tokens.append(item)
            else:
                self._next = item  # the end: the next __anext__ takes it
        return tokens

    async def tokens(self) -> list[int]:
        """Every token, once the request ended."""
        return [token async for token in self]

    def abort(self) -> None:
        """The caller is gone: the request leaves the batch at the next step (or never joins)."""
        self._engine.abort(self._request)


class Engine:
    def __init__(
        self,
        decoder: Decoder,
        *,
        stop_ids: Sequence[int] = (),
        max_batch_size: int,
        max_queue: int,
        context: int,
        continuous: bool = True,
        max_wait_ms: float = 0.0,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.batch = RunningBatch(decoder, stop_ids=stop_ids)
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.context = context
        self.continuous = continuous
        self.max_wait = max_wait_ms / 1000
        # Without the server's: a registry of its own, read by nobody (tests, benchmarks).
        self.metrics = metrics or EngineMetrics(CollectorRegistry())
        self.steps = 0  # decode steps so far
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}  # id(row) -> its request
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the event loop's side

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="sdnet-serve-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Finish the step in flight; every request still waiting or running gets Stopped."""
        thread = self._thread
        self._thread = None
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, thread.join)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> Stream:
        """Queue ``job``; its tokens come through the returned stream (on this event loop)."""
        request = _Request(job, asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            if self._thread is None or self._stopping:
                raise Stopped("the model is not serving")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue)")
            self._waiting.append(request)
            self._cond.notify_all()
        self._gauges()
        return Stream(self, request)

    def abort(self, request: _Request) -> None:
        with self._cond:
            if request.aborted_at is None:
                request.aborted_at = self.steps
            self._cond.notify_all()

    # ------------------------------------------------------------------ the model thread's side

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    break
                joining = self._joining()
            try:
                self._iterate(joining)
            except Exception as err:  # the model failed: every request of the batch hears it
                logger.exception("the model failed in a decode step")
                failure = ModelError.of(err)
                for request in [*joining, *self._running.values()]:
                    request.put(failure)
                self._running.clear()
                self.batch.drop(list(self.batch.rows))
            self._gauges()
        stopped = Stopped("the server is shutting down")
        with self._cond:
            for request in [*self._waiting, *self._running.values()]:
                request.put(stopped)
            self._waiting.clear()
            self._running.clear()
        self._gauges()

    def _joining(self) -> list[_Request]:
        """The waiting requests that join the batch now (under the lock)."""
        if not self.continuous and self._running:
            return []
        if not self.continuous and self.max_wait > 0 and self._waiting:
            # Static batching: the first request waits for others, as a dynamic batcher does.
            deadline = self._waiting[0].arrived + self.max_wait
            while len(self._waiting) < self.max_batch_size and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        joining: list[_Request] = []
        while self._waiting and len(self._running) + len(joining) < self.max_batch_size:
            request = self._waiting.popleft()
            if request.aborted_at is not None:  # left before it started
                self._finish(request, ABORT)
                continue
            joining.append(request)
        return joining

    def _iterate(self, joining: list[_Request]) -> None:
        """One round: aborted rows leave, the batch steps, the joining requests prefill."""
        aborted = [r for r in self._running.values() if r.aborted_at is not None]
        if aborted:
            rows = [r.row for r in aborted if r.row is not None]
            self.batch.drop(rows)
            for request in aborted:
                self.metrics.abort_steps.observe(self.steps - (request.aborted_at or 0))
            self._emit(rows)
        if self.batch.rows:
            self._emit(self.batch.step())
            self.steps += 1
            self.metrics.steps.inc()
        if joining:
            rows = self.batch.add([request.job for request in joining])
            for request, row in zip(joining, rows):
                request.row = row
                self._running[id(row)] = request
                self.metrics.prompt_tokens.inc(len(request.job.tokens))
            self._emit(rows)

    def _emit(self, rows: list[Row]) -> None:
        """Hand each row's new tokens to its request; end the requests whose rows ended."""
        now = time.monotonic()
        for row in rows:
            request = self._running.get(id(row))
            if request is None:
                continue
            for token in row.tokens[request.sent :]:
                request.put(token)
                self.metrics.generation_tokens.inc()
                if request.last_token is None:
                    self.metrics.first_token.observe(now - request.arrived)
                else:
                    self.metrics.inter_token.observe(now - request.last_token)
                request.last_token = now
            request.sent = len(row.tokens)
            if row.finish_reason is not None:
                del self._running[id(row)]
                self._finish(request, row.finish_reason)

    def _finish(self, request: _Request, reason: str) -> None:
        request.put(_Finished(reason))
        self.metrics.finished.labels(reason).inc()

    def _gauges(self) -> None:
        self.metrics.running.set(len(self._running))
        self.metrics.waiting.set(len(self._waiting))
        held = len(self.batch.rows) * self.batch.columns
        self.metrics.kv_cache.set(held / (self.max_batch_size * self.context))


def engine_for(model: LanguageModel, args: ServeArgs, metrics: EngineMetrics) -> Engine | None:
    """The continuous-batching engine of a model with a KV cache whose rows can join and leave
    between steps; None otherwise (its requests run as whole batches)."""
    if model.decoder is None:
        return None
    why_not = splittable(model.decoder)
    if why_not is not None:
        logger.warning("requests run as whole batches: %s", why_not)
        return None
    return Engine(
        model.decoder,
        stop_ids=model.stop_ids,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        context=model.context,
        continuous=args.continuous_batching,
        max_wait_ms=args.max_wait_ms,
        metrics=metrics,
    )


class Whole:
    """A batch's whole result as a stream (a model without a KV cache): the tokens once they
    all came; ``finish_reason`` stop when the last is a stop token, else length."""

    def __init__(self, result: asyncio.Future[list[int]], stops: set[int]) -> None:
        self.result = result
        self.stops = stops
        self.finish_reason: str | None = None

    async def __aiter__(self) -> AsyncIterator[int]:
        tokens = await self.result
        for token in tokens:
            yield token
        self.finish_reason = STOP if tokens and tokens[-1] in self.stops else LENGTH

    def ready(self) -> list[int]:
        return []

    async def tokens(self) -> list[int]:
        return [token async for token in self]

    def abort(self) -> None:
        self.result.cancel()  # a batch not yet formed skips it
