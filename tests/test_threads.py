"""Torch's threads sized to the free cores (``kdeq.runtime.threads``): the cores a process has (affinity,
cgroup quota), the free cores between two readings, the decision and its pins, and every task's
request under a neighbour that holds every core, against its quiet time measured beside it."""

from __future__ import annotations

import io
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
import torch
from PIL import Image

from kdeq.registry import TASKS
from kdeq.runtime import threads
from tests.service_helpers import Server, run_server


def _cgroup_v2(tmp_path: Path, limits: dict[str, str]) -> tuple[Path, Path]:
    """A fake ``/proc`` whose process sits in ``/a/b`` of a cgroup v2 tree with ``cpu.max`` files."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/a/b\n")
    for folder, value in limits.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "cpu.max").write_text(value + "\n")
    return proc, root


def test_the_cgroup_v2_quota_is_the_tightest_along_the_path(tmp_path) -> None:
    proc, root = _cgroup_v2(tmp_path, {"": "max 100000", "a": "250000 100000", "a/b": "max 100000"})
    assert threads._cgroup_quota(proc, root) == 2.5
    proc, root = _cgroup_v2(tmp_path / "2", {"a": "400000 100000", "a/b": "150000 100000"})
    assert threads._cgroup_quota(proc, root) == 1.5
    proc, root = _cgroup_v2(tmp_path / "3", {"a/b": "max 100000"})
    assert threads._cgroup_quota(proc, root) is None


def test_the_cgroup_v1_quota(tmp_path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("5:memory:/x\n4:cpu,cpuacct:/docker/c1\n")
    folder = root / "cpu,cpuacct" / "docker" / "c1"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    (folder / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads._cgroup_quota(proc, root) is None
    (folder / "cpu.cfs_quota_us").write_text("300000\n")
    assert threads._cgroup_quota(proc, root) == 3.0


def test_the_cores_a_process_has_are_its_affinity_and_its_quota(monkeypatch) -> None:
    monkeypatch.setattr(threads, "_affinity", lambda: set(range(64)))
    monkeypatch.setattr(threads, "_cgroup_quota", lambda: 2.5)
    assert threads.available_cores() == 3  # a part of a core is a core to run on
    monkeypatch.setattr(threads, "_cgroup_quota", lambda: None)
    assert threads.available_cores() == 64
    monkeypatch.setattr(threads, "_affinity", lambda: {3})
    monkeypatch.setattr(threads, "_cgroup_quota", lambda: 0.1)
    assert threads.available_cores() == 1
    # this process: never more than its affinity set
    monkeypatch.undo()
    assert 1 <= threads.available_cores() <= len(os.sched_getaffinity(0))


def test_free_cores_are_the_idle_time_and_the_process_own() -> None:
    before = threads.Sample(wall=10.0, idle=100.0, used=5.0)
    # over 2 s: 1.5 core-seconds idle, 1.5 CPU-seconds this process's: 1.5 cores free
    assert threads.free_cores(before, threads.Sample(12.0, 101.5, 6.5)) == pytest.approx(1.5)
    assert threads.free_cores(before, threads.Sample(12.0, None, 6.5)) is None
    assert threads.free_cores(before, threads.Sample(10.0, 101.0, 5.0)) is None


def test_the_idle_time_is_read_for_the_affinity_set_alone(tmp_path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq: idle + iowait counts
    stat.write_text(
        "cpu  9 9 9 999 9 0 0\ncpu0 1 0 1 100 20 0 0\ncpu1 1 0 1 300 0 0 0\ncpu2 1 0 1 50 5 0 0\nintr 5\n"
    )
    tick = os.sysconf("SC_CLK_TCK")
    assert threads._idle_seconds({0, 2}, stat) == pytest.approx(175 / tick)
    assert threads._idle_seconds({7}, stat) is None


@pytest.fixture
def governor(monkeypatch) -> Iterator[threads.Governor]:
    """A governor on a process of 4 cores whose torch started with 4 threads; torch's count is kept
    in a variable, not set."""
    count = {"n": 4}
    monkeypatch.setattr(threads, "available_cores", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: count["n"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: count.update(n=n))
    monkeypatch.delenv(threads.ENV, raising=False)
    gov = threads.Governor()
    gov.count = count
    yield gov


@pytest.mark.parametrize(
    ("free", "expected"), [(None, 4), (0.0, 1), (0.7, 1), (1.4, 1), (1.6, 2), (3.6, 4), (9.0, 4)]
)
def test_the_decision_rounds_the_free_cores_between_one_and_the_cores(governor, free, expected) -> None:
    assert governor.decide(free) == expected


def test_a_pin_wins_and_a_bad_one_is_refused(governor, monkeypatch) -> None:
    monkeypatch.setenv(threads.ENV, "3")
    assert governor.decide(0.0) == 3
    governor.pin("2")
    assert governor.decide(4.0) == 2  # over the variable
    governor.pin("auto")
    assert governor.decide(4.0) == 3
    for bad in ("0", "-1", "two", "1.5", ""):
        with pytest.raises(ValueError, match="auto or a number of threads"):
            threads.parse(bad)


def test_adapt_follows_the_free_cores_after_each_window(governor, monkeypatch) -> None:
    readings = iter(
        [
            threads.Sample(1.0, 0.0, 0.0),  # t = 1: 1 s since the governor's first reading
            threads.Sample(1.1, 0.0, 0.1),  # within the window: the last decision stands
            threads.Sample(2.0, 0.0, 0.8),  # a neighbour held every core: 0.8 core ours, none idle
            threads.Sample(3.0, 2.5, 1.8),  # it stopped: 2.5 core-seconds idle, 1 ours
        ]
    )
    monkeypatch.setattr(threads, "sample", lambda cpus: next(readings))
    monkeypatch.setattr(governor, "_ensure_sampler", lambda: None)
    governor._readings.append(threads.Sample(0.0, 0.0, 0.0))
    assert governor.adapt() == 1 and governor.count["n"] == 1  # 0 free cores: one thread
    assert governor.adapt() == 1
    assert governor.adapt() == 1
    assert governor.adapt() == 4 and governor.count["n"] == 4  # 3.5 free: all four


def test_a_count_the_program_set_is_the_ceiling(governor, monkeypatch) -> None:
    """``kdeq train`` runs one thread per rank and the suite's modules of small tensors one thread:
    the governor never raises a count that someone else lowered."""
    readings = iter([threads.Sample(float(t), 10.0 * t, 0.0) for t in range(1, 4)])  # every core idle
    monkeypatch.setattr(threads, "sample", lambda cpus: next(readings))
    monkeypatch.setattr(governor, "_ensure_sampler", lambda: None)
    governor._readings.append(threads.Sample(0.0, 0.0, 0.0))
    governor.count["n"] = 1  # the program's own torch.set_num_threads(1)
    assert governor.adapt() == 1
    governor.count["n"] = 3
    assert governor.adapt() == 3


# ----------------------------------------------------------------------------- a real neighbour

BURN = "while True:\n    pass\n"


def _task_request(server: Server, task: str) -> tuple[str, dict, dict]:
    """The route, files and form of a 256² request of ``task``: the service's own sample for the task
    (``GET /samples/{task}``), resized (nearest pixel, so that counts stay counts)."""
    sample = Image.open(io.BytesIO(httpx.get(f"{server.url}/samples/{task}", timeout=30).content))
    image = io.BytesIO()
    sample.resize((256, 256), Image.Resampling.NEAREST).save(image, format="PNG")
    data = {"psf": "gaussian:1.6"} if task == "deblur" else {}
    return TASKS[task].route, {"image": image.getvalue()}, data


def _median_seconds(client: httpx.Client, url: str, files: dict, data: dict, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        response = client.post(url, files=files, data=data)
        times.append(time.perf_counter() - start)
        assert response.status_code == 200, response.text
    return statistics.median(times)


@pytest.mark.skipif(threads.available_cores() < 2, reason="one core: no threads to contend")
def test_every_task_under_a_neighbour_on_every_core_within_its_share_of_a_core(tmp_path) -> None:
    """A real server; each task's 256² request quiet, then beside one busy-looping process per core
    of this process (as ``stress --cpu N`` loads it), then quiet again. The loaded median of five
    within ``2C`` times the slower quiet median on ``C`` cores (the slower, so that a neighbour of
    the machine's own who comes or goes does not decide it):

    - on ``C`` cores a request is at most ``C`` times faster than on one thread;
    - beside ``C`` busy processes one thread gets at least half a core: the scheduler keeps the
      ``C + 1`` busy threads on ``C`` cores, at worst two on one of them. Spread evenly, it would
      get ``C/(C + 1)`` of a core and the bound would be ``C + 1``, issue 54's 3× on two cores;
      where the threads land changes from one second to the next, and CI's 2-core machine
      measured one thread 1.5–2.1× slower beside two busy processes from one reading to the next.

    Threads that each wait out a scheduler slice at every barrier, which the free-core count
    (``kdeq.runtime.threads``) avoids, go past it: 20–30× on the machine issue 54 reported."""
    cores = threads.available_cores()
    with run_server(tmp_path) as server, httpx.Client(timeout=120) as client:
        cases = {task: _task_request(server, task) for task in sorted(TASKS)}

        def medians() -> dict[str, float]:
            return {t: _median_seconds(client, server.url + r, f, d, 5) for t, (r, f, d) in cases.items()}

        for route, files, data in cases.values():  # warm: compiled loops, measured choices
            _median_seconds(client, server.url + route, files, data, 1)
        before = medians()
        burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(cores)]
        try:
            time.sleep(2 * threads.WINDOW)
            loaded = medians()
        finally:
            for burner in burners:
                burner.kill()
            for burner in burners:
                burner.wait()
        time.sleep(2 * threads.WINDOW)
        after = medians()
    quiet = {t: max(before[t], after[t]) for t in before}
    ratios = {t: loaded[t] / quiet[t] for t in quiet}
    shown = {t: f"{quiet[t]:.3f} s -> {loaded[t]:.3f} s ({r:.2f}x)" for t, r in ratios.items()}
    assert all(r <= 2 * cores for r in ratios.values()), shown


def test_a_forked_child_adapts_with_a_sampler_of_its_own() -> None:
    """Threads do not survive a fork: the child's first ``adapt`` starts its own sampler, and a lock
    its parent held does not block it."""
    threads.adapt()
    with threads.governor._lock:  # held across the fork, as the parent's sampler might hold it
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if it adapted and sampled on its own thread
            ok = threads.adapt() >= 1 and threads.governor._sampler.is_alive()
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:  # blocked on the parent's lock
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's adapt did not return in 30 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0
