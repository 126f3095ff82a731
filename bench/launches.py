"""The operations a GPU solve would launch, counted on the CPU, per ``predict`` of a served model, and the
source lines they come from (issue 55: the glue around the fused kernels and the replayed steps).

    .venv/bin/python bench/launches.py [--model denoise-kglm] [--size 64] [--batch 1] [--sigma 25]
        [--top 25] [--graphs] [--compare]

A model is loaded on the CPU and run as a CUDA device would run it (``emulated_cuda``): the guided
kernel's loops go to ``kdeq.maths.fused`` (``auto``'s choice on CUDA) rather than ``kdeq.runtime.native``,
the blurs take their GPU branch (``gpu_blur``), and with ``--graphs`` the solver's steps run in
``kdeq.maths.graphs``' chunks (``replaying_on_cpu``). One ``predict`` warms the caches (the fused
module's index tensors, the chunks' static copies: a GPU's first request), then one is counted:

- **aten**: every outermost ``aten`` operation that makes a kernel, from ``torch.profiler``'s events.
  ``NO_KERNEL`` lists those that make none (views, reshapes, allocations, dispatch wrappers such as
  ``aten::to`` or ``aten::contiguous``, host reads); an operation is counted when it is not in that list
  and no operation above it is (``contiguous`` of a strided tensor is counted as its ``clone``).
  ``aten::lift_fresh`` is counted: it is a tensor made from host data, a host-to-device copy on a GPU.
- **fused**: each launch of a ``kdeq.maths.fused`` kernel. Its glue (index tensors, output buffers) runs as
  on a GPU; only the kernel itself is replaced by an equivalent computation (``kdeq.runtime.native``'s
  loops, or torch's for the patch sums) whose operations are not counted. Triton's interpreter is not run.
- **graph**: each replay of a captured chunk of solver steps; the steps' own operations (fused launches
  included) are not counted, being inside the graph (they are listed as ``in graphs``). The copies into
  and out of the chunks' buffers and the done flag's read are glue, counted.

Each is attributed to the innermost ``kdeq/`` frame of the Python call that made it (file:line,
function): a ``TorchFunctionMode`` tags each torch call with it. (``torch.profiler``'s ``with_stack``
events carry only a function's first line here, not the calling line.) Host reads (``aten::item``,
``aten::is_nonzero``: a synchronisation on a GPU) are listed beside the launches, not among them.

Differences from a GPU run that remain: the CPU's own choices of kernels inside an operation (one aten
operation may be several kernels on a GPU, or one cuBLAS/cuDNN call a few), and a graph capture's
launches on a request that meets a new chunk (``warm-ups`` in the output, 0 in steady state).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kdeq.cli import test_image
from kdeq.maths import adaptive, filters, fused, graphs
from kdeq.models.repository import default_models_dir, load_predictor
from kdeq.runtime import native

#: aten operations that launch no kernel themselves: views and metadata, allocations without a fill,
#: dispatch wrappers whose kernels are their children (counted there), host reads (``SYNCS``)
NO_KERNEL = frozenset(
    "aten::" + name
    for name in [
        "view",
        "view_as",
        "reshape",
        "_reshape_alias",
        "_unsafe_view",
        "as_strided",
        "as_strided_",
        "slice",
        "select",
        "narrow",
        "unsqueeze",
        "unsqueeze_",
        "squeeze",
        "squeeze_",
        "expand",
        "expand_as",
        "t",
        "transpose",
        "permute",
        "movedim",
        "unfold",
        "flatten",
        "unflatten",
        "diagonal",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "alias",
        "detach",
        "detach_",
        "real",
        "imag",
        "resolve_conj",
        "resolve_neg",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "set_",
        "to",
        "_to_copy",
        "type_as",
        "contiguous",
        "zeros_like",
        "ones_like",
        "full_like",
        "new_zeros",
        "new_ones",
        "new_full",
        "result_type",
        "size",
        "stride",
        "numel",
        "dim",
        "is_same_size",
        "item",
        "_local_scalar_dense",
        "is_nonzero",
    ]
)
#: host reads: a synchronisation with the device on a GPU
SYNCS = frozenset({"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero"})
#: the profiler's names for this tool's own markers
TAG, LAUNCH = "src:", "launch:"

KDEQ = Path(__file__).resolve().parent.parent / "kdeq"


def _source(skip: tuple[str, ...] = ()) -> str:
    """``file:line function`` of the innermost frame in ``kdeq/`` (not in a file of ``skip``)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if KDEQ in path.parents and path.name not in skip:
            return f"kdeq/{path.relative_to(KDEQ).as_posix()}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "(outside kdeq)"


