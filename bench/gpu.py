"""The GPU benchmark (issues 20 and 55), every figure beside the baseline it is read against, in one run:

    python bench/gpu.py [--out results.md] [--seconds 8] [--repeat 5] [--point-seconds 2] [--seed 0]
                        [--sections peer,models,...]

Sections, in the order they run (``--sections`` picks some, in this order):

- ``peer``: a DnCNN-sized network (``peer_network``: 17 3×3 convolutions of 64 features, ReLU, batch
  normalisation folded away, random weights: timing only) on the same GPU, in IEEE float32 (no TF32)
  and in bfloat16 channels-last, images/s at the batches and sizes of ``models``, grey.
- ``models``: for each served model (the newest version of each name in ``models/``), images/s at
  batch 1, 8, 32 and 64 for 256² and 512² grey images (σ = 25 noise, seeded; half the pixels missing
  for the inpainter, a Gaussian PSF of width 1.6 for the deblurrer, scale 2 for the super-resolver),
  ÷ the bfloat16 peer's images/s at the same size and batch, p50 milliseconds per batch, and peak
  GPU memory per megapixel above what the loaded model holds.
- ``cpu``: the default denoiser on this machine's CPU with torch on 2 threads, batch 1 and 8 at 256²,
  and the GPU ÷ CPU throughput ratios (targets: ≥ 20× at batch 1, ≥ 100× batched), the GPU's rows
  also ÷ the bfloat16 peer.
- ``profile``: the default denoiser at 256², batch 1 and 32, under ``torch.profiler``: kernel launches
  per solve (target ≤ 60 at batch 1), kernels run on the GPU per solve, the GPU-busy fraction (time
  with a kernel or copy on the GPU ÷ the unprofiled wall time, target ≥ 0.8 at batch 32), and the
  kernels that take the most GPU time.
- ``targets``: issue 55's figures for the default denoiser in one table, from the sections above.
- ``service``: a real ``python -m service`` on ``cuda:0`` serving the default denoiser, 32 clients
  posting 256² PNGs for ``--seconds``, with batching off (``KDEQ_MAX_BATCH_SIZE=1``) and on
  (``KDEQ_MAX_BATCH_SIZE=32``), and the ratio (target ≥ 5×).
- ``backends``: the zero-border convolution backends of ``kdeq.runtime.backends`` on the GPU, each ÷
  ``padded`` (what the GPU uses), with cuDNN's heuristics and with ``cudnn.benchmark``.
- ``gathers``: the guided kernel's weights and ``K x`` an offset at a time against by gathers
  (``kdeq.maths.adaptive.GATHER_PIXELS`` chooses between them), same run, for the default denoiser.
- ``netprecision``: the default denoiser with its guide network in float32 and in bfloat16
  (``kdeq.runtime.netprecision``), time and the output's largest difference and PSNR, same run, and each
  ÷ the bfloat16 peer.

Times are medians of ``--repeat`` runs after a warm-up, each ended by ``torch.cuda.synchronize``; a
point stops early once its timed runs have taken ``--point-seconds`` (at least one is timed), which
bounds the slowest rows. Each section's wall time is printed beside its budget (``BUDGET_S``, at the
default arguments), and the Markdown tables are rewritten to ``--out`` after every section, so a run
stopped by a time limit keeps what it measured. Writes the tables to stdout too. Exits 2 without a
CUDA device.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from load import drive, free_port, images, multipart, start_server  # noqa: E402

from kdeq.cli import test_image  # noqa: E402
from kdeq.maths import graphs  # noqa: E402
from kdeq.maths.precision import ieee_float32  # noqa: E402
from kdeq.models.repository import default_models_dir, load_predictor  # noqa: E402
from kdeq.runtime import backends  # noqa: E402
from tests.helpers import predict_arguments  # noqa: E402

SIGMA = 25.0
BATCHES = (1, 8, 32, 64)
SIZES = (256, 512)
DEFAULT = "denoise-kglm"
#: the peer's arithmetic: IEEE float32 and bfloat16 channels-last; ``rates`` keys it as ``peer-<name>``
PEER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: the batches the ``profile`` section profiles, and how many solves each profile holds
PROFILE_BATCHES = (1, 32)
PROFILED_SOLVES = 3
#: a host-side call that puts kernels on the GPU: the runtime's and the driver's kernel launches (Triton
#: launches through the driver), and a CUDA graph's launch, one call for all its kernels
LAUNCH = re.compile(r"^cu(da)?(LaunchKernel|LaunchCooperativeKernel|GraphLaunch)")
#: seconds each section is expected to take at the default arguments on one H100/H200 (``bench/gpu.sh``
#: must fit one call of 8 minutes, the CUDA suite's ~2 included); the run prints each against its own
BUDGET_S = {
    "peer": 20,
    "models": 150,
    "cpu": 20,
    "profile": 45,
    "targets": 1,
    "service": 45,
    "backends": 10,
    "gathers": 30,
    "netprecision": 10,
}


def served() -> list[Path]:
    """The newest version of each model name: what the service loads by default."""
    newest: dict[str, Path] = {}
    for folder in sorted(p.parent for p in default_models_dir().glob("*/*/config.json")):
        name = folder.parent.name
        if name not in newest or int(folder.name) > int(newest[name].name):
            newest[name] = folder
    return list(newest.values())


def inputs(task: str, batch: int, size: int, seed: int, device: str) -> tuple[tuple, dict]:
    """``predict``'s arguments on ``device``: ``batch`` noisy grey test images ``(batch, 1, size, size)``
    and what ``task`` takes beside them (``tests.helpers.predict_arguments``: a mask, a PSF, a scale)."""
    gen = torch.Generator().manual_seed(seed)
    clean = test_image(size).expand(batch, 1, size, size)
    images = (clean + SIGMA / 255 * torch.randn(clean.shape, generator=gen)).clamp(0, 1)
    args, kwargs = predict_arguments(task, images, SIGMA, gen)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), kwargs


def timed(run: Callable[[], object], repeat: int, cuda: bool, budget: float = math.inf) -> float:
    """Median seconds of ``run`` over ``repeat`` calls after one warm-up, or over fewer once the timed
    calls have taken ``budget`` seconds together (at least one is timed)."""
    times: list[float] = []
    for k in range(repeat + 1):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        if k:
            times.append(time.perf_counter() - start)
            if sum(times) >= budget:
                break
    return statistics.median(times)


def peer_network(depth: int = 17, features: int = 64) -> torch.nn.Sequential:
    """DnCNN's shape (Zhang et al., 2017) with its batch normalisation folded into the biases: ``depth``
    zero-padded 3×3 convolutions, 1 → ``features`` → … → ``features`` → 1 channels, a ReLU after each
    but the last; ``(B, 1, H, W)`` → ``(B, 1, H, W)``, the noise it would subtract. Random weights:
    the ``peer`` section times it, nothing reads its output."""
    widths = [1] + [features] * (depth - 1) + [1]
    layers: list[torch.nn.Module] = []
    for k in range(depth):
        layers.append(torch.nn.Conv2d(widths[k], widths[k + 1], 3, padding=1))
        if k < depth - 1:
            layers.append(torch.nn.ReLU(inplace=True))
    return torch.nn.Sequential(*layers).eval()


def per_peer(rates: dict, name: str, size: int, batch: int, peer: str = "bfloat16") -> float:
    """``name``'s images/s at ``size``² and ``batch`` ÷ the ``peer`` arithmetic's peer network's at the
    same size and batch, both from ``rates``; NaN where either was not measured."""
    nan = float("nan")
    return rates.get((name, size, batch), nan) / rates.get((f"peer-{peer}", size, batch), nan)


class Event(NamedTuple):
    """One event of a profile: its name, where it ran (``"CPU"`` for host-side calls, ``"CUDA"`` for
    kernels and copies on the GPU) and its interval in microseconds."""

    name: str
    device: str
    start_us: float
    end_us: float


class Profile(NamedTuple):
    """What a profile of ``solves`` solves says per solve (``summarise``)."""

    launches: float  # host calls matching ``LAUNCH``
    device_ops: float  # events on the device: kernels (a graph's each) and copies
    device_us: float  # microseconds with at least one device event running
    top: list[tuple[str, float, float, float]]  # (name, µs, calls, share of summed device µs)


def events_of(prof: torch.profiler.profile) -> list[Event]:
    """A finished ``torch.profiler`` profile's events: host ops and runtime calls, device kernels and
    copies. Not its annotations (``record_function``, compiled regions): a range on the GPU's timeline
    from its first kernel to its last would count the gaps between them as busy."""
    return [
        Event(e.name, e.device_type.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if not getattr(e, "is_user_annotation", False)  # the attribute is younger than some torch builds
    ]


def covered_us(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of the intervals ``[a, b]``: time during which at least one ran, so
    kernels overlapping on two streams, or a host op and the ops nested inside it, count once."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarise(
    events: Iterable[Event], solves: int, device: str = "CUDA", launch: re.Pattern = LAUNCH, top: int = 8
) -> Profile:
    """Per solve, from the events of ``solves`` solves: the events whose name matches ``launch`` (on a
    GPU these are host calls; no kernel is named after its launch), the events on ``device``, the time
    ``device`` was busy (``covered_us``), and the ``top`` device events by summed time: name, µs and
    calls per solve, and share of all device events' summed µs."""
    events = list(events)
    on_device = [e for e in events if e.device == device]
    totals: dict[str, list[float]] = {}
    for e in on_device:
        cell = totals.setdefault(e.name, [0.0, 0])
        cell[0] += e.end_us - e.start_us
        cell[1] += 1
    summed = sum(t for t, _ in totals.values()) or math.nan
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return Profile(
        launches=sum(bool(launch.search(e.name)) for e in events) / solves,
        device_ops=len(on_device) / solves,
        device_us=covered_us((e.start_us, e.end_us) for e in on_device) / solves,
        top=[(name, t / solves, n / solves, t / summed) for name, (t, n) in ranked],
    )


