"""Torch's CPU threads sized to the cores this process can use now.

torch's intra-op pool (OpenMP) and the compiled loops (``kdeq.runtime.native``, which take
``torch.get_num_threads()``) split each operation across their threads and wait at a barrier for
the slowest. When other processes hold those cores, the thread that lost its core holds up
every operation for a scheduler time slice (milliseconds), and a solve of thousands of small
operations, a deblur's or an inpainting's, takes many times its time: with the machine
oversubscribed, a colour deblur on two threads took 5.4× what it took on one (docs/BENCHMARKS.md, "Threads and
backends on the CPU"), and two replicas on two threads each served 45–220× fewer images than on one each. On
one thread a solve gets its fair share of a core instead. So the count follows two numbers:

- **the cores the process has** (``available_cores``): its CPU affinity and its cgroup's CPU quota
  (``cpu.max``, or cgroup v1's ``cpu.cfs_quota_us``/``cpu.cfs_period_us``), rounded up — not
  ``os.cpu_count()``, the host's CPUs, with which a container given 2 CPUs of a 64-core host
  would run 32 threads in 2 CPUs' time;
- **how many of them are free** (``Governor.adapt``): over the last ``t`` seconds (between
  ``WINDOW`` and twice that), the CPUs of the affinity set were idle for ``I`` core-seconds and
  this process used ``U``, so ``(I + U)/t`` cores were there for it; the next piece of work gets
  that many threads, rounded, between 1 and the cores it has. A neighbour on every core leaves
  ``I ≈ 0`` and ``U`` under a core, hence one thread; when it stops, the idle time comes back and
  so do the threads, without a probe that would cost a slow request. A daemon thread takes a
  reading every ``WINDOW`` seconds, so that after a quiet hour a neighbour who arrived a second
  ago is not averaged away.

``kdeq.tasks.base.solve_batch`` asks before each batch (the service's worker, the CLI and tiled solves
all solve through it). ``KDEQ_THREADS`` (the service's setting of that name, or ``pin``) fixes
the count instead (``auto``: adapt); ``OMP_NUM_THREADS``, read by torch at startup, caps it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

ENV = "KDEQ_THREADS"
#: the shortest span a decision is measured over: ``/proc/stat`` counts in clock ticks (10 ms), and
#: a shorter span would read noise; within it the previous decision stands
WINDOW = 0.25

log = logging.getLogger("kdeq.threads")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cgroup_quota(proc: Path = Path("/proc"), root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU time per unit of wall time the process's cgroup may use (``None``: no quota), the
    tightest along its path: cgroup v2's ``cpu.max`` (``quota period`` or ``max period``) or v1's
    ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` (quota −1: none)."""
    text = _read(proc / "self" / "cgroup") or ""
    limits = []
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: walk from the process's cgroup up to the root
            folder = root / path.lstrip("/")
            while True:
                fields = (_read(folder / "cpu.max") or "").split()
                if len(fields) == 2 and fields[0] != "max":
                    limits.append(int(fields[0]) / int(fields[1]))
                if folder == root or root not in folder.parents:
                    break
                folder = folder.parent
        elif "cpu" in controllers.split(","):
            for base in (root / "cpu,cpuacct", root / "cpu"):
                folder = base / path.lstrip("/")
                quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
                if quota is not None and period is not None:
                    if int(quota) > 0:
                        limits.append(int(quota) / int(period))
                    break
    return min(limits) if limits else None


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def available_cores() -> int:
    """The cores this process has: its affinity set's size, and its cgroup's CPU quota rounded up,
    whichever is fewer (at least 1)."""
    cores = len(_affinity())
    quota = _cgroup_quota()
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


@dataclass(frozen=True)
class Sample:
    """A reading at ``wall`` (seconds, monotonic): the affinity set's idle core-seconds ``idle``
    (``None`` where ``/proc/stat`` cannot be read) and this process's CPU seconds ``used``."""

    wall: float
    idle: float | None
    used: float