class _Tagged(TorchFunctionMode):
    """Each torch call run inside a profiler range named by its innermost ``kdeq/`` frame."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        with record_function(TAG + _source()):
            return func(*args, **(kwargs or {}))


@dataclass
class Count:
    """One ``predict``'s launches: ``aten`` by (source, operation), ``fused`` by (source, kernel),
    ``graph`` replays by source; ``in_graphs`` the fused launches inside replayed chunks; ``syncs`` the
    host reads; ``warm_ups`` the chunks run before their capture."""

    aten: Counter = field(default_factory=Counter)
    fused: Counter = field(default_factory=Counter)
    graph: Counter = field(default_factory=Counter)
    in_graphs: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    warm_ups: int = 0
    iterations: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        """The launches: aten operations, fused kernels and graph replays."""
        return sum(self.aten.values()) + sum(self.fused.values()) + sum(self.graph.values())

    def by_source(self) -> Counter:
        """Launches per source line ``file:line function``, every kind together."""
        out: Counter = Counter()
        for (src, _), n in (*self.aten.items(), *self.fused.items()):
            out[src] += n
        for src, n in self.graph.items():
            out[src] += n
        return out


# The fused kernels' work, done here by kdeq.runtime.native's loops (torch's for the patch sums) on the same
# buffers: the arguments are those kdeq.maths.fused passes to the Triton kernels.


def _offsets(oa: torch.Tensor, ob: torch.Tensor) -> list[tuple[int, int]]:
    return list(zip(oa.tolist(), ob.tolist(), strict=True))


def _weights(padded, sizes, inv, taps, oa, ob, out, *_, DIST, **__):
    """``out[:, j] = w_j`` (``fused._weights_kernel`` without ``DIST``) of the per-image mirrored guide."""
    if DIST:
        raise NotImplementedError("the distances are made only in the backward pass")
    offsets = _offsets(oa, ob)
    native.weights(padded, offsets, taps, inv, adaptive._CUTOFF, out)
    every = [tuple(hw) for hw in sizes.reshape(-1, 2).tolist()]
    if any(hw != tuple(out.shape[-2:]) for hw in every):  # native's image is the whole array
        out.mul_(adaptive._inside(tuple(out.shape[-2:]), offsets, out.device, every))


def _pairs(wgt, idx, oa, ob, scale, x, out, best, *_, POWER, HAS_BEST, **__):
    """``fused._pairs_kernel``: ``kdeq.runtime.native.pairs`` of the same arguments."""
    native.pairs(
        wgt, idx.tolist(), _offsets(oa, ob), scale.tolist(), POWER, x, out, best if HAS_BEST else None
    )


def _patch(wgt, idx, oa, ob, scale, t, sums, *_, POWER, PR, **__):
    """``fused._patch_kernel``: ``S_k(q) = Σ_{|d|≤p} s_k(q + d)``, ``s_k(z) = (scale_k·w_{idx_k}(z))^POWER
    · t(z)·t(z + o_k)`` (0 unless ``z`` and ``z + o_k`` are in the image), ``sums`` ``(B, L, H, W)``."""
    height, width = t.shape[-2:]
    n = 2 * PR + 1
    for k, (j, (a, b), s) in enumerate(zip(idx.tolist(), _offsets(oa, ob), scale.tolist(), strict=True)):
        r = max(abs(a), abs(b))
        ahead = F.pad(t, (r, r, r, r))[..., r + a : r + a + height, r + b : r + b + width]
        part = (s * wgt[:, j : j + 1]) ** POWER * t * ahead
        boxed = F.avg_pool2d(F.pad(part, (PR, PR, PR, PR)), n, stride=1, divisor_override=1)
        sums[:, k : k + 1] = boxed


_WORK = {"weights": _weights, "pairs": _pairs, "patch": _patch}


class _Recorder:
    """The counting state of one ``predict``: sources of the launches, and whether a chunk or a warm-up
    is running."""

    def __init__(self) -> None:
        self.count = Count()
        self.chunk_depth = 0
        self.warm_depth = 0
        self.on = False


def _kernel(name: str, rec: _Recorder) -> Callable:
    def launch(*args, **kwargs) -> None:
        if rec.on:
            src = _source(skip=("fused.py",))
            if rec.chunk_depth and not rec.warm_depth:
                rec.count.in_graphs[(src, name)] += 1
            else:
                rec.count.fused[(src, name)] += 1
        with record_function(LAUNCH + name):
            _WORK[name](*args, **kwargs)

    return launch


def _enabled(pinned: str | None, *tensors: torch.Tensor) -> bool:
    """``fused.enabled`` as on a CUDA device: Triton's kernels for ``auto`` or ``triton``, one device and
    one of float32 and float64."""
    device, dtype = tensors[0].device, tensors[0].dtype
    return (
        pinned in (None, "triton")
        and dtype in (torch.float32, torch.float64)
        and all(t.device == device and t.dtype == dtype for t in tensors)
    )


@contextlib.contextmanager
def emulated_cuda(rec: _Recorder, replay: bool = True) -> Iterator[None]:
    """Within it the CPU runs the kernels and (with ``replay``) the solver's chunks as a CUDA device would
    (module docstring), each fused launch and chunk replay counted into ``rec`` while ``rec.on``."""
    kernels = SimpleNamespace(**{n: _Grid(_kernel(n, rec)) for n in _WORK})
    chunk, warm_up = graphs._chunk, graphs._warm_up

    def replayed(entry, steps):
        if rec.warm_depth:  # a warm-up: eager work on a GPU too
            return chunk(entry, steps)
        if rec.on:
            rec.count.graph[_source(skip=("graphs.py",))] += 1
        rec.chunk_depth += 1
        try:
            with record_function(LAUNCH + "graph"):
                return chunk(entry, steps)
        finally:
            rec.chunk_depth -= 1

    def warmed(entry, steps):
        rec.count.warm_ups += rec.on
        rec.warm_depth += 1
        try:
            return warm_up(entry, steps)
        finally:
            rec.warm_depth -= 1

    saved = (fused._kernels, fused.enabled, native.enabled, graphs._chunk, graphs._warm_up)
    fused._kernels, fused.enabled = (lambda: kernels), _enabled
    native.enabled = lambda *tensors: False  # kdeq.runtime.native's loops are the CPU's
    graphs._chunk, graphs._warm_up = replayed, warmed
    try:
        with graphs.replaying_on_cpu() if replay else contextlib.nullcontext(), gpu_blur():
            yield
    finally:
        fused._kernels, fused.enabled, native.enabled, graphs._chunk, graphs._warm_up = saved


@contextlib.contextmanager
def gpu_blur() -> Iterator[None]:
    """Within it ``filters.separable_blur`` takes its GPU branch, two grouped convolutions, rather than
    the CPU's shifted multiply-adds (the one branch on the device's type that the default denoiser
    meets outside the guided kernel and the solver's host reads)."""
    saved = filters._blur_shifted
    filters._blur_shifted = filters._blur_grouped
    try:
        yield
    finally:
        filters._blur_shifted = saved


