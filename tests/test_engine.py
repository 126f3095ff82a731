"""The inference engine's queue and batching, driven by a batch runner the test controls."""

from __future__ import annotations

import asyncio
import threading
import time
import weakref

import pytest
import torch

from service.engine import Engine, Job
from service.errors import ApiError, DeviceFailedError
from service.logs import REQUEST_ID
from service.metrics import Metrics


class Runner:
    """Records each batch's payloads; the first batch blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(self, device: str, jobs) -> list[str]:
        self.batches.append([j.payload for j in jobs])
        self.started.set()
        if len(self.batches) == 1:
            self.release.wait(10)
        if any(j.payload == "bad" for j in jobs):
            raise ValueError("bad input")
        return [f"{j.payload}@{device}" for j in jobs]


def engine(runner: Runner, **kw) -> tuple[Engine, Metrics]:
    metrics = Metrics([10], ["cpu"])
    opts = {"queue_size": 8, "max_batch_size": 8, "max_batch_pixels": 10_000, "batch_wait_seconds": 0.0}
    opts.update(kw)
    return Engine(runner, metrics, **opts), metrics


def job(payload: str, key: str = "a", pixels: int = 100, timeout: float = 10.0, model: str = "m:1") -> Job:
    return Job("/denoise", model, key, payload, pixels, time.monotonic() + timeout)


async def _blocked_then(
    eng: Engine, runner: Runner, specs: list[tuple], jobs: list[Job] | None = None
) -> list:
    """Start one job, wait until the worker is busy with it, queue jobs made from ``specs`` (the
    arguments of ``job``; appended to ``jobs``), then release the worker."""
    later = [job(*spec) for spec in specs]
    if jobs is not None:
        jobs.extend(later)
    first = job("first")
    tasks = [asyncio.create_task(eng.infer(first))]
    while not runner.started.is_set():
        await asyncio.sleep(0.005)
    tasks += [asyncio.create_task(eng.infer(j)) for j in later]
    await asyncio.sleep(0.05)
    runner.release.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


def run(coro_fn, eng: Engine):
    async def main():
        eng.start(["cpu"])
        try:
            return await coro_fn()
        finally:
            await asyncio.to_thread(eng.stop)

    return asyncio.run(main())


def test_compatible_jobs_are_batched_in_arrival_order() -> None:
    runner = Runner()
    eng, metrics = engine(runner)
    later: list[Job] = []
    specs = [("a1",), ("b1", "b"), ("a2",), ("a3",)]
    results = run(lambda: _blocked_then(eng, runner, specs, later), eng)
    assert results == ["first@cpu", "a1@cpu", "b1@cpu", "a2@cpu", "a3@cpu"]
    assert runner.batches == [["first"], ["a1", "a2", "a3"], ["b1"]]
    assert [j.batch_size for j in later] == [3, 1, 3, 3]
    text = metrics.render().decode()
    assert 'kdeq_batch_size_count{model="m:1"} 3.0' in text


def test_batch_size_and_pixel_limits() -> None:
    runner = Runner()
    eng, _ = engine(runner, max_batch_size=2, max_batch_pixels=250)
    specs = [("a1",), ("a2",), ("a3",), ("big", "a", 200), ("a4",)]
    run(lambda: _blocked_then(eng, runner, specs), eng)
    # a4 joins a3 past `big`, which does not fit; `big` is then the oldest, so it cannot starve
    assert runner.batches == [["first"], ["a1", "a2"], ["a3", "a4"], ["big"]]


def test_models_take_turns_so_a_backlog_delays_another_model_by_one_batch() -> None:
    """The worker is busy with model m:1 while three m:1 batches (different keys) and two of model
    m:2 queue up: m:2, never served, goes next, then the models alternate while both have work (in
    arrival order, m:2 would have waited behind the whole m:1 backlog)."""
    runner = Runner()
    eng, _ = engine(runner)
    specs = [("s1", "s1"), ("s2", "s2"), ("f1", "f1", 100, 10.0, "m:2"), ("s3", "s3")]
    specs.append(("f2", "f2", 100, 10.0, "m:2"))
    run(lambda: _blocked_then(eng, runner, specs), eng)
    assert runner.batches == [["first"], ["f1"], ["s1"], ["f2"], ["s2"], ["s3"]]


def test_full_queue_is_refused_at_once_with_retry_after() -> None:
    runner = Runner()
    eng, metrics = engine(runner, queue_size=2)
    results = run(lambda: _blocked_then(eng, runner, [("a1",), ("a2",), ("a3",)]), eng)
    refused = results[3]
    assert isinstance(refused, ApiError) and refused.status_code == 503
    assert refused.headers["Retry-After"] == "1"
    assert results[:3] == ["first@cpu", "a1@cpu", "a2@cpu"]
    assert 'kdeq_rejected_requests_total{reason="queue_full"} 1.0' in metrics.render().decode()


def test_timeout_is_504_and_frees_the_queue_slot() -> None:
    runner = Runner()
    eng, metrics = engine(runner, queue_size=1)

    async def scenario():
        first = asyncio.create_task(eng.infer(job("first")))
        while not runner.started.is_set():
            await asyncio.sleep(0.005)
        with pytest.raises(ApiError) as err:
            await eng.infer(job("late", timeout=0.05))
        assert err.value.status_code == 504 and eng.depth == 0
        queued = asyncio.create_task(eng.infer(job("next")))  # the slot is free again
        runner.release.set()
        return await asyncio.gather(first, queued)

    assert run(scenario, eng) == ["first@cpu", "next@cpu"]
    assert runner.batches == [["first"], ["next"]]
    assert 'kdeq_rejected_requests_total{reason="timeout"} 1.0' in metrics.render().decode()


def test_a_failing_request_does_not_fail_its_batch() -> None:
    runner = Runner()
    eng, _ = engine(runner)
    results = run(lambda: _blocked_then(eng, runner, [("a1",), ("bad",), ("a2",)]), eng)
    assert results[1] == "a1@cpu" and results[3] == "a2@cpu"
    assert isinstance(results[2], ValueError)
    assert runner.batches[1] == ["a1", "bad", "a2"]  # tried together, then one by one
    assert runner.batches[2:] == [["a1"], ["bad"], ["a2"]]


def test_a_batch_waits_for_requests_still_being_decoded() -> None:
    runner = Runner()
    runner.release.set()
    eng, _ = engine(runner, batch_wait_seconds=1.0)

    async def scenario():
        with eng.incoming() as ticket:
            a = asyncio.create_task(eng.infer(job("a1")))
            await asyncio.sleep(0.1)  # the worker holds a1, waiting for this request to be queued
            b = asyncio.create_task(eng.infer(job("a2"), ticket))
            return await asyncio.gather(a, b)

    start = time.monotonic()
    assert run(scenario, eng) == ["a1@cpu", "a2@cpu"]
    assert runner.batches == [["a1", "a2"]]
    assert time.monotonic() - start < 1.0  # it stopped waiting once nothing more was incoming


def test_an_engine_not_started_or_stopping_refuses() -> None:
    runner = Runner()
    eng, metrics = engine(runner)

    async def scenario():
        with pytest.raises(ApiError) as before:
            await eng.infer(job("x"))
        eng.start(["cpu"])
        await asyncio.to_thread(eng.stop)
        with pytest.raises(ApiError) as after:
            await eng.infer(job("y"))
        return before.value, after.value

    before, after = asyncio.run(scenario())
    assert (before.status_code, before.error, after.status_code, after.error) == (
        503,
        "not_ready",
        503,
        "draining",
    )
    text = metrics.render().decode()
    assert 'reason="not_ready"} 1.0' in text and 'reason="draining"} 1.0' in text


def test_a_fault_outside_the_runner_fails_the_batch_not_the_worker() -> None:
    calls = []

    def runner(device, jobs):
        calls.append(len(jobs))
        return [] if jobs[0].payload == "short" else [j.payload for j in jobs]

    eng, _ = engine(runner)

    async def scenario():
        with pytest.raises(RuntimeError, match="0 results for 1 jobs"):
            await eng.infer(job("short"))
        assert eng.alive
        return await eng.infer(job("fine"))

    assert run(scenario, eng) == "fine"


def test_a_refused_batch_halves_the_limit_and_full_batches_grow_it_back(monkeypatch) -> None:
    monkeypatch.setattr("service.engine.RECOVERY_BATCHES", 2)
    sizes: list[int] = []
    release = threading.Event()

    def runner(device, jobs):
        sizes.append(len(jobs))
        if jobs[0].payload == "first":
            release.wait(10)
        if len(jobs) > 2:
            raise ApiError(503, "out_of_memory", "no memory for this batch", {"Retry-After": "5"})
        return [j.payload for j in jobs]

    eng, metrics = engine(runner)

    async def scenario():
        first = asyncio.create_task(eng.infer(job("first")))
        while not sizes:
            await asyncio.sleep(0.005)
        burst = [asyncio.create_task(eng.infer(job(f"a{i}"))) for i in range(5)]
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.gather(first, *burst, return_exceptions=True)
        assert results[0] == "first"
        assert all(isinstance(r, ApiError) and r.status_code == 503 for r in results[1:])
        assert eng.batch_limit == 2  # five refused together: the limit halves
        # full batches at the lower limit: after RECOVERY_BATCHES of them the limit grows by one
        for _ in range(2):
            with eng.incoming() as t1, eng.incoming() as t2:
                pair = [
                    asyncio.create_task(eng.infer(job("b"), t1)),
                    asyncio.create_task(eng.infer(job("b"), t2)),
                ]
                assert await asyncio.gather(*pair) == ["b", "b"]
        return eng.batch_limit

    assert run(scenario, eng) == 3
    assert sizes[:2] == [1, 5] and all(s <= 2 for s in sizes[2:])
    assert "kdeq_batch_size_limit 3.0" in metrics.render().decode()


def test_admission_counts_requests_not_yet_queued() -> None:
    """A burst is refused at arrival: queued plus admitted-but-uploading requests fill the queue."""
    runner = Runner()
    runner.release.set()
    eng, metrics = engine(runner, queue_size=2)
    eng.start(["cpu"])
    try:
        first, second = eng.admit(), eng.admit()
        with pytest.raises(ApiError) as err:
            eng.admit()
        assert err.value.status_code == 503 and err.value.error == "queue_full"
        eng.release(first)  # an admitted request that gave up frees its place
        third = eng.admit()
        for ticket in (second, third):
            eng.release(ticket)
        assert eng.admit() is not None
    finally:
        eng.stop()
    assert 'kdeq_rejected_requests_total{reason="queue_full"} 1.0' in metrics.render().decode()


def test_a_failed_batch_is_freed_before_its_requests_are_retried(caplog: pytest.LogCaptureFixture) -> None:
    """The retry one request at a time runs after the failed attempt's exception is gone: a tensor
    the failing batch held is already freed when the first retry starts. The warning names the
    batch's requests by the IDs they were made under."""
    held: list[weakref.ref] = []
    alive_at_retry: list[bool] = []

    def runner(device, jobs):
        if len(jobs) > 1:
            workspace = torch.empty(1 << 20)  # the batch's tensors, held by the raising frame
            held.append(weakref.ref(workspace))
            raise RuntimeError("a batch-wide fault")
        alive_at_retry.append(held[0]() is not None)
        return [j.payload for j in jobs]

    eng, _ = engine(runner, batch_wait_seconds=1.0)

    def made_under(rid: str, payload: str) -> Job:
        token = REQUEST_ID.set(rid)
        try:
            return job(payload)
        finally:
            REQUEST_ID.reset(token)

    async def scenario():
        with eng.incoming() as t1, eng.incoming() as t2:
            pair = [
                asyncio.create_task(eng.infer(made_under("rid-a", "a"), t1)),
                asyncio.create_task(eng.infer(made_under("rid-b", "b"), t2)),
            ]
            return await asyncio.gather(*pair)

    with caplog.at_level("WARNING", logger="kdeq.service"):
        assert run(scenario, eng) == ["a", "b"]
    assert alive_at_retry == [False, False]
    assert any("requests rid-a, rid-b" in r.getMessage() for r in caplog.records), caplog.text