def default_folder() -> Path:
    """The served version of the default denoiser."""
    return next(f for f in served() if f.parent.name == DEFAULT)


def section_peer(
    args: argparse.Namespace,
    out: list[str],
    rates: dict,
    device: str = "cuda:0",
    sizes: tuple[int, ...] = SIZES,
    batches: tuple[int, ...] = BATCHES,
) -> None:
    """The peer network (``peer_network``) on ``device``, as a deployed DnCNN would run: inference mode,
    float32 in IEEE arithmetic (the models' own) and bfloat16 weights and activations channels-last,
    cuDNN's heuristics as the models get; its images/s go to ``rates`` as ``peer-<arithmetic>``."""
    cuda = device.startswith("cuda")
    gen = torch.Generator().manual_seed(args.seed)
    out += [
        f"\n## The peer on {device}: a DnCNN-sized network (17 3×3 convolutions, 64 features), grey\n",
        "| arithmetic | size | batch | images/s | p50 ms per batch | bfloat16 ÷ float32 |",
        "|---|---|---|---|---|---|",
    ]
    for name, dtype in PEER_DTYPES.items():
        layout = torch.channels_last if dtype != torch.float32 else torch.contiguous_format
        net = peer_network().to(device=device, dtype=dtype, memory_format=layout)
        for size in sizes:
            for batch in batches:
                x = torch.rand(batch, 1, size, size, generator=gen).to(device, dtype, memory_format=layout)
                try:
                    # IEEE holds for the float32 peer; bfloat16 convolutions ignore the float32 flags
                    with torch.inference_mode(), ieee_float32():
                        seconds = timed(lambda n=net, x=x: x - n(x), args.repeat, cuda, args.point_seconds)
                except torch.OutOfMemoryError:
                    out.append(f"| {name} | {size}² | {batch} | out of memory | | |")
                    torch.cuda.empty_cache()
                    continue
                rates[(f"peer-{name}", size, batch)] = batch / seconds
                gain = per_peer(rates, f"peer-{name}", size, batch, "float32")
                out.append(
                    f"| {name} | {size}² | {batch} | {batch / seconds:.1f} | {seconds * 1e3:.2f} | "
                    + (f"{gain:.2f} |" if dtype != torch.float32 else " |")
                )
                print(out[-1], flush=True)
        del net
        if cuda:
            torch.cuda.empty_cache()