@contextlib.contextmanager
def emulated_before() -> Iterator[None]:
    """Within it the CPU runs the guided kernel as a CUDA device ran it before ``kdeq.maths.fused``: torch's
    loops, made and applied by gathers where a GPU gathers (``adaptive.GATHER_PIXELS``), the solver's
    steps one at a time; every operation counts (the baseline of ``--compare``)."""
    saved = (fused.enabled, native.enabled, adaptive._gathers)
    fused.enabled = lambda pinned, *tensors: False
    native.enabled = lambda *tensors: False
    adaptive._gathers = lambda x: x.shape[0] * x.shape[-2] * x.shape[-1] <= adaptive.GATHER_PIXELS
    try:
        with gpu_blur():
            yield
    finally:
        fused.enabled, native.enabled, adaptive._gathers = saved


class _Grid:
    """``kernel[grid](...)``: the grid is the Triton launch's, of no use here."""

    def __init__(self, launch: Callable) -> None:
        self.launch = launch

    def __getitem__(self, grid: object) -> Callable:
        return self.launch


def _outermost(event, names: frozenset) -> bool:
    """Whether no ancestor of ``event`` is an aten operation outside ``names`` (one that counts)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::") and parent.name not in names:
            return False
        parent = parent.cpu_parent
    return True


def _tally(events, count: Count) -> None:
    """The profiled aten operations into ``count``: those outside this tool's launch ranges."""
    for event in events:
        name = event.name
        if not name.startswith("aten::") or (name in NO_KERNEL and name not in SYNCS):
            continue
        src, parent, inside = "(outside kdeq)", event.cpu_parent, False
        while parent is not None:
            if parent.name.startswith(LAUNCH):
                inside = True
                break
            if src == "(outside kdeq)" and parent.name.startswith(TAG):
                src = parent.name[len(TAG) :]
            parent = parent.cpu_parent
        if inside:
            continue
        if name in SYNCS:
            if _outermost(event, NO_KERNEL - SYNCS):
                count.syncs[(src, name)] += 1
        elif _outermost(event, NO_KERNEL):
            count.aten[(src, name)] += 1


_lock = threading.Lock()


