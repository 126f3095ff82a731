"""``bench/gpu.py``'s parts that need no GPU (issue 55): the peer network, the timing helper, the
profile's arithmetic (launches, busy time, top kernels) on hand-made events and on a real
``torch.profiler`` run of the CPU, the peer section on the CPU, the targets table and the command line.
The sections that need CUDA run on a GPU machine through ``bench/gpu.sh``."""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)

Event = gpu.Event


def test_the_peer_network_has_dncnns_shape() -> None:
    """17 zero-padded 3×3 convolutions 1 → 64 → … → 64 → 1, a ReLU after all but the last: DnCNN's
    555,137 parameters (its 0.56 M) once batch normalisation is folded into the biases."""
    net = gpu.peer_network()
    convs = [m for m in net if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 17 and sum(isinstance(m, torch.nn.ReLU) for m in net) == 16
    assert not isinstance(net[-1], torch.nn.ReLU)
    assert [(c.in_channels, c.out_channels) for c in convs] == [(1, 64)] + [(64, 64)] * 15 + [(64, 1)]
    assert all(c.kernel_size == (3, 3) and c.padding == (1, 1) for c in convs)
    expected = (9 * 64 + 64) + 15 * (9 * 64 * 64 + 64) + (9 * 64 + 1)
    assert sum(p.numel() for p in net.parameters()) == expected == 555_137
    with torch.inference_mode():
        assert net(torch.rand(2, 1, 20, 24)).shape == (2, 1, 20, 24)


def test_timing_takes_the_median_of_repeat_runs_and_stops_at_its_budget() -> None:
    """``repeat`` timed calls after one warm-up; with a budget, no more than it takes for the timed calls
    to reach it (each sleeps ≥ 20 ms, so at most ⌈100 / 20⌉ = 5), and at least one."""
    calls = []

    def run() -> None:
        calls.append(None)
        time.sleep(0.02)

    seconds = gpu.timed(run, 3, False)
    assert len(calls) == 4 and seconds >= 0.02
    calls.clear()
    seconds = gpu.timed(run, 50, False, budget=0.1)
    assert 2 <= len(calls) <= 1 + 5 and seconds >= 0.02
    calls.clear()
    gpu.timed(run, 50, False, budget=0.0)
    assert len(calls) == 2


def test_covered_time_counts_overlapping_and_nested_intervals_once() -> None:
    assert gpu.covered_us([]) == 0
    assert gpu.covered_us([(20, 25), (0, 10), (30, 32), (5, 17)]) == 17 + 5 + 2  # two streams overlap
    assert gpu.covered_us([(0, 10), (2, 3), (4, 9)]) == 10  # an op and the ops inside it
    assert gpu.covered_us([(0, 1), (1, 2), (2, 2)]) == 2


def test_a_profile_is_summarised_per_solve_from_hand_made_events() -> None:
    """Two solves: five launches (a graph's launch is one; a copy's call is not a launch), four GPU
    events of which two overlap, busy 24 µs in all."""
    events = [
        Event("cudaLaunchKernel", "CPU", 0, 1),
        Event("cuLaunchKernel", "CPU", 1, 2),
        Event("cudaLaunchKernelExC", "CPU", 2, 3),
        Event("cudaLaunchKernel", "CPU", 3, 4),
        Event("cudaGraphLaunch", "CPU", 4, 5),
        Event("cudaMemcpyAsync", "CPU", 5, 6),
        Event("aten::add", "CPU", 0, 6),
        Event("kernel_a", "CUDA", 0, 10),
        Event("kernel_b", "CUDA", 5, 17),
        Event("kernel_a", "CUDA", 20, 25),
        Event("Memcpy HtoD (Pageable -> Device)", "CUDA", 30, 32),
    ]
    found = gpu.summarise(events, solves=2, top=2)
    assert found.launches == 2.5 and found.device_ops == 2.0 and found.device_us == 12.0
    assert found.top == [("kernel_a", 7.5, 1.0, 15 / 29), ("kernel_b", 6.0, 0.5, 12 / 29)]


def test_a_real_profile_of_the_cpu_is_summarised_per_solve() -> None:
    """The same arithmetic on ``torch.profiler``'s events of two solves of a small peer network on the
    CPU, its ops standing in for a GPU's kernels: one ``aten::conv2d`` a layer a solve, no annotation,
    and busy time that counts nested ops once, so within the profiled wall time and under the ops'
    summed time."""
    depth, solves = 4, 2
    net = gpu.peer_network(depth=depth, features=8)
    x = torch.rand(1, 1, 16, 16)
    with torch.inference_mode():
        net(x)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(solves):
                with record_function("a solve"):  # an annotation: a range, not work, left out
                    net(x)
            wall_us = (time.perf_counter() - start) * 1e6
    events = gpu.events_of(prof)
    assert {e.device for e in events} == {"CPU"} and "a solve" not in {e.name for e in events}
    found = gpu.summarise(events, solves, device="CPU", launch=re.compile(r"^aten::conv2d$"), top=100)
    assert found.launches == depth and found.device_ops == len(events) / solves
    calls = {name: n for name, _, n, _ in found.top}
    assert calls["aten::conv2d"] == calls["aten::relu_"] + 1 == depth
    summed = sum(e.end_us - e.start_us for e in events) / solves
    assert 0 < found.device_us * solves <= wall_us and found.device_us < summed
    times = [us for _, us, _, _ in found.top]
    assert times == sorted(times, reverse=True)
    assert math.isclose(sum(share for *_, share in found.top), 1.0)


def test_the_peer_section_times_both_arithmetics_on_the_cpu() -> None:
    """The section itself, on the CPU at 16² (the GPU runs it at the models' sizes): a row and a rate
    for each arithmetic, size and batch, bfloat16's row read against float32's."""
    args = argparse.Namespace(seed=0, repeat=1, point_seconds=math.inf)
    out: list[str] = []
    rates: dict = {}
    gpu.section_peer(args, out, rates, device="cpu", sizes=(16,), batches=(1, 2))
    keys = {(f"peer-{name}", 16, b) for name in ("float32", "bfloat16") for b in (1, 2)}
    assert set(rates) == keys and all(r > 0 for r in rates.values())
    rows = [line for line in out if line.startswith(("| float32 |", "| bfloat16 |"))]
    assert [r.split(" | ")[:3] for r in rows] == [
        ["| float32", "16²", "1"],
        ["| float32", "16²", "2"],
        ["| bfloat16", "16²", "1"],
        ["| bfloat16", "16²", "2"],
    ]
    ratio = rates[("peer-bfloat16", 16, 2)] / rates[("peer-float32", 16, 2)]
    assert rows[3].endswith(f"| {ratio:.2f} |") and rows[1].endswith("|  |")


def test_a_row_is_read_against_the_peer_at_its_size_and_batch() -> None:
    rates = {("m", 256, 8): 30.0, ("peer-bfloat16", 256, 8): 60.0, ("peer-float32", 256, 8): 15.0}
    assert gpu.per_peer(rates, "m", 256, 8) == 0.5
    assert gpu.per_peer(rates, "m", 256, 8, "float32") == 2.0
    assert math.isnan(gpu.per_peer(rates, "m", 512, 8))


def test_the_targets_table_reads_the_other_sections_figures() -> None:
    """Issue 55's figures from ``rates`` as the sections leave them, and NaN, not an error, for a
    figure whose section was not run (``--sections``)."""
    d = gpu.DEFAULT
    rates = {
        (d, 256, 1): 50.0,
        (d, 256, 32): 400.0,
        (d, 256, 64): 500.0,
        (d, 512, 64): 900.0,  # another size: not the best 256² batch
        ("peer-bfloat16", 256, 64): 1000.0,
        ("peer-float32", 256, 64): 250.0,
        ("cpu", 256, 1): 10.0,
        ("launches", 256, 1): 42.0,
        ("busy", 256, 32): 0.85,
    }
    out: list[str] = []
    gpu.section_targets(argparse.Namespace(), out, rates)
    text = "\n".join(out)
    assert "| batch 1 | 50.0 images/s, p50 20.0 ms |" in text
    assert "| kernel launches per solve, batch 1 | 42 | ≤ 60 |" in text
    assert "| best batch (64) | 500.0 images/s, ÷ bfloat16 peer 0.50 (÷ float32 peer 2.00) |" in text
    assert "| GPU busy, batch 32 | 0.85 | ≥ 0.8 |" in text
    assert "batch 1 | 5.0× | ≥ 20× |" in text and "| GPU best batch ÷ CPU batch 1 | 50.0× |" in text
    empty: list[str] = []
    gpu.section_targets(argparse.Namespace(), empty, {})
    assert len(empty) == len(out) and "nan" in empty[-1]


def test_section_times_are_set_against_their_budgets() -> None:
    lines = gpu.times_table({"peer": 5.0, "models": 200.0})
    assert "| peer | 5.0 | 20 |" in lines and "| models | 200.0 | 150 (over) |" in lines
    assert lines[-1] == "| all | 205.0 | 170 |"
    assert set(gpu.BUDGET_S) == set(gpu.SECTIONS)


def test_sections_are_chosen_by_name_and_run_in_their_order() -> None:
    assert gpu.sections_arg("targets, peer") == ["peer", "targets"]
    with pytest.raises(argparse.ArgumentTypeError, match="nope"):
        gpu.sections_arg("peer,nope")


def test_the_command_line_documents_every_section() -> None:
    helped = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0
    assert all(f"``{name}``" in helped.stdout for name in gpu.SECTIONS)


def test_the_command_line_refuses_an_unknown_section_and_a_machine_without_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(sys, "argv", ["bench/gpu.py", "--sections", "peer,nope"])
    with pytest.raises(SystemExit) as stopped:
        gpu.main()
    assert stopped.value.code == 2 and "unknown section(s) ['nope']" in capsys.readouterr().err
    if not torch.cuda.is_available():  # no figures from a CPU run passed off as the GPU's
        monkeypatch.setattr(sys, "argv", ["bench/gpu.py", "--sections", "peer"])
        with pytest.raises(SystemExit) as stopped:
            gpu.main()
        assert stopped.value.code == 2 and "no CUDA device" in capsys.readouterr().err
