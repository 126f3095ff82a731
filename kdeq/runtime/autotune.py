"""A choice between implementations of one computation, measured once per shape class and kept
(the CPU's ``cudnn.benchmark``), or pinned.

``Tuner`` holds one such choice: its options in order of preference, the environment variable that
pins one of them, the pins made in the process (``pin``, the service's setting) and within a block
(``force``), and the choices measured so far. ``decide`` measures a shape class's options the first
time it meets the class, keeps the first option in preference order within ``MARGIN`` of the
fastest, so that timing noise does not flip a close choice between runs, and logs it.

``compare`` times the options in turns (one call of each per round) and keeps each one's fastest
call: a neighbour's burst of load, which on a shared machine can slow a call several times over,
then falls on every option's calls alike instead of on whichever option was being timed, and a
call it slowed does not count. Timing one option's runs after another's let a busy second made the
wrong choice for the life of the process (a CPU with bfloat16 units chose float32).
``kdeq.runtime.backends`` (the zero-border convolutions) and ``kdeq.runtime.netprecision`` (the guide
network's arithmetic) are the two choices.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager

#: how much faster an option must measure to be chosen over one listed before it
MARGIN = 1.2
#: timed rounds after one warm-up call of each option; each option's fastest call counts
RUNS = 5


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two: a side or a batch size's shape class."""
    return 1 << max(0, (n - 1).bit_length())


def compare(options: dict[str, Callable[[], object]], runs: int = RUNS) -> dict[str, float]:
    """The fastest of ``runs`` wall-clock timings of each of ``options`` (name → call), after one
    warm-up call of each; the calls interleave, round by round, each round starting at the next
    option, so that a slow spell of the machine lands on every option (module docstring)."""
    names = list(options)
    for name in names:
        options[name]()
    best = dict.fromkeys(names, float("inf"))
    for round_ in range(runs):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            start = time.perf_counter()
            options[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def choose(times: dict[str, float], order: Sequence[str]) -> str:
    """The first of ``order`` that was timed and is within ``MARGIN`` of the fastest in ``times``."""
    best = min(times.values())
    return next(name for name in order if name in times and times[name] <= best * MARGIN)


class Tuner:
    """One measured choice among ``options`` (in order of preference), pinned by the environment
    variable ``env`` (``auto``: measure), by ``pin`` or within ``force``; see the module docstring."""

    def __init__(self, what: str, env: str, options: Sequence[str], log: logging.Logger) -> None:
        self.what, self.env, self.options, self.log = what, env, tuple(options), log
        self._lock = threading.Lock()
        self._chosen: dict[Hashable, str] = {}
        self._forced: list[str] = []  # ``force``'s pins, innermost last
        self._process: list[str] = []  # ``pin``'s

    def check(self, name: str) -> str:
        """``name``, if it is ``auto`` or an option; else ``ValueError``."""
        if name != "auto" and name not in self.options:
            raise ValueError(f"the {self.what} is auto or one of {sorted(self.options)}, got {name!r}")
        return name

    def pinned(self) -> str | None:
        """The option pinned by ``force``, ``pin`` or the environment variable, in that order
        (``None``: measure)."""
        if self._forced:
            name = self._forced[-1]
        elif self._process:
            name = self._process[-1]
        else:
            name = self.check(os.environ.get(self.env, "auto"))
        return None if name == "auto" else name

    def pin(self, name: str) -> None:
        """Use option ``name`` for every shape from now on, in this process, over the environment
        variable; ``auto`` drops the pin."""
        self._process[:] = [] if self.check(name) == "auto" else [name]

    @contextmanager
    def force(self, name: str) -> Iterator[None]:
        """Within: option ``name`` for every shape (``auto``: measure)."""
        self._forced.append(self.check(name))
        try:
            yield
        finally:
            self._forced.pop()

    @contextmanager
    def reproducible(self, default: str) -> Iterator[None]:
        """Within: the environment variable's option where it names one, else ``default``, for every
        shape, with no timing that could choose differently in another process (``kdeq train``: its
        ranks and a resumed run repeat the same arithmetic)."""
        name = self.check(os.environ.get(self.env, "auto"))
        with self.force(default if name == "auto" else name):
            yield

    def decide(self, key: Hashable, measure: Callable[[], dict[str, float]], subject: str) -> str:
        """The option kept for shape class ``key``: measured by ``measure`` (seconds by option) the
        first time the class is met, chosen by ``choose`` and logged with ``subject``."""
        with self._lock:
            if key not in self._chosen:
                times = measure()
                self._chosen[key] = choose(times, self.options)
                spent = ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in times.items())
                self.log.info("%s: %s -> %s", subject, spent, self._chosen[key])
            return self._chosen[key]

    def chosen(self) -> dict[Hashable, str]:
        """The choices made so far, by shape class."""
        with self._lock:
            return dict(self._chosen)

    def forget(self) -> None:
        """Drop every choice (the next input of each class is measured again)."""
        with self._lock:
            self._chosen.clear()
