"""The C heap's thresholds (``kdeq.runtime.heap``): freed blocks reused under ``keep``, in processes of their
own (the thresholds are the process's), and the option's parsing where the command line reads it."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kdeq.runtime import heap

ROOT = Path(__file__).resolve().parents[1]

# Blocks made, written and freed as a guide network's layers make their activations: first one of
# each size from 4 to 13 MiB, as a process's first solves of growing images; then rounds of three
# 9 MiB blocks, as the layers of one size. Under glibc's own thresholds each block larger than any
# freed before is a mapping of its own, faulted in page by page; under ``keep`` it comes from the
# heap, which grows by the difference, and the rounds reuse what the heap holds. A thread's tensors
# come from the main heap under ``keep``; under glibc's own settings from an arena of the thread's.
BLOCKS = """
import json, resource, threading, torch
from kdeq.runtime import heap
applied = heap.configure()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def make(*sizes):
    live = [torch.empty(size // 4).fill_(1.0) for size in sizes]
    del live
start = faults()
for mib in range(4, 14):
    make(mib << 20)
growing = faults() - start
for _ in range(10):  # the heap's layout settles (a block's alignment leaves gaps at first)
    make(*[9 << 20] * 3)
start = faults()
for _ in range(20):
    make(*[9 << 20] * 3)
rounds = faults() - start
def heap_range():
    line = next(ln for ln in open("/proc/self/maps") if ln.rstrip().endswith("[heap]"))
    return [int(part, 16) for part in line.split()[0].split("-")]
def in_thread():  # as the service's worker does: where a thread's tensors come from
    global threaded
    block = torch.empty((1 << 20) // 4)
    low, high = heap_range()
    threaded = low <= block.data_ptr() < high
worker = threading.Thread(target=in_thread)
worker.start()
worker.join()
pages = (1 << 20) // resource.getpagesize()  # a MiB's
print(json.dumps({"applied": applied, "growing": growing, "growing_pages": sum(range(4, 14)) * pages,
                  "rounds": rounds, "threaded": threaded, "block_pages": 9 * pages}))
"""

glibc = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's"
)


def blocks(option: str) -> dict:
    """``BLOCKS`` in a fresh interpreter with ``KDEQ_MALLOC=option``: what it printed."""
    env = {**os.environ, heap.ENV: option}
    done = subprocess.run(
        [sys.executable, "-c", BLOCKS], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc
def test_keep_reuses_freed_blocks_and_gives_threads_the_main_heap() -> None:
    kept, system = blocks("keep"), blocks("system")
    assert kept["applied"] is True and system["applied"] is False
    # glibc's own thresholds fault in every growing block whole; keep, about the largest once
    assert system["growing"] >= 0.9 * system["growing_pages"], system
    assert kept["growing"] <= 0.5 * kept["growing_pages"], kept
    # and under keep twenty rounds of one size take not one block's pages
    assert kept["rounds"] < kept["block_pages"], kept
    assert kept["threaded"] is True and system["threaded"] is False


def test_option_from_the_argument_the_environment_or_keep(monkeypatch) -> None:
    monkeypatch.delenv(heap.ENV, raising=False)
    assert heap.option() == "keep"
    monkeypatch.setenv(heap.ENV, "system")
    assert (heap.option(), heap.option("keep")) == ("system", "keep")
    monkeypatch.setenv(heap.ENV, "tcmalloc")
    with pytest.raises(ValueError, match="KDEQ_MALLOC"):
        heap.option()


@glibc
def test_system_after_keep_is_refused() -> None:
    code = (
        "from kdeq.runtime import heap\n"
        "assert heap.configure('system') is False and heap.configure('keep') is True\n"
        "assert heap.configure('keep') is True\n"
        "try:\n    heap.configure('system')\nexcept ValueError as err:\n    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "KDEQ_MALLOC=system" in done.stdout


def test_the_command_line_refuses_an_unknown_option() -> None:
    env = {**os.environ, heap.ENV: "jemalloc"}
    done = subprocess.run(
        [sys.executable, "-m", "kdeq", "models"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2 and "KDEQ_MALLOC" in done.stderr


def test_a_c_library_without_the_thresholds_is_left_as_it_is_and_said_so(monkeypatch, caplog) -> None:
    """musl's ``mallopt`` is a stub that returns 0: ``keep`` reports that nothing took effect, at
    every call, and logs it each time (the service's log is set up after the command line's call)."""

    class Stub:
        @staticmethod
        def mallopt(param: int, value: int) -> int:
            return 0

    monkeypatch.setattr(heap, "_libc", Stub)
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.setattr(heap, "_kept", False)
    with caplog.at_level(logging.INFO, logger="kdeq.heap"):
        assert heap.configure("keep") is False and heap.configure("keep") is False
    assert caplog.text.count("no thresholds to set") == 2
