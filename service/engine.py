"""The inference engine: a bounded queue, dynamic batching, one worker thread per device.

Requests become ``Job``s. ``Engine.infer`` admits a job or refuses it at once
(queue full, not accepting), then awaits its result until the job's deadline.
Each worker thread takes the oldest job of the model served least recently
(round robin over the models with queued jobs, so that a slow model's backlog
delays another model's request by at most one batch, not by the whole backlog)
and gathers the queued jobs with the same ``batch_key`` (same model, image shape
and batch-wide options) up to ``max_batch_size`` jobs and ``max_batch_pixels``
pixels. It waits up to ``batch_wait_seconds`` for more only while other requests
are still being decoded (``incoming``), since otherwise nothing can join. Blocking torch work
runs only on the workers, never on the event loop.

Each worker first runs ``prepare(device)`` on its own thread (the service selects
the device there and warms the models up, so the thread's CUDA handles exist
before the first request); ``start`` returns, and the engine admits requests,
once every worker has prepared.

When the runner refuses a batch with a 503 (the device ran out of memory), the
batch's requests get that 503 and the batch limit halves (a single request's
refusal leaves it alone); it grows back by one after ``RECOVERY_BATCHES`` full
batches succeed at the lower limit. A failed batch is retried request by
request only after its exception is gone, so the failed attempt's tensors are
freed before the retry runs.

When the runner raises ``DeviceFailedError`` (a sticky device error), or ``prepare``
fails, the device is retired: its worker ends, the batch's and every queued
request get 503 ``device_failed``, new requests are refused, and ``failure``
names the device (the service then exits so that it is restarted).

Admission counts from arrival: ``admit`` refuses a request (503 ``queue_full``)
when the queued requests plus those admitted but not yet queued (uploading,
decoding) fill the queue, so a burst is refused before its uploads are read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.errors import ApiError, DeviceFailedError
from service.logs import REQUEST_ID
from service.metrics import Metrics

log = logging.getLogger("kdeq.service")

RECOVERY_BATCHES = 20


@dataclass(eq=False)
class Ticket:
    """A request announced by ``Engine.incoming``; ``used`` once it reached the queue (or gave up)."""

    used: bool = False


@dataclass(eq=False)
class Job:
    """One request's work: ``payload`` for the batch runner, compatible jobs share ``batch_key``;
    ``target`` is what the runner solves it with (the service: the model it was admitted with, which a
    model loaded meanwhile does not change)."""

    endpoint: str
    model: str
    batch_key: Hashable
    payload: Any
    pixels: int
    deadline: float
    target: Any = None
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    future: asyncio.Future = field(init=False)
    enqueued_at: float = field(init=False, default=0.0)
    started_at: float = field(init=False, default=0.0)
    batch_size: int = field(init=False, default=0)
    # the request's ID (``logs.REQUEST_ID`` where the job is made): the worker's lines about a batch
    # name the requests in it
    request_id: str | None = field(default_factory=REQUEST_ID.get)

    def __post_init__(self) -> None:
        self.future = self.loop.create_future()


def _ids(batch: Sequence[Job]) -> str:
    """The batch's request IDs for a log line: ``requests a1, b2``."""
    return "requests " + ", ".join(str(job.request_id) for job in batch)


# runs a batch of compatible jobs on a device; returns one result per job, in order
BatchRunner = Callable[[str, Sequence[Job]], Sequence[Any]]
# readies a worker thread for its device before it takes any batch
Prepare = Callable[[str], None]