def _idle_seconds(cpus: set[int], stat: Path = Path("/proc/stat")) -> float | None:
    """Idle and I/O-wait seconds summed over ``cpus`` since boot, from ``/proc/stat``."""
    text = _read(stat)
    if text is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    total, seen = 0, 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            total += int(fields[3]) + int(fields[4])
            seen += 1
    return total / tick if seen else None


def sample(cpus: set[int]) -> Sample:
    """Now's ``Sample`` over ``cpus``."""
    return Sample(time.monotonic(), _idle_seconds(cpus), time.process_time())


def free_cores(before: Sample, after: Sample) -> float | None:
    """``(I + U)/t``: the cores that were idle or this process's between two samples (``None``
    without ``/proc/stat`` or a span)."""
    span = after.wall - before.wall
    if before.idle is None or after.idle is None or span <= 0:
        return None
    return (after.idle - before.idle + after.used - before.used) / span


def parse(value: str) -> int | None:
    """A thread setting: ``auto`` (``None``: adapt) or a count ≥ 1; else ``ValueError``."""
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV} is auto or a number of threads ≥ 1, got {value!r}")
    return int(value)


class Governor:
    """Decides torch's thread count before each piece of work (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cpus = _affinity()
        self._readings: deque[Sample] = deque([sample(self._cpus)], maxlen=4)
        self._sampler: threading.Thread | None = None
        self._pinned: int | None = None
        self._set: int | None = None  # the count this governor last set
        self._decided = -math.inf  # when it last decided (monotonic seconds)
        self._ceiling = torch.get_num_threads()

    def pin(self, value: str) -> None:
        """Fix the count at ``value`` (``parse``), over ``KDEQ_THREADS``; ``auto`` adapts again."""
        self._pinned = parse(value)

    def decide(self, free: float | None) -> int:
        """The threads for ``free`` cores, rounded (``None``: unknown, so the most), between 1 and the
        most: the cores the process has, or torch's count where that is fewer (``OMP_NUM_THREADS``, or
        a count the program set, e.g. ``kdeq train``'s one per rank). A pin wins."""
        pinned = self._pinned if self._pinned is not None else parse(os.environ.get(ENV, "auto"))
        if pinned is not None:
            return pinned
        most = max(1, min(available_cores(), self._ceiling))
        return most if free is None else max(1, min(most, math.floor(free + 0.5)))

    def _sample_every_window(self) -> None:
        """The sampler thread's loop: a reading every ``WINDOW`` seconds, the last few kept."""
        while True:
            time.sleep(WINDOW)
            reading = sample(self._cpus)
            with self._lock:
                self._readings.append(reading)

    def _ensure_sampler(self) -> None:
        """Start the sampler thread, once per process; called under the lock."""
        if self._sampler is None:
            thread = threading.Thread(target=self._sample_every_window, name="kdeq-threads", daemon=True)
            thread.start()
            self._sampler = thread

    def after_fork(self) -> None:
        """In a forked child: a fresh lock (the parent's may have been held by its sampler) and no
        sampler (threads do not survive a fork); the next ``adapt`` starts one."""
        self._lock = threading.Lock()
        self._sampler = None

    def adapt(self) -> int:
        """Set torch's threads for the next piece of work from the free cores measured over the last
        ``WINDOW`` to ``2·WINDOW`` seconds (within ``WINDOW`` of the last decision, it stands) and
        return them."""
        with self._lock:
            self._ensure_sampler()
            current = torch.get_num_threads()
            if current != self._set:  # set by someone else: their count is the ceiling
                self._ceiling, self._set = current, None
            now = sample(self._cpus)
            if self._set is not None and now.wall - self._decided < WINDOW:
                return self._set
            # the newest reading at least a window old (the oldest kept, if none is)
            start = next(
                (r for r in reversed(self._readings) if now.wall - r.wall >= WINDOW), self._readings[0]
            )
            free = free_cores(start, now)
            threads = self.decide(free)
            self._readings.append(now)
            self._decided = now.wall
            if threads != current:
                torch.set_num_threads(threads)
                log.debug("%s free cores -> %d threads", "?" if free is None else f"{free:.2f}", threads)
            self._set = threads
            return threads


governor = Governor()
os.register_at_fork(after_in_child=governor.after_fork)
adapt = governor.adapt
pin = governor.pin
