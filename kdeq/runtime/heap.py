"""The C heap that CPU tensors come from: glibc's ``malloc`` kept from handing large blocks back.

torch takes a CPU tensor's memory from the C library's ``malloc``. glibc serves a block larger than
its *mmap threshold* with a mapping of its own, unmapped when the block is freed, and hands the top
of its heap back to the kernel once more than its *trim threshold* lies free there. Both start at
128 KiB and rise as mapped blocks are freed: the mmap threshold to the largest such block (at most
32 MiB), the trim threshold to twice that. So a process's first solves of a size, and every solve
whose live blocks outgrow twice the largest block freed so far, take memory that the kernel faults
in and zeroes page by page. A guide network's activations are such blocks, made and freed at every
layer (``48·(H/2)·(W/2)·4`` bytes: 3 MiB at 256², 12 MiB at 512², three times that for a colour
image's three channels in one call). How fast a solve runs then depends on which sizes the process
met before it: on this project's 2-core CPU the float32 network on a colour 256² image's three
channels took 53 ms where glibc mapped its activations and 36 ms where they came from the heap, and
``kdeq denoise`` on colour 256² files ran 1.15–1.17× faster with ``keep`` (docs/BENCHMARKS.md).

``keep`` fixes the mmap threshold at glibc's largest, ``MMAP_THRESHOLD``, and the trim threshold at
``TRIM_THRESHOLD``: a freed activation is reused from the heap by the next layer and the next solve.
A block over 32 MiB still has a mapping of its own, handed back when it is freed; and ``trim`` hands
back the heap's free memory at once (the service does after a large batch, so that what a large
image used does not stay resident). It also gives every thread the main heap (``ARENAS``): glibc
gives a thread an arena of its own, heaps of at most 64 MiB that it maps and unmaps as they fill
and empty, and the service solves on a worker thread. Its colour 256² requests with float32 networks
took 1.14–1.23× the same work in process with the thread's arena, 1.07× with the main heap
(docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "the C heap kept for the next tensor"). The threads that
allocate are few (a worker per device, the requests' decoding): with eight clients the server's throughput was
the same with one arena as with glibc's own. ``system`` leaves glibc's own settings.

The option is the environment variable ``KDEQ_MALLOC`` (``keep``, the default, or ``system``), or
``configure``'s argument. Only the processes kdeq owns configure the heap: the ``kdeq`` command
(``kdeq.cli``), the service (whose setting ``KDEQ_MALLOC`` is) and the benchmarks. A program that
imports kdeq calls ``configure()`` itself if it wants the same (docs/library.md). Where the C
library is not glibc, ``configure`` does nothing and says so in the log.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading

ENV = "KDEQ_MALLOC"
OPTIONS = ("keep", "system")
#: glibc's largest mmap threshold on a 64-bit system (``DEFAULT_MMAP_THRESHOLD_MAX``)
MMAP_THRESHOLD = 32 << 20
#: the free bytes the heap keeps at its top before it hands them back: several solves' activations
TRIM_THRESHOLD = 256 << 20
#: arenas: one, the main heap's, for every thread
ARENAS = 1
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

log = logging.getLogger("kdeq.heap")

_lock = threading.Lock()
_applied: str | None = None  # the option configure carried out, once it has
_kept = False  # whether keep's settings took effect


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library the process runs on (its symbols, through ``dlopen(NULL)``), opened once:
    ``trim`` runs after every large batch."""
    return ctypes.CDLL(None)


def option(name: str | None = None) -> str:
    """``name``, else ``KDEQ_MALLOC``, else ``keep``; ``ValueError`` for anything but ``OPTIONS``."""
    chosen = os.environ.get(ENV, "keep") if name is None else name
    if chosen not in OPTIONS:
        raise ValueError(f"{ENV} is one of {', '.join(OPTIONS)}, got {chosen!r}")
    return chosen


def _keep() -> bool:
    """``keep``'s settings through glibc's ``mallopt``; whether all took effect."""
    mallopt = getattr(_libc(), "mallopt", None)
    # glibc returns 1 for a parameter it set; musl's mallopt is a stub that returns 0
    return mallopt is not None and all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (_M_ARENA_MAX, ARENAS),
        )
    )


def configure(name: str | None = None) -> bool:
    """Set the C heap's thresholds and arenas by ``option(name)``, once a process, and log them at
    each call (the service's log is set up after the command line's call); see the module
    docstring. True where ``keep`` took effect (glibc); False for ``system`` and where the C library
    has no such settings. Once ``keep`` is set, ``system`` cannot bring glibc's adaptive thresholds
    back: ``ValueError``. A thread that allocated before keeps the arena it has, so the service and
    the command line call this before they start theirs."""
    global _applied, _kept
    chosen = option(name)
    with _lock:
        if _applied == "keep" and chosen == "system":
            raise ValueError(f"{ENV}={chosen}: the heap's thresholds are already fixed in this process")
        if _applied != chosen:
            _kept = chosen == "keep" and _keep()
            _applied = chosen
        kept = _kept
    if kept:
        log.info(
            "C heap: blocks up to %d MiB reused, %d MiB kept free at its top, %d arena (%s=keep)",
            MMAP_THRESHOLD >> 20,
            TRIM_THRESHOLD >> 20,
            ARENAS,
            ENV,
        )
    elif chosen == "keep":
        log.info("C heap: this C library's malloc has no thresholds to set; left as it is")
    else:
        log.info("C heap: glibc's own thresholds and arenas (%s=system)", ENV)
    return kept


def trim() -> None:
    """Hand the heap's free memory back to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)