def count(predictor, args: tuple, kwargs: dict, replay: bool = True, before: bool = False) -> Count:
    """One ``predict(*args, **kwargs)`` of ``predictor`` (on the CPU) counted as a CUDA device would
    launch it, after one uncounted warm-up call; ``replay=False``: the solver's steps eager
    (``KDEQ_CUDA_GRAPHS`` unset, as served); ``before``: as a CUDA device ran it before the fused
    kernels and the replayed steps (``emulated_before``)."""
    rec = _Recorder()
    with _lock, emulated_before() if before else emulated_cuda(rec, replay):
        predictor.predict(*args, **kwargs)
        rec.on = True
        with profile(activities=[ProfilerActivity.CPU]) as prof, _Tagged():
            out = predictor.predict(*args, **kwargs)
        rec.on = False
    _tally(prof.events(), rec.count)
    stats = getattr(out, "stats", None)
    if stats is not None:
        rec.count.iterations = stats.iterations.reshape(-1).tolist()
    return rec.count


def arguments(task: str, size: int, batch: int, sigma: float) -> tuple[tuple, dict]:
    """``predict``'s arguments: ``batch`` copies of ``test_image(size)`` with Gaussian noise of ``sigma``
    (0–255 scale, seed 0), clipped to [0, 1]; a denoiser is told ``sigma``."""
    gen = torch.Generator().manual_seed(0)
    clean = test_image(size).expand(batch, 1, size, size)
    images = (clean + sigma / 255 * torch.randn(clean.shape, generator=gen)).clamp(0, 1)
    if task.startswith("denoise"):
        return (images,), {"sigma": sigma}
    if task == "segment":
        return (images,), {}
    raise SystemExit(f"bench/launches.py: no arguments for the task {task!r} yet")


def model_folder(name: str) -> Path:
    """The newest version of the served model ``name``."""
    folder = default_models_dir() / name
    return sorted(folder.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)[-1]


def report(c: Count, top: int) -> str:
    """The table: the top sources by launches, each with its most frequent operations; the totals."""
    per_op: dict[str, Counter] = {}
    for (src, op), n in (*c.aten.items(), *c.fused.items()):
        per_op.setdefault(src, Counter())[op.removeprefix("aten::")] += n
    for src, n in c.graph.items():
        per_op.setdefault(src, Counter())["graph replay"] += n
    lines = [f"{'launches':>8}  source (innermost kdeq/ frame)  — its operations"]
    for src, n in c.by_source().most_common(top):
        ops = ", ".join(f"{k} {v}" for k, v in per_op[src].most_common(4))
        lines.append(f"{n:8d}  {src}  — {ops}")
    kinds: Counter = Counter()
    for (_, op), n in c.aten.items():
        kinds[op.removeprefix("aten::")] += n
    lines += [
        "",
        "aten operations: " + ", ".join(f"{k} {v}" for k, v in kinds.most_common(15)),
        f"fused kernels: {dict(Counter(k for (_, k), n in c.fused.items() for _ in range(n)))}; "
        f"in graphs (not launched separately): {sum(c.in_graphs.values())}",
        f"host reads (syncs): {sum(c.syncs.values())}; chunk warm-ups: {c.warm_ups}; "
        f"solver iterations: {c.iterations}",
        f"per predict: {sum(c.aten.values())} aten + {sum(c.fused.values())} fused + "
        f"{sum(c.graph.values())} graph replays = {c.total} launches",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="denoise-kglm")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sigma", type=float, default=25.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="the solver's steps replayed as CUDA graphs (KDEQ_CUDA_GRAPHS=1; off by default, as served)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also count the same predict as a GPU ran it before the fused kernels (torch's loops by "
        "gathers, steps eager), and print the ratio",
    )
    opts = parser.parse_args(argv)
    folder = model_folder(opts.model)
    predictor = load_predictor(folder, "cpu")
    args, kwargs = arguments(predictor.task, opts.size, opts.batch, opts.sigma)
    c = count(predictor, args, kwargs, replay=opts.graphs)
    print(
        f"{folder.relative_to(default_models_dir().parent)}: {opts.batch}×{opts.size}², σ={opts.sigma:g}; "
        f"torch {torch.__version__}, {platform.machine()}, emulating a CUDA device on the CPU"
    )
    print(report(c, opts.top))
    if opts.compare:
        b = count(predictor, args, kwargs, before=True)
        print(
            f"before the fused kernels (torch's loops by gathers, steps eager): {b.total} launches, "
            f"solver iterations {b.iterations}; now {c.total}: {b.total / c.total:.1f}x fewer"
        )


if __name__ == "__main__":
    main()
