"""The GPU benchmark (issue 20), every figure beside the baseline it is read against, in one run:

    python bench/gpu.py [--out results.md] [--seconds 8] [--repeat 5] [--seed 0]

- ``models``: for each served model (the newest version of each name in ``models/``), images/s at
  batch 1, 8, 32 and 64 for 256² and 512² grey images (σ = 25 noise, seeded; half the pixels missing
  for the inpainter, a Gaussian PSF of width 1.6 for the deblurrer, scale 2 for the super-resolver),
  p50 milliseconds at batch 1, and peak GPU memory per megapixel above what the loaded model holds.
- ``cpu``: the default denoiser on this machine's CPU with torch on 2 threads, batch 1 and 8 at 256²,
  and the GPU ÷ CPU throughput ratios (targets: ≥ 20× at batch 1, ≥ 100× batched).
- ``service``: a real ``python -m service`` on ``cuda:0`` serving the default denoiser, 32 clients
  posting 256² PNGs for ``--seconds``, with batching off (``KDEQ_MAX_BATCH_SIZE=1``) and on
  (``KDEQ_MAX_BATCH_SIZE=32``), and the ratio (target ≥ 5×).
- ``backends``: the zero-border convolution backends of ``kdeq.backends`` on the GPU, each ÷ ``padded``
  (what the GPU uses), with cuDNN's heuristics and with ``cudnn.benchmark``.
- ``gathers``: the guided kernel's weights and ``K x`` an offset at a time against by gathers
  (``kdeq.adaptive.GATHER_PIXELS`` chooses between them), same run, for the default denoiser.
- ``netprecision``: the default denoiser with its guide network in float32 and in bfloat16
  (``kdeq.netprecision``), time and the output's largest difference and PSNR, same run.

Times are medians of ``--repeat`` runs after a warm-up, each ended by ``torch.cuda.synchronize``.
Writes the Markdown tables to stdout and to ``--out``. Exits 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from load import drive, free_port, images, multipart, start_server  # noqa: E402

from kdeq import backends  # noqa: E402
from kdeq.cli import test_image  # noqa: E402
from kdeq.precision import ieee_float32  # noqa: E402
from kdeq.repository import default_models_dir, load_predictor  # noqa: E402
from tests.helpers import predict_arguments  # noqa: E402

SIGMA = 25.0
BATCHES = (1, 8, 32, 64)
SIZES = (256, 512)
DEFAULT = "denoise-kglm"


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


def timed(run: Callable[[], object], repeat: int, cuda: bool) -> float:
    """Median seconds of ``run`` over ``repeat`` calls after one warm-up."""
    times = []
    for k in range(repeat + 1):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        if k:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def section_models(args: argparse.Namespace, out: list[str], rates: dict) -> None:
    out += [
        "\n## Models on the GPU (grey, σ = 25)\n",
        "| model | size | batch | images/s | ÷ batch 1 | p50 ms per batch | GPU MiB per MP |",
        "|---|---|---|---|---|---|---|",
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
                    seconds = timed(functools.partial(model.predict, *a, **kw), args.repeat, True)
                except torch.OutOfMemoryError:
                    out.append(f"| {name} | {size}² | {batch} | out of memory | | | |")
                    torch.cuda.empty_cache()
                    continue
                peak = (torch.cuda.max_memory_allocated() - held) / 2**20 / (batch * size * size / 1e6)
                rate = batch / seconds
                single = single or rate
                rates[(folder.parent.name, size, batch)] = rate
                out.append(
                    f"| {name} | {size}² | {batch} | {rate:.1f} | {rate / single:.2f} | "
                    f"{seconds * 1e3:.1f} | {peak:.0f} |"
                )
                print(out[-1], flush=True)
        torch.cuda.empty_cache()


def section_cpu(args: argparse.Namespace, out: list[str], rates: dict) -> None:
    folder = next(f for f in served() if f.parent.name == DEFAULT)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = load_predictor(folder, "cpu")
        cpu = {}
        for batch in (1, 8):
            a, kw = inputs(model.task, batch, 256, args.seed, "cpu")
            cpu[batch] = batch / timed(functools.partial(model.predict, *a, **kw), args.repeat, False)
    finally:
        torch.set_num_threads(threads)
    gpu1 = rates.get((DEFAULT, 256, 1), float("nan"))
    gpu_best = max((r for (n, s, _), r in rates.items() if n == DEFAULT and s == 256), default=float("nan"))
    out += [
        f"\n## The default denoiser ({folder.parent.name}:{folder.name}), GPU against this machine's CPU "
        "(torch on 2 threads), 256²\n",
        "| | images/s | GPU ÷ CPU at batch 1 |",
        "|---|---|---|",
        f"| CPU, batch 1 | {cpu[1]:.2f} | |",
        f"| CPU, batch 8 | {cpu[8]:.2f} | |",
        f"| GPU, batch 1 | {gpu1:.1f} | {gpu1 / cpu[1]:.0f}× (target ≥ 20×) |",
        f"| GPU, best batch | {gpu_best:.1f} | {gpu_best / cpu[1]:.0f}× (target ≥ 100×) |",
    ]


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
    """Each zero-border convolution backend (``kdeq.backends``) on ``cuda:0``, against ``padded`` —
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
    """The guided kernel's two paths (``kdeq.adaptive``) on the default denoiser, same run: an offset
    at a time against groups by gathers, whatever ``GATHER_PIXELS`` would choose, each timed twice
    alternately (the better median counts), with kernel launches per solve."""
    from torch.profiler import ProfilerActivity, profile

    from kdeq import adaptive

    folder = next(f for f in served() if f.parent.name == DEFAULT)
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
                seconds[gathered].append(timed(functools.partial(model.predict, *a, **kw), args.repeat, True))
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
    """The default denoiser with its guide network in float32 and in bfloat16 (``kdeq.netprecision``,
    pinned each way), same run: time per batch, and how far bfloat16 moves the output (largest
    difference, PSNR against the clean test image). Off the CPU the choice is float32: these figures
    are what it rests on."""
    from kdeq import netprecision

    folder = next(f for f in served() if f.parent.name == DEFAULT)
    model = load_predictor(folder, device)
    cuda = device.startswith("cuda")
    out += [
        f"\n## The guide network's precision on {device} ({folder.parent.name}:{folder.name})\n",
        "| image | batch | float32 ms | bfloat16 ms | bfloat16 ÷ float32 | max diff | PSNR f32 / bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, batch in ((256, 1), (256, 32), (512, 1), (512, 8)):
        a, kw = inputs(model.task, batch, size, args.seed, device)
        clean = test_image(size).to(device)
        seconds, outputs = {}, {}
        for name in ("float32", "bfloat16"):
            with netprecision.choice.force(name):
                seconds[name] = timed(functools.partial(model.predict, *a, **kw), args.repeat, cuda)
                outputs[name] = model.predict(*a, **kw).output
        psnr = {
            k: -10 * torch.log10((v.clamp(0, 1) - clean).square().mean()).item() for k, v in outputs.items()
        }
        diff = (outputs["bfloat16"] - outputs["float32"]).abs().max().item()
        f32, b16 = seconds["float32"], seconds["bfloat16"]
        out.append(
            f"| {size}² | {batch} | {f32 * 1e3:.1f} | {b16 * 1e3:.1f} | {b16 / f32:.2f} | {diff:.1e} | "
            f"{psnr['float32']:.3f} / {psnr['bfloat16']:.3f} |"
        )
        print(out[-1], flush=True)
    del model
    if cuda:
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
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
    sections = (
        section_models,
        section_cpu,
        section_service,
        section_backends,
        section_gathers,
        section_netprecision,
    )
    for section in sections:
        section(args, out, rates)
    text = "\n".join(out) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