class Engine:
    """The queue and its workers; see the module docstring."""

    def __init__(
        self,
        run_batch: BatchRunner,
        metrics: Metrics,
        *,
        queue_size: int,
        max_batch_size: int,
        max_batch_pixels: int,
        batch_wait_seconds: float,
    ) -> None:
        self.run_batch = run_batch
        self.metrics = metrics
        self.queue_size = queue_size
        self.max_batch_size = max_batch_size
        self.max_batch_pixels = max_batch_pixels
        self.batch_wait = batch_wait_seconds
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._incoming = 0
        self._stopping = False
        self._accepting = False
        self._threads: list[threading.Thread] = []
        self.failures: dict[str, str] = {}
        self.batch_limit = max_batch_size
        self._streak = 0
        # when each model's last batch was taken (a counter, not a clock: ties cannot happen)
        self._served: dict[str, int] = {}
        self._turn = 0
        metrics.batch_limit.set(max_batch_size)

    def start(self, devices: Sequence[str], prepare: Prepare | None = None) -> None:
        """Start one worker thread per device, each running ``prepare(device)`` first; return, and
        admit requests, once every worker has prepared (or failed to)."""
        prepared = []
        for device in devices:
            done = threading.Event()
            thread = threading.Thread(
                target=self._work, args=(device, prepare, done), name=f"kdeq-worker-{device}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
            prepared.append(done)
        for done in prepared:
            done.wait()
        with self._cond:
            self._accepting = True

    def stop(self) -> None:
        """Let the workers finish every queued job, then end them."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    @property
    def depth(self) -> int:
        """Requests waiting in the queue."""
        return len(self._queue)

    @property
    def alive(self) -> bool:
        """Whether every worker thread is running."""
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    @property
    def failure(self) -> str | None:
        """``device: reason`` of the first retired device, ``None`` while every device is healthy."""
        return next((f"{device}: {reason}" for device, reason in self.failures.items()), None)

    def admit(self) -> Ticket:
        """Count a new request against the queue's capacity from its arrival (before its upload is
        read) until ``infer`` queues it or ``release`` gives the place back; raises the 503 it gets
        when the engine is not running or queued plus admitted requests fill the queue."""
        with self._cond:
            refusal = self._refusal(self._incoming)
            if refusal is not None:
                raise refusal
            self._incoming += 1
            return Ticket()

    def release(self, ticket: Ticket) -> None:
        """Give back an admitted request's place if it never reached the queue."""
        with self._cond:
            self._arrived(ticket)
            self._cond.notify_all()

    @contextlib.contextmanager
    def incoming(self) -> Iterator[Ticket]:
        """``admit`` for the length of a block, then ``release``; batches wait while such requests
        (admitted, not yet queued) exist, since they can still join."""
        ticket = self.admit()
        try:
            yield ticket
        finally:
            self.release(ticket)

    def _arrived(self, ticket: Ticket | None) -> None:
        # called with the lock held, so a worker never sees the request neither incoming nor queued
        if ticket is not None and not ticket.used:
            ticket.used = True
            self._incoming -= 1

    def _refusal(self, admitted: int) -> ApiError | None:
        """The 503 for a new request now (stopping, a device failed, not started, or ``admitted`` +
        queued fill the queue), counted."""
        if self.failures:
            return self._failed_device()
        if self._stopping or not self._accepting:
            reason = "draining" if self._stopping else "not_ready"
            self.metrics.rejected.labels(reason).inc()
            return ApiError(503, reason, "the inference engine is not running", {"Retry-After": "5"})
        if len(self._queue) + admitted >= self.queue_size:
            self.metrics.rejected.labels("queue_full").inc()
            return ApiError(
                503,
                "queue_full",
                f"the queue holds {self.queue_size} requests; retry shortly",
                {"Retry-After": "1"},
            )
        return None

    def _failed_device(self) -> DeviceFailedError:
        """The 503 for a request that can no longer be served because a device failed, counted."""
        self.metrics.rejected.labels("device_failed").inc()
        device, reason = next(iter(self.failures.items()))
        return DeviceFailedError(device, reason)

    async def infer(self, job: Job, ticket: Ticket | None = None) -> Any:
        """Queue ``job`` and await its result; 503 when the queue is full, 504 past the deadline."""
        with self._cond:
            self._arrived(ticket)
            # an admitted request already holds its place (and is served while draining); one
            # without a ticket must find one; after a device failure nothing is queued
            refusal = self._refusal(0) if ticket is None or self.failures else None
            if refusal is not None:
                raise refusal
            job.enqueued_at = time.monotonic()
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify_all()
        try:
            return await asyncio.wait_for(job.future, timeout=max(job.deadline - time.monotonic(), 0.0))
        except TimeoutError:
            with self._cond:
                if job in self._queue:
                    self._queue.remove(job)
                    self.metrics.queue_depth.set(len(self._queue))
            self.metrics.rejected.labels("timeout").inc()
            raise ApiError(504, "timeout", "no result within the request timeout") from None

    def _take_batch(self) -> list[Job] | None:
        with self._cond:
            while not self._queue:
                if self._stopping:
                    return None
                self._cond.wait()
            first = self._next()
            self._queue.remove(first)
            batch, pixels = [first], first.pixels
            wait_until = time.monotonic() + self.batch_wait
            limit = self.batch_limit
            while len(batch) < limit:
                for job in list(self._queue):
                    fits = pixels + job.pixels <= self.max_batch_pixels
                    if job.batch_key == first.batch_key and fits and len(batch) < limit:
                        self._queue.remove(job)
                        batch.append(job)
                        pixels += job.pixels
                remaining = wait_until - time.monotonic()
                if len(batch) >= limit or self._incoming == 0 or remaining <= 0:
                    break
                self._cond.wait(remaining)
            self.metrics.queue_depth.set(len(self._queue))
            return batch

    def _next(self) -> Job:
        """The oldest queued job of the model whose last batch was taken longest ago (never served
        first); called with the lock held and the queue not empty."""
        oldest: dict[str, Job] = {}
        for job in self._queue:
            oldest.setdefault(job.model, job)
        model = min(oldest, key=lambda m: self._served.get(m, -1))
        self._turn += 1
        self._served[model] = self._turn
        return oldest[model]

    def _work(self, device: str, prepare: Prepare | None, prepared: threading.Event) -> None:
        try:
            if prepare is not None:
                prepare(device)
        except Exception as err:  # a worker that cannot ready its device cannot serve on it
            log.exception("worker %s could not prepare its device", device)
            failure = err if isinstance(err, DeviceFailedError) else DeviceFailedError(device, str(err))
            self.retire(device, failure)
            return
        finally:
            prepared.set()
        while (batch := self._take_batch()) is not None:
            batch = [job for job in batch if not job.future.done()]
            if not batch:
                continue
            try:
                outcomes = self._solve(device, batch)
            except Exception as err:  # a fault here must fail this batch, not end the worker
                log.exception("worker %s failed on a batch of %d (%s)", device, len(batch), _ids(batch))
                outcomes = [err] * len(batch)
            for job, outcome in zip(batch, outcomes, strict=True):
                _send(job, outcome)
            failed = next((o for o in outcomes if isinstance(o, DeviceFailedError)), None)
            if failed is not None:
                self.retire(device, failed)
                return

    def retire(self, device: str, failure: DeviceFailedError) -> None:
        """Take ``device`` out of service: record why, refuse new requests and fail every queued
        one (nothing can be solved on it any more, and the process is about to exit)."""
        log.critical("device %s failed: %s; it takes no more batches", device, failure.reason)
        with self._cond:
            self.failures.setdefault(device, failure.reason)
            queued = list(self._queue)
            self._queue.clear()
            self.metrics.queue_depth.set(0)
            self._cond.notify_all()
        for job in queued:
            _send(job, self._failed_device())

    def _solve(self, device: str, batch: list[Job]) -> list[Any]:
        start = time.monotonic()
        for job in batch:
            job.started_at, job.batch_size = start, len(batch)
            self.metrics.queue_wait.labels(job.endpoint).observe(start - job.enqueued_at)
        outcomes = self._run(device, batch)
        if len(outcomes) != len(batch):
            raise RuntimeError(f"the batch runner returned {len(outcomes)} results for {len(batch)} jobs")
        self.metrics.inference_duration.labels(batch[0].endpoint, batch[0].model).observe(
            time.monotonic() - start
        )
        self.metrics.batch_size.labels(batch[0].model).observe(len(batch))
        return outcomes

    def _run(self, device: str, batch: list[Job]) -> list[Any]:
        """Results (or exceptions) per job; a failing batch is retried one job at a time, so one bad
        request cannot fail the others."""
        try:
            outcomes = list(self.run_batch(device, batch))
        except DeviceFailedError as err:  # nothing more runs on this device: no retry
            self.metrics.rejected.labels("device_failed").inc(len(batch))
            return [err] * len(batch)
        except Exception as err:
            if isinstance(err, ApiError) and err.status_code == 503:  # the device could not take it
                self._back_off(batch, err)
                return [err] * len(batch)
            if len(batch) == 1:
                return [err]
            # the message, not the exception: a handler may keep the record, and with it the frames
            log.warning(
                "batch of %d (%s) failed (%s); retrying each request alone", len(batch), _ids(batch), str(err)
            )
        else:
            self._recover(len(batch))
            return outcomes
        # here, past the except clause, the failed attempt's exception is gone, and with it the frames
        # (and tensors) its traceback held: the retries do not run beside the failed batch's memory
        for job in batch:
            job.batch_size = 1
        return [self._run(device, [job])[0] for job in batch]

    def _back_off(self, batch: Sequence[Job], err: ApiError) -> None:
        size = len(batch)
        self.metrics.rejected.labels("out_of_memory").inc(size)
        if size == 1:  # one request too large for the device: no smaller batch would help
            return
        with self._cond:
            self.batch_limit = max(1, min(self.batch_limit, size) // 2)
            self._streak = 0
            self.metrics.batch_limit.set(self.batch_limit)
        log.warning(
            "a batch of %d (%s) was refused (%s); batch limit now %d",
            size,
            _ids(batch),
            err.detail,
            self.batch_limit,
        )

    def _recover(self, size: int) -> None:
        with self._cond:
            if self.batch_limit >= self.max_batch_size or size < self.batch_limit:
                return
            self._streak += 1
            if self._streak < RECOVERY_BATCHES:
                return
            self.batch_limit += 1
            self._streak = 0
            self.metrics.batch_limit.set(self.batch_limit)


def _send(job: Job, outcome: Any) -> None:
    """Hand ``outcome`` to ``job``'s waiter on its event loop (from a worker thread)."""
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
        job.loop.call_soon_threadsafe(_deliver, job.future, outcome)


def _deliver(future: asyncio.Future, outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
