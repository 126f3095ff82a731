"""``bench/launches.py``: the launches a GPU solve would make, counted on the CPU. Its contract on the
default denoiser and a small image: the total is the sum of its parts, each fused call of the real path
is counted as the launches ``kdeq.maths.fused`` makes for it, and a replayed chunk's work is not counted
twice."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kdeq.maths import fused, graphs
from kdeq.runtime import native

pytest.importorskip(
    "triton", reason="kdeq.maths.fused's launch path needs Triton (the gpu extra, in the dev setup)"
)

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_launches", ROOT / "bench" / "launches.py")
launches = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = launches  # its dataclass looks its module up
_spec.loader.exec_module(launches)

SIZE = 20  # a few of the kernels' 8 × 32 tiles would change nothing here: the launches do not depend on it


@pytest.fixture(scope="module")
def denoiser():
    predictor = launches.load_predictor(launches.model_folder("denoise-kglm"), "cpu")
    return predictor, *launches.arguments(predictor.task, SIZE, 1, 25.0)


def _spied(monkeypatch) -> Counter:
    """Calls of ``kdeq.maths.fused``'s entry points, each still run."""
    calls: Counter = Counter()
    for name in ("weights", "apply", "pairs", "patch_pairs"):
        real = getattr(fused, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(fused, name, spy)
    return calls


def test_total_is_the_sum_of_its_parts(denoiser) -> None:
    predictor, args, kwargs = denoiser
    c = launches.count(predictor, args, kwargs)
    parts = sum(c.aten.values()) + sum(c.fused.values()) + sum(c.graph.values())
    assert c.total == parts == sum(c.by_source().values())
    assert sum(c.graph.values()) >= 1 and sum(c.in_graphs.values()) >= 1
    assert c.warm_ups == 0  # the warm-up call met every chunk
    assert not any(op in launches.NO_KERNEL for _, op in c.aten)
    assert all(src.startswith("kdeq/") for src, _ in c.aten)
    report = launches.report(c, top=5)
    assert f"= {c.total} launches" in report


def test_fused_launches_are_the_real_paths(denoiser, monkeypatch) -> None:
    """Eager steps: each ``fused.weights`` one weights launch, ``fused.apply`` (``K x``) and
    ``fused.pairs`` one pairs launch each, ``fused.patch_pairs`` a patch and a pairs launch; replayed,
    the same launches split between those made alone and those inside the graphs."""
    predictor, args, kwargs = denoiser
    calls = _spied(monkeypatch)
    eager = launches.count(predictor, args, kwargs, replay=False)
    # the spies saw the warm-up call and the counted one, which made the same calls
    assert all(n % 2 == 0 for n in calls.values())
    made = {k: n // 2 for k, n in calls.items()}
    assert made["weights"] >= 1 and made["apply"] >= 1
    kernels = Counter()
    for (_, name), n in eager.fused.items():
        kernels[name] += n
    assert kernels == Counter(
        weights=made["weights"],
        pairs=made["apply"] + made["pairs"] + made["patch_pairs"],
        patch=made["patch_pairs"],
    )
    assert not eager.graph and not eager.in_graphs
    replayed = launches.count(predictor, args, kwargs)
    assert replayed.iterations == eager.iterations
    # a chunk runs all its steps (a converged sample's state frozen), so the graphs hold at least the
    # steps' launches of the eager solve; those outside the solver's steps are the same launches
    outside = sum(replayed.fused.values())
    assert outside < sum(eager.fused.values()) <= outside + sum(replayed.in_graphs.values())
    # the steps' glue went into the graphs: fewer operations launched one by one
    assert sum(replayed.aten.values()) < sum(eager.aten.values())


def test_emulation_is_undone(denoiser) -> None:
    predictor, args, kwargs = denoiser
    saved = (fused._kernels, fused.enabled, native.enabled, graphs._chunk, graphs._warm_up)
    launches.count(predictor, args, kwargs)
    assert (fused._kernels, fused.enabled, native.enabled, graphs._chunk, graphs._warm_up) == saved
    assert graphs.mode(torch.device("cpu")) is None


def test_views_are_not_counted_and_copies_are() -> None:
    """``contiguous`` of a transposed matrix is one ``clone``; a view, a reshape of a contiguous tensor
    and an allocation are none; a tensor from host data is one (a host-to-device copy on a GPU)."""
    x = torch.ones(3, 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x.t().contiguous()
        x.view(-1).reshape(4, 3)
        torch.empty(5)
        torch.tensor([1.0, 2.0])
    c = launches.Count()
    launches._tally(prof.events(), c)
    assert Counter({op: n for (_, op), n in c.aten.items()}) == Counter(
        {"aten::clone": 1, "aten::lift_fresh": 1}
    )