def section_models(args: argparse.Namespace, out: list[str], rates: dict) -> None:
    out += [
        "\n## Models on the GPU (grey, σ = 25); ÷ peer: ÷ the bfloat16 peer's images/s, same size, batch\n",
        "| model | size | batch | images/s | ÷ batch 1 | ÷ peer | p50 ms per batch | GPU MiB per MP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for folder in served():
        model = load_predictor(folder, "cuda:0")
        name = f"{folder.parent.name}:{folder.name}"
        for size in SIZES:
            single = None
            for batch in BATCHES:
                a, kw = inputs(model.task, batch, size, args.seed, "cuda:0")
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                try:
                    run = functools.partial(model.predict, *a, **kw)
                    seconds = timed(run, args.repeat, True, args.point_seconds)
                except torch.OutOfMemoryError:
                    out.append(f"| {name} | {size}² | {batch} | out of memory | | | | |")
                    torch.cuda.empty_cache()
                    continue
                peak = (torch.cuda.max_memory_allocated() - held) / 2**20 / (batch * size * size / 1e6)
                rate = batch / seconds
                single = single or rate
                rates[(folder.parent.name, size, batch)] = rate
                peer = per_peer(rates, folder.parent.name, size, batch)
                out.append(
                    f"| {name} | {size}² | {batch} | {rate:.1f} | {rate / single:.2f} | {peer:.2f} | "
                    f"{seconds * 1e3:.1f} | {peak:.0f} |"
                )
                print(out[-1], flush=True)
        torch.cuda.empty_cache()


def section_cpu(args: argparse.Namespace, out: list[str], rates: dict) -> None:
    folder = default_folder()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = load_predictor(folder, "cpu")
        cpu = {}
        for batch in (1, 8):
            a, kw = inputs(model.task, batch, 256, args.seed, "cpu")
            run = functools.partial(model.predict, *a, **kw)
            cpu[batch] = rates[("cpu", 256, batch)] = batch / timed(
                run, args.repeat, False, args.point_seconds
            )
    finally:
        torch.set_num_threads(threads)
    ours = {b: r for (n, s, b), r in rates.items() if n == DEFAULT and s == 256}
    best = max(ours, key=ours.get, default=None)
    gpu1, gpu_best = ours.get(1, float("nan")), ours.get(best, float("nan"))
    out += [
        f"\n## The default denoiser ({folder.parent.name}:{folder.name}), GPU against this machine's CPU "
        "(torch on 2 threads), 256²\n",
        "| | images/s | GPU ÷ CPU at batch 1 | ÷ bfloat16 peer |",
        "|---|---|---|---|",
        f"| CPU, batch 1 | {cpu[1]:.2f} | | |",
        f"| CPU, batch 8 | {cpu[8]:.2f} | | |",
        f"| GPU, batch 1 (p50 {1e3 / gpu1:.1f} ms) | {gpu1:.1f} | {gpu1 / cpu[1]:.0f}× (target ≥ 20×) | "
        f"{per_peer(rates, DEFAULT, 256, 1):.2f} |",
        f"| GPU, best batch ({best}) | {gpu_best:.1f} | {gpu_best / cpu[1]:.0f}× (target ≥ 100×) | "
        f"{per_peer(rates, DEFAULT, 256, best):.2f} |",
    ]


def section_profile(args: argparse.Namespace, out: list[str], rates: dict) -> None:
    """The default denoiser at 256², batch 1 and 32, its solver's steps one at a time and replayed as
    CUDA graphs (``kdeq.maths.graphs``, off by default until measured), each first timed (median wall seconds
    per solve, unprofiled), then ``PROFILED_SOLVES`` solves under ``torch.profiler`` (``summarise``):
    launches and GPU events per solve, and the GPU-busy fraction, the device's busy µs per solve ÷ the
    unprofiled wall µs per solve (the profiler's own host overhead would lower a profiled wall's
    fraction). The targets read the default's (eager) rows."""
    from torch.profiler import ProfilerActivity, profile

    folder = default_folder()
    model = load_predictor(folder, "cuda:0")
    out += [
        f"\n## Where a solve's time goes on cuda:0 ({folder.parent.name}:{folder.name}, 256², "
        f"torch.profiler over {PROFILED_SOLVES} solves)\n",
        "| batch | solver steps | launches per solve | GPU kernels and copies per solve | "
        "GPU busy ms per solve | wall ms per solve | GPU busy |",
        "|---|---|---|---|---|---|---|",
    ]
    tops = []
    # the steps one at a time (the default) and replayed as CUDA graphs (KDEQ_CUDA_GRAPHS=1), side by side
    for replay in (False, True):
        graphs.pin(replay)
        for batch in PROFILE_BATCHES:
            a, kw = inputs(model.task, batch, 256, args.seed, "cuda:0")
            run = functools.partial(model.predict, *a, **kw)
            wall = timed(run, args.repeat, True, args.point_seconds)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(PROFILED_SOLVES):
                    run()
                torch.cuda.synchronize()
            found = summarise(events_of(prof), PROFILED_SOLVES)
            busy = found.device_us / (wall * 1e6)
            if not replay:
                rates[("launches", 256, batch)] = found.launches
                rates[("busy", 256, batch)] = busy
            out.append(
                f"| {batch} | {'replayed' if replay else 'eager'} | {found.launches:.0f} | "
                f"{found.device_ops:.0f} | {found.device_us / 1e3:.2f} | {wall * 1e3:.2f} | {busy:.2f} |"
            )
            print(out[-1], flush=True)
            tops += [(batch, *row) for row in found.top] if not replay else []
    graphs.pin(None)
    out += [
        "\n| batch | GPU kernel or copy | ms per solve | calls per solve | share of GPU time |",
        "|---|---|---|---|---|",
        *(
            f"| {batch} | `{name[:90].replace('|', '/')}` | {us / 1e3:.3f} | {calls:.3g} | {share:.1%} |"
            for batch, name, us, calls, share in tops
        ),
    ]
    del model
    torch.cuda.empty_cache()


def section_targets(args: argparse.Namespace, out: list[str], rates: dict) -> None:
    """Issue 55's figures for the default denoiser at 256², from what the sections before put in
    ``rates``: NaN for a figure whose section did not run."""
    folder = default_folder()
    nan = float("nan")
    ours = {b: r for (n, s, b), r in rates.items() if n == DEFAULT and s == 256}
    best = max(ours, key=ours.get, default=None)
    one, cpu = ours.get(1, nan), rates.get(("cpu", 256, 1), nan)
    top = ours.get(best, nan)
    out += [
        f"\n## Issue 55's targets: {folder.parent.name}:{folder.name}, 256² grey, on cuda:0\n",
        "| figure | this run | target |",
        "|---|---|---|",
        f"| batch 1 | {one:.1f} images/s, p50 {1e3 / one:.1f} ms | |",
        f"| kernel launches per solve, batch 1 | {rates.get(('launches', 256, 1), nan):.0f} | ≤ 60 |",
        f"| best batch ({best}) | {top:.1f} images/s, ÷ bfloat16 peer "
        f"{per_peer(rates, DEFAULT, 256, best):.2f} (÷ float32 peer "
        f"{per_peer(rates, DEFAULT, 256, best, 'float32'):.2f}) | ÷ bfloat16 peer ≥ 1.0 |",
        f"| GPU busy, batch 32 | {rates.get(('busy', 256, 32), nan):.2f} | ≥ 0.8 |",
        f"| GPU ÷ this host's CPU (torch on 2 threads), batch 1 | {one / cpu:.1f}× | ≥ 20× |",
        f"| GPU best batch ÷ CPU batch 1 | {top / cpu:.1f}× | ≥ 100× |",
    ]
    print("\n".join(out[-9:]), flush=True)


def section_service(args: argparse.Namespace, out: list[str], rates: dict) -> None:
    bodies = [multipart(png) for png in images(256, args.seed)[0]]
    results = {}
    for batch in (1, 32):
        port = free_port()
        server = start_server(port, batch, 32, device="cuda:0", model=DEFAULT)
        try:
            drive(port, bodies, 32, 2.0)  # warm the server for this size
            done, elapsed, lat, errors = drive(port, bodies, 32, args.seconds)
        finally:
            server.terminate()
            server.wait(60)
        q = np.quantile(lat, [0.5, 0.99]) if lat else [float("nan")] * 2
        results[batch] = (done / elapsed, q[0], q[1], errors)
    off, on = results[1][0], results[32][0]
    out += [
        f"\n## The service on cuda:0, {DEFAULT}, 32 clients, 256² noisy PNGs, {args.seconds:g} s a point\n",
        "| batching | requests/s | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|",
        *(
            f"| {'off' if b == 1 else f'on (≤ {b})'} | {r:.1f} | {p50 * 1e3:.0f} | {p99 * 1e3:.0f} | {e} |"
            for b, (r, p50, p99, e) in results.items()
        ),
        f"\nbatching on ÷ off: {on / off:.2f}× (target ≥ 5×)",
    ]


def section_backends(args: argparse.Namespace, out: list[str], rates: dict) -> None:
    """Each zero-border convolution backend (``kdeq.runtime.backends``) on ``cuda:0``, against ``padded`` —
    what ``conv_zeros`` uses off the CPU — with cuDNN's heuristics (torch's default) and with
    ``cudnn.benchmark``."""
    out += [
        "\n## Zero-border convolution backends on cuda:0: ms per call, and ÷ `padded` (cuDNN heuristics)\n",
        "| filter bank | input | padded | padded, cudnn.benchmark | prepadded | fft |",
        "|---|---|---|---|---|---|",
    ]
    banks = [(1, 1, 11, 11), (1, 1, 17, 17), (3, 3, 11, 11), (1, 1, 3, 3)]
    gen = torch.Generator().manual_seed(args.seed)
    for shape in banks:
        for batch, size in ((1, 256), (1, 1024), (32, 256), (32, 512)):
            x = torch.rand(batch, shape[1], size, size, generator=gen).cuda()
            bank = torch.rand(shape, generator=gen).cuda()
            repeat = max(args.repeat, 10)
            times = {}
            with torch.no_grad(), ieee_float32():  # the arithmetic every prediction runs in
                for name, fn in backends.BACKENDS.items():
                    times[name] = timed(functools.partial(fn, x, bank), repeat, True)
                torch.backends.cudnn.benchmark = True
                try:
                    tuned = timed(functools.partial(backends.BACKENDS["padded"], x, bank), repeat, True)
                finally:
                    torch.backends.cudnn.benchmark = False
            base = times["padded"]
            cells = [f"{base * 1e3:.3f}"] + [
                f"{t * 1e3:.3f} ({t / base:.2f})" for t in (tuned, times["prepadded"], times["fft"])
            ]
            out.append(f"| {shape} | {tuple(x.shape)} | " + " | ".join(cells) + " |")
            print(out[-1], flush=True)


def section_gathers(args: argparse.Namespace, out: list[str], rates: dict) -> None:
    """The guided kernel's two paths (``kdeq.maths.adaptive``) on the default denoiser, same run: an offset
    at a time against groups by gathers, whatever ``GATHER_PIXELS`` would choose, each timed twice
    alternately (the better median counts), with kernel launches per solve."""
    from torch.profiler import ProfilerActivity, profile

    from kdeq.maths import adaptive

    folder = default_folder()
    model = load_predictor(folder, "cuda:0")
    out += [
        f"\n## The guided kernel on cuda:0 ({folder.parent.name}:{folder.name}): an offset at a time ÷ "
        f"by gathers (taken up to {adaptive.GATHER_PIXELS} pixels)\n",
        "| image | batch | loop ms | gathered ms | loop ÷ gathered | launches, loop → gathered | max diff |",
        "|---|---|---|---|---|---|---|",
    ]
    chooser = adaptive._gathers
    try:
        for size, batch in ((256, 1), (256, 8), (256, 32), (512, 1), (1024, 1), (2048, 1)):
            a, kw = inputs(model.task, batch, size, args.seed, "cuda:0")
            seconds: dict[bool, list[float]] = {False: [], True: []}
            launches, outputs = {}, {}
            for gathered in (False, True, False, True):
                adaptive._gathers = lambda x, g=gathered: g
                run = functools.partial(model.predict, *a, **kw)
                seconds[gathered].append(timed(run, args.repeat, True, args.point_seconds))
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    outputs[gathered] = model.predict(*a, **kw).output
                    torch.cuda.synchronize()
                launches[gathered] = sum(e.count for e in prof.key_averages() if "LaunchKernel" in e.key)
            loop, gathers = min(seconds[False]), min(seconds[True])
            diff = (outputs[False] - outputs[True]).abs().max().item()
            out.append(
                f"| {size}² | {batch} | {loop * 1e3:.1f} | {gathers * 1e3:.1f} | {loop / gathers:.2f} | "
                f"{launches[False]} → {launches[True]} | {diff:.1e} |"
            )
            print(out[-1], flush=True)
    finally:
        adaptive._gathers = chooser
    del model
    torch.cuda.empty_cache()


def section_netprecision(
    args: argparse.Namespace, out: list[str], rates: dict, device: str = "cuda:0"
) -> None:
    """The default denoiser with its guide network in float32 and in bfloat16 (``kdeq.runtime.netprecision``,
    pinned each way), same run: time per batch, and how far bfloat16 moves the output (largest
    difference, PSNR against the clean test image). Off the CPU the choice is float32: these figures
    are what it rests on."""
    from kdeq.runtime import netprecision

    folder = default_folder()
    model = load_predictor(folder, device)
    cuda = device.startswith("cuda")
    out += [
        f"\n## The guide network's precision on {device} ({folder.parent.name}:{folder.name})\n",
        "| image | batch | float32 ms | bfloat16 ms | bfloat16 ÷ float32 | max diff | PSNR f32 / bf16 | "
        "÷ bfloat16 peer, f32 / bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, batch in ((256, 1), (256, 32), (512, 1), (512, 8)):
        a, kw = inputs(model.task, batch, size, args.seed, device)
        clean = test_image(size).to(device)
        seconds, outputs = {}, {}
        for name in ("float32", "bfloat16"):
            with netprecision.choice.force(name):
                run = functools.partial(model.predict, *a, **kw)
                seconds[name] = timed(run, args.repeat, cuda, args.point_seconds)
                outputs[name] = model.predict(*a, **kw).output
        psnr = {
            k: -10 * torch.log10((v.clamp(0, 1) - clean).square().mean()).item() for k, v in outputs.items()
        }
        diff = (outputs["bfloat16"] - outputs["float32"]).abs().max().item()
        f32, b16 = seconds["float32"], seconds["bfloat16"]
        peer = rates.get(("peer-bfloat16", size, batch), float("nan"))
        out.append(
            f"| {size}² | {batch} | {f32 * 1e3:.1f} | {b16 * 1e3:.1f} | {b16 / f32:.2f} | {diff:.1e} | "
            f"{psnr['float32']:.3f} / {psnr['bfloat16']:.3f} | "
            f"{batch / f32 / peer:.2f} / {batch / b16 / peer:.2f} |"
        )
        print(out[-1], flush=True)
    del model
    if cuda:
        torch.cuda.empty_cache()


SECTIONS = {
    f.__name__.removeprefix("section_"): f
    for f in (
        section_peer,
        section_models,
        section_cpu,
        section_profile,
        section_targets,
        section_service,
        section_backends,
        section_gathers,
        section_netprecision,
    )
}


def sections_arg(text: str) -> list[str]:
    """``--sections``' comma-separated names, checked against ``SECTIONS`` and put in their run order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    return [n for n in SECTIONS if n in names]


def times_table(times: dict[str, float]) -> list[str]:
    """Each section's wall seconds beside its ``BUDGET_S``, and their totals."""
    budget = {name: BUDGET_S[name] for name in times}
    return [
        "\n## Section wall times (budgets at the default arguments)\n",
        "| section | seconds | budget |",
        "|---|---|---|",
        *(
            f"| {name} | {t:.1f} | {budget[name]}{' (over)' if t > budget[name] else ''} |"
            for name, t in times.items()
        ),
        f"| all | {sum(times.values()):.1f} | {sum(budget.values())} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seconds", type=float, default=8.0, help="each service point's seconds")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per point, after a warm-up")
    parser.add_argument(
        "--point-seconds", type=float, default=2.0, help="a point stops early once its timed runs took this"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sections", type=sections_arg, default=list(SECTIONS), help=f"some of {','.join(SECTIONS)}"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here", file=sys.stderr)
        sys.exit(2)
    header = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "models": [f"{f.parent.name}:{f.name}" for f in served()],
        "seed": args.seed,
        "command": " ".join(sys.argv),
    }
    out = ["# bench/gpu.py", "", "```json", json.dumps(header, indent=1), "```"]
    rates: dict = {}
    times: dict[str, float] = {}
    for name in args.sections:
        start = time.perf_counter()
        SECTIONS[name](args, out, rates)
        times[name] = time.perf_counter() - start
        print(f"[{name}: {times[name]:.1f} s, budget {BUDGET_S[name]} s]", file=sys.stderr, flush=True)
        if args.out is not None:  # rewritten after each section: a run stopped by a limit keeps these
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(out + times_table(times)) + "\n")
    text = "\n".join(out + times_table(times)) + "\n"
    print(text)


if __name__ == "__main__":
    main()