def test_a_device_failure_answers_every_queued_request_and_retires_the_worker() -> None:
    """A sticky device error: the failing batch and the requests queued behind it get 503
    device_failed, later requests are refused at once, and the worker takes no more batches."""
    started, release, batches = threading.Event(), threading.Event(), []

    def runner(device, jobs):
        batches.append([j.payload for j in jobs])
        started.set()
        release.wait(10)
        raise DeviceFailedError(device, "CUDA error: an illegal memory access was encountered")

    eng, metrics = engine(runner, max_batch_size=1)

    async def scenario():
        first = asyncio.create_task(eng.infer(job("first")))
        await asyncio.to_thread(started.wait, 10)
        queued = [asyncio.create_task(eng.infer(job(f"q{i}"))) for i in range(3)]
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.gather(first, *queued, return_exceptions=True)
        with pytest.raises(ApiError) as later:
            eng.admit()
        return results, later.value

    results, later = run(scenario, eng)
    assert all(isinstance(r, DeviceFailedError) and r.status_code == 503 for r in results), results
    assert later.error == "device_failed" and batches == [["first"]]
    assert eng.failure == "cpu: CUDA error: an illegal memory access was encountered" and not eng.alive
    assert 'kdeq_rejected_requests_total{reason="device_failed"} 5.0' in metrics.render().decode()


def test_workers_prepare_on_their_own_thread_before_requests_are_admitted() -> None:
    prepared: list[str] = []
    gate = threading.Event()
    eng, _ = engine(Runner())

    def prepare(device: str) -> None:
        gate.wait(10)
        prepared.append(threading.current_thread().name)

    starter = threading.Thread(target=eng.start, args=(["cpu"], prepare))
    starter.start()
    time.sleep(0.05)
    with pytest.raises(ApiError) as early:  # the worker is still warming up
        eng.admit()
    gate.set()
    starter.join(10)
    try:
        assert early.value.error == "not_ready" and prepared == ["kdeq-worker-cpu"]
        eng.release(eng.admit())
    finally:
        eng.stop()


def test_a_worker_that_cannot_prepare_its_device_retires_it() -> None:
    eng, _ = engine(Runner())

    def prepare(device: str) -> None:
        raise RuntimeError("CUDA error: invalid device ordinal")

    eng.start(["cpu"], prepare)
    try:
        assert eng.failure == "cpu: CUDA error: invalid device ordinal"
        with pytest.raises(ApiError) as refused:
            eng.admit()
        assert refused.value.error == "device_failed"
    finally:
        eng.stop()
