"""Speed of the solve paths, side by side: models against classical denoisers, the linear path against
its transform floor, the guided kernel's memory and the segmenter's warm start.

    .venv-bench/bin/python bench/speed.py [--seed 0] [--images 3] [--no-bm3d] [--sections ...]

Sections (all by default; each prints a Markdown table):

- ``models``: seconds per image and PSNR at 256² and 512², grey (Set12 01–07 are 256², 08–12
  512²) and colour (top-left crops of Kodak24), σ = 25 noise seeded per image, σ given to every
  method; kdeq's default denoiser also with σ estimated, and each ``--compare`` model, with the guide
  networks in each ``--network-precision`` (default ``float32``, then ``auto``: the measured choice,
  ``kdeq.runtime.netprecision``) and the guided kernel's loops by each ``--guided-backend`` (default
  ``auto``: compiled where a C compiler builds them, ``kdeq.runtime.native``). Baselines from
  ``bench/baselines.py`` (scikit-image and OpenCV non-local means, PyPI ``bm3d``), run in this
  process on the same inputs.
- ``linear``: the linear Gaussian model's solve (``kdeq.maths.linear``) ÷ one forward + inverse
  transform of the same size, for the DCT path (symmetric border), preconditioned CG (zero
  border) and the generic CG on the fixed-point map that both replace.
- ``memory``: peak resident memory of the solve per megapixel of the default (guided) denoiser, each
  size in a fresh process (Linux: the peak is reset just before the solve), with the default weight
  budget and a 128 MiB one.
- ``warmstart``: the segmenter (Bernoulli, Anderson) from ``σ(0)`` against a start from its
  linearised equilibrium, on generated shapes with additive noise.
- ``backends``: each zero-border convolution backend (``kdeq.runtime.backends``) on the filter shapes of the
  shipped conv models at 256² and 512², one image and eight, and the models' solves with the
  backend pinned to ``padded`` (torch's own) against the measured choice, on one Set12-like
  generated image with σ = 25 noise (segment: its binarised shapes).
- ``loops``: the guided kernel's steps (its weight maps, ``K x`` and both non-local means) by
  torch's operations and compiled (``kdeq.runtime.native``), on a generated grey and colour guide of 256² and
  512² with σ = 25 noise, with the default denoiser's kernel, on one thread and on torch's default
  threads: time and the largest relative difference of the two.
- ``cli``: ``kdeq denoise`` on ``--cli-images`` generated 256² noisy images (σ = 25, given) in one
  call, its wall time ÷ (the count × the default denoiser's in-process solve of the same images,
  measured in this process first), beside one process per image for the first four and a process
  that only imports torch; kdeq's bytecode compiled first, as an installed package has it.

- ``tiling``: the default denoiser (σ = 25 noise), inpainter (half the pixels and a 64² block per
  256² missing), segmenter (the Otsu mask, 5 % flipped, σ = 50 noise), impulse denoiser (σ = 25
  noise and 10 % salt and pepper), photon denoiser (Poisson counts, 30 for white) and
  super-resolver (×2; ``--tiling-tasks`` picks among them) on Kodak24 photo mosaics
  from 1.6 to 25 megapixels: tiled (``kdeq.serving.tiling``) against untiled in process (time, PSNR or IoU,
  largest difference) where both fit, then ``kdeq TASK`` on each mosaic's PNG in a fresh process: its
  peak resident memory and time.

- ``png``: the default denoiser's outputs on the ``models`` images written as PNG by Pillow at
  zlib level 1 (the service's and CLI's writer before ``kdeq.images.png``) and by ``kdeq.images.png``, same
  run: time and size.

GPU figures come from ``bench/gpu.sh`` (``bench/gpu.py``), which runs the CUDA suite first.

Times are the best of ``--repeat`` runs after a warm-up, with torch's default threads, and the C heap
as the ``kdeq`` command and the service configure it (``kdeq.runtime.heap``; ``KDEQ_MALLOC=system`` leaves
glibc's own thresholds). Needs
``../shared/data`` for the ``models`` section and the benchmark environment (scikit-image,
opencv-python-headless, bm3d); they are benchmark references only, never dependencies of kdeq.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kdeq.maths.deq import KGLMDEQ  # noqa: E402
from kdeq.maths.families import Gaussian  # noqa: E402
from kdeq.maths.implicit import equilibrium  # noqa: E402
from kdeq.maths.kglm import conv_deq  # noqa: E402
from kdeq.maths.linear import solve_affine  # noqa: E402
from kdeq.maths.priors import GaussianPrior  # noqa: E402
from kdeq.maths.transforms import dct2, idct2  # noqa: E402
from kdeq.models.checkpoint import load_checkpoint  # noqa: E402
from kdeq.models.repository import default_models_dir, find_model, find_reference, load_predictor  # noqa: E402
from kdeq.runtime import heap, native, netprecision  # noqa: E402

SIGMA = 25.0
#: the photon counts of white in the tiling section
PEAK = 30.0


def best_time(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def test_sets(images: int) -> dict[str, list[np.ndarray]]:
    import baselines as B

    set12 = [img for _, img in B.load_set("Set12")]
    kodak = [img for _, img in B.load_set("Kodak24", limit=images)]
    return {
        "grey 256²": [im for im in set12 if im.shape == (256, 256)][:images],
        "grey 512²": [im for im in set12 if im.shape == (512, 512)][:images],
        "colour 256²": [im[:256, :256] for im in kodak],
        "colour 512²": [im[:512, :512] for im in kodak],
    }


def denoised(
    predictor, noisy: np.ndarray, known: bool = True, precision: str = "auto", guided: str = "auto"
) -> np.ndarray:
    """``predictor``'s output for a ``test_sets`` image with noise, ``(H, W)`` or ``(H, W, c)`` in
    [0, 1] like it; σ given where ``known``, the guide network in ``precision``, the guided kernel's
    loops by ``guided`` (``kdeq.runtime.native``)."""
    x = torch.from_numpy(noisy.astype(np.float32))
    x = x[None, None] if x.dim() == 2 else x.permute(2, 0, 1)[None]
    with netprecision.choice.force(precision), native.choice.force(guided):
        out = predictor.predict(x, sigma=SIGMA if known else None).output[0]
    return (out[0] if out.shape[0] == 1 else out.permute(1, 2, 0)).numpy()


def section_models(args: argparse.Namespace) -> None:
    import baselines as B

    models = default_models_dir()
    default = load_predictor(find_model(models, "denoise-kglm"), "cpu")
    stationary = load_predictor(find_model(models, "denoise-stationary-kglm"), "cpu")

    def kdeq_method(predictor, known: bool, precision: str = "auto", guided: str = "auto"):
        return lambda noisy: denoised(predictor, noisy, known, precision, guided)

    others = [load_predictor(find_reference(models, ref), "cpu") for ref in args.compare]
    methods: list[tuple[str, Callable[[np.ndarray], np.ndarray]]] = []
    for g in args.guided_backend:
        for p in args.network_precision:
            how = f"network {p}" + ("" if args.guided_backend == ["auto"] else f", loops {g}")
            methods += [
                (f"kdeq {default.name} (σ given, {how})", kdeq_method(default, True, p, g)),
                (f"kdeq {default.name} (σ estimated, {how})", kdeq_method(default, False, p, g)),
                *[(f"kdeq {o.name} (σ given, {how})", kdeq_method(o, True, p, g)) for o in others],
            ]
    methods += [
        (f"kdeq {stationary.name} (σ given)", kdeq_method(stationary, True)),
        ("scikit-image non-local means", lambda n: B.nlm_skimage(n, SIGMA)),
        ("OpenCV non-local means", lambda n: B.nlm_opencv(n, SIGMA)),
    ]
    if not args.no_bm3d:
        methods.append(("BM3D (PyPI bm3d)", lambda n: B.bm3d_denoise(n, SIGMA)))
    print("\n### Seconds per image and PSNR (σ = 25)\n")
    print("| images | method | s/img | PSNR (dB) | ÷ scikit-image NLM time | ÷ BM3D time |")
    print("|---|---|---|---|---|---|")
    for label, clean_set in test_sets(args.images).items():
        noisy = [B.add_noise(im, SIGMA, args.seed + k) for k, im in enumerate(clean_set)]
        rows = []
        for name, method in methods:
            method(noisy[0])  # warm-up
            seconds, quality = 0.0, []
            for clean, n in zip(clean_set, noisy, strict=True):
                start = time.perf_counter()
                out = method(n)
                seconds += time.perf_counter() - start
                quality.append(B.psnr(out, clean))
            rows.append((name, seconds / len(noisy), float(np.mean(quality))))
        nlm = next(t for n, t, _ in rows if n.startswith("scikit"))
        bm3d = next((t for n, t, _ in rows if n.startswith("BM3D")), None)
        for name, sec, q in rows:
            vs_bm3d = f"{sec / bm3d:.3f}" if bm3d else "–"
            print(f"| {label} ({len(noisy)}) | {name} | {sec:.3f} | {q:.2f} | {sec / nlm:.2f} | {vs_bm3d} |")
    choices = ", ".join(sorted(set(netprecision.choice.chosen().values()))) or "-"
    print(f"\nThe guide networks' measured precision (`auto`, kdeq.runtime.netprecision): {choices}")


def section_linear(args: argparse.Namespace) -> None:
    ckpt = load_checkpoint(find_model(default_models_dir(), "denoise-stationary-kglm", 1))
    taps = ckpt.tensors["w1"][0, 0]
    lam = ckpt.config.lam(torch.tensor([SIGMA / 255.0])).item()
    cfg = ckpt.config.solver
    gen = torch.Generator().manual_seed(args.seed)
    print(
        f"\n### Linear path ÷ transform floor (denoise-stationary-kglm:1 kernel, λ = {lam:.4f}, "
        f"tol {cfg.tol:g})\n"
    )
    print(
        "| size | one dct2 + idct2 (ms) | one rfft2 + irfft2 (ms) | path | solve (ms) | ÷ DCT floor "
        "| ÷ FFT floor | iterations |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for size in (256, 512, 1024):
        y = torch.rand(1, 1, size, size, generator=gen)
        floor_dct, floor_fft, rows = _linear_rows(y, taps, lam, cfg, args.repeat)
        for label, seconds, iters in rows:
            print(
                f"| {size}² | {floor_dct * 1e3:.2f} | {floor_fft * 1e3:.2f} | {label} | "
                f"{seconds * 1e3:.2f} | {seconds / floor_dct:.2f} | {seconds / floor_fft:.2f} | {iters} |"
            )


def _linear_rows(
    y: torch.Tensor, taps: torch.Tensor, lam: float, cfg, repeat: int
) -> tuple[float, float, list[tuple[str, float, int]]]:
    mean = y.mean(dim=(2, 3), keepdim=True).expand_as(y)
    z0 = mean.clone()
    rows = []
    with torch.inference_mode():
        floor_dct = best_time(lambda: idct2(dct2(y)), repeat)
        floor_fft = best_time(lambda: torch.fft.irfft2(torch.fft.rfft2(y), s=y.shape[-2:]), repeat)
        for label, padding in (("DCT, symmetric border", "symmetric"), ("PCG, zero border", "zeros")):
            layer = conv_deq(Gaussian(), GaussianPrior(), taps[None, None], lam, padding)

            def fast(layer: KGLMDEQ = layer):
                return solve_affine(layer.w1, layer.w2, y, mean, None, z0, cfg)

            rows.append((label, best_time(fast, repeat), fast()[1].iterations.item()))
        generic = conv_deq(Gaussian(), GaussianPrior(), taps[None, None], lam, "zeros")

        def cell_cg():
            return equilibrium(lambda v: generic.cell(v, y, mean), z0, cfg)

        rows.append(
            (
                "generic CG on f, zero border",
                best_time(cell_cg, repeat),
                cell_cg()[1].iterations.item(),
            )
        )
    return floor_dct, floor_fft, rows


MEMORY_PROBE = """
import sys, time, torch
from pathlib import Path
from kdeq.models.repository import default_models_dir, find_model, load_predictor

def status(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))
    return int(line.split()[1]) * 1024

size, budget = int(sys.argv[1]), int(sys.argv[2])
model = load_predictor(find_model(default_models_dir(), "denoise-kglm", 1), "cpu")
model.weight_budget = budget
x = torch.rand(1, 1, size, size, generator=torch.Generator().manual_seed(0))
Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current resident size
base = status("VmRSS:")
start = time.perf_counter()
model.predict(x, sigma=25.0)
seconds = time.perf_counter() - start
print(base, status("VmHWM:"), seconds)
"""


def section_memory(args: argparse.Namespace) -> None:
    print("\n### Guided denoiser: peak memory of the solve, per megapixel (fresh process per row)\n")
    print("| size | weight budget | weights kept? | solve peak − resident before (MiB) | MiB per MP | s |")
    print("|---|---|---|---|---|---|")
    for size in (512, 1024, 2048):
        for budget in (1 << 30, 128 << 20):
            out = subprocess.run(
                [sys.executable, "-c", MEMORY_PROBE, str(size), str(budget)],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            ).stdout.split()
            base, peak, seconds = int(out[0]), int(out[1]), float(out[2])
            kept = 113 * size * size * 4 <= budget
            mib = (peak - base) / 2**20
            print(
                f"| {size}² | {budget >> 20} MiB | {'yes' if kept else 'no, recomputed'} | {mib:.0f} | "
                f"{mib / (size * size / 1e6):.0f} | {seconds:.2f} |"
            )


def section_warmstart(args: argparse.Namespace) -> None:
    from kdeq.cli import test_image

    model = load_predictor(find_model(default_models_dir(), "segment-kglm"), "cpu")
    gen = torch.Generator().manual_seed(args.seed)
    print("\n### Segmenter: Anderson from σ(0) against a start from the linearised equilibrium\n")
    print("| size | noise σ | cold ms | cold iterations | warm ms | warm iterations | warm ÷ cold | max Δp |")
    print("|---|---|---|---|---|---|---|---|")
    for size in (256, 512):
        clean = (test_image(size) > 0.5).float()
        for noise in (0.5, 1.0):
            x = clean + noise * torch.randn(clean.shape, generator=gen)
            runs = {}
            for warm in (False, True):
                model.warm_start = warm
                runs[warm] = (best_time(lambda x=x: model.predict(x), args.repeat), model.predict(x))
            (cold_s, cold), (warm_s, warm) = runs[False], runs[True]
            diff = (cold.output - warm.output).abs().max().item()
            print(
                f"| {size}² | {noise:g} | {cold_s * 1e3:.1f} | {cold.stats.iterations.item()} | "
                f"{warm_s * 1e3:.1f} | {warm.stats.iterations.item()} | {warm_s / cold_s:.2f} | {diff:.1e} |"
            )


def section_cli(args: argparse.Namespace) -> None:
    import tempfile

    from kdeq.cli import test_image
    from kdeq.images.imageio import read_image, write_png

    model = load_predictor(find_model(default_models_dir(), "denoise-kglm"), "cpu")
    count = args.cli_images
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "in"
        folder.mkdir()
        clean = test_image(256)[0]
        paths = []
        for k in range(count):
            noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(args.seed + k))
            paths.append(folder / f"img{k:03d}.png")
            write_png(paths[-1], (clean.roll(7 * k, dims=-1) + SIGMA / 255 * noise).clamp(0, 1))
        images = [read_image(p) for p in paths]  # as the CLI reads them: 8-bit, clipped
        model.predict(images[0], sigma=SIGMA)  # warm-up
        start = time.perf_counter()
        for image in images:
            model.predict(image, sigma=SIGMA)
        solve = (time.perf_counter() - start) / count
        # kdeq's bytecode as an installed package has it (pip compiles it at install; the image too):
        # without it, where PYTHONDONTWRITEBYTECODE is set, every process compiles kdeq's sources
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "kdeq")], check=True)
        command = [sys.executable, "-m", "kdeq", "denoise", "--sigma", str(SIGMA)]
        start = time.perf_counter()
        subprocess.run(
            [*command, *map(str, paths), "-o", str(Path(tmp) / "out")], check=True, capture_output=True
        )
        batch = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(4):
            subprocess.run([sys.executable, "-c", "import torch"], check=True)
        floor = (time.perf_counter() - start) / 4
        start = time.perf_counter()
        for k, path in enumerate(paths[:4]):
            subprocess.run(
                [*command, str(path), "-o", str(Path(tmp) / f"one{k}.png")], check=True, capture_output=True
            )
        single = (time.perf_counter() - start) / 4
    print(f"\n### The CLI: {count} images of 256², σ = 25 given, {model.name}\n")
    print("| run | s per image | ÷ the in-process solve |")
    print("|---|---|---|")
    print(f"| in process, `predict` per image | {solve:.3f} | 1.00 |")
    print(
        f"| `kdeq denoise` on all {count} in one call | {batch / count:.3f} | {batch / (count * solve):.2f} |"
    )
    print(f"| `kdeq denoise` once per image (first 4) | {single:.3f} | {single / solve:.2f} |")
    print(
        f"\nA process that only imports torch takes {floor:.2f} s here: {floor / (count * solve):.2f} of "
        f"the {count}-image ratio."
    )


def section_backends(args: argparse.Namespace) -> None:
    from kdeq.cli import test_image
    from kdeq.runtime import backends

    print("\n### Zero-border convolution backends: ms per call (median of 3 after a warm-up)\n")
    print("`fft` is timed only where `kdeq.runtime.backends.candidates` would time it.\n")
    print("| filter bank | input | padded | prepadded | fft | measured choice |")
    print("|---|---|---|---|---|---|")
    banks = [(1, 1, 11, 11), (1, 1, 9, 9), (1, 1, 17, 17), (3, 3, 11, 11), (1, 1, 3, 3)]
    for bank_shape in banks:
        for batch, size in ((1, 256), (1, 512), (8, 256)):
            x = torch.rand(batch, bank_shape[1], size, size)
            bank = torch.rand(bank_shape)
            times = backends.measure(x, bank)
            cells = " | ".join(
                f"{times[n] * 1e3:.2f}" if n in times else "not timed" for n in backends.BACKENDS
            )
            print(f"| {bank_shape} | {tuple(x.shape)} | {cells} | {backends.choose(times)} |")
    models = default_models_dir()
    print("\n### Models with zero-border kernels: ms per solve, backend pinned to `padded` ÷ measured\n")
    print("| model | image | `padded` | measured | ratio | max abs difference |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(args.seed)
    for name, version in (
        ("denoise-stationary-kglm", 1),
        ("denoise-stationary-kglm", 2),
        ("inpaint-kglm", 2),
        ("inpaint-kglm", 3),
        ("segment-kglm", 2),
    ):
        model = load_predictor(find_model(models, name, version), "cpu")
        for size in (256, 512):
            clean = test_image(size)
            if name.startswith("segment"):
                x = (clean > 0.5).float() + 0.5 * torch.randn(clean.shape, generator=gen)

                def solve(x=x, model=model):
                    return model.predict(x).output

            elif name.startswith("inpaint"):
                mask = (torch.rand(clean.shape, generator=gen) < 0.5).float()

                def solve(clean=clean, mask=mask, model=model):
                    return model.predict(clean, mask).output

            else:
                x = clean + SIGMA / 255 * torch.randn(clean.shape, generator=gen)

                def solve(x=x, model=model):
                    return model.predict(x, sigma=SIGMA).output

            with backends.force_backend("padded"):
                pinned = best_time(solve, args.repeat)
                reference = solve()
            measured = best_time(solve, args.repeat)
            diff = (solve() - reference).abs().max().item()
            print(
                f"| {model.name} | {size}² | {pinned * 1e3:.1f} | {measured * 1e3:.1f} | "
                f"{pinned / measured:.1f} | {diff:.1e} |"
            )


def _loop_steps(
    guide: torch.Tensor, spatial: torch.Tensor, p: int, h2: torch.Tensor, x: torch.Tensor, repeat: int
) -> dict[str, tuple[float, torch.Tensor]]:
    """The guided kernel's steps on ``guide``: best seconds of ``repeat`` and the output. The weight maps
    first, written again into the buffer a solve keeps (``adaptive.KEPT_BYTES``) as a solve does; then
    ``K x`` and both non-local means on a copy, with the operator's own maps."""
    from kdeq.maths.adaptive import GuidedOperator, apply_weights, guided_weights

    seconds = best_time(lambda: guided_weights(guide, spatial, p, h2), repeat)
    weights = guided_weights(guide, spatial, p, h2).clone()
    steps = {"weight maps": (seconds, weights)}
    op = GuidedOperator(guide, spatial, p, h2, True)
    for name, call in (
        ("K x", lambda: apply_weights(weights, x)),
        ("ν pixel-wise", lambda: op.nonlocal_mean(guide, 3)[0]),
        ("ν by patch", lambda: op.nonlocal_mean(guide, 3, patches=True)[0]),
    ):
        steps[name] = (best_time(call, repeat), call())
    return steps


def section_loops(args: argparse.Namespace) -> None:
    from kdeq.cli import test_image

    default = load_predictor(find_model(default_models_dir(), "denoise-kglm"), "cpu")
    kern = default.config.architecture.kernel
    spatial, p = kern.spatial.filter(), kern.patch_radius
    print(
        f"\n### The guided kernel's loops: ms per call, torch's ÷ compiled (`kdeq.runtime.native`), the "
        f"default denoiser's kernel (R = {kern.spatial.radius}, p = {p}), κ = 3, best of {args.repeat}\n"
    )
    print("| guide | threads | step | torch's loops | compiled | ratio | max relative difference |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(args.seed)
    threads = torch.get_num_threads()
    for channels, size in ((1, 256), (3, 256), (1, 512), (3, 512)):
        clean = test_image(size).expand(1, channels, size, size)
        guide = clean + SIGMA / 255 * torch.randn(clean.shape, generator=gen)
        h2 = kern.h2(channels, torch.tensor([SIGMA / 255]))
        x = torch.randn(1, 2, size, size, generator=gen)
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            rows: dict[str, dict[str, tuple[float, torch.Tensor]]] = {}
            for backend in ("loop", "native"):
                with native.choice.force(backend), torch.inference_mode():
                    for name, result in _loop_steps(guide, spatial, p, h2, x, args.repeat).items():
                        rows.setdefault(name, {})[backend] = result
            for name, result in rows.items():
                (t_loop, a), (t_native, b) = result["loop"], result["native"]
                rel = ((a - b).abs().max() / a.abs().max()).item()
                label = f"{'grey' if channels == 1 else 'colour'} {size}²"
                print(
                    f"| {label} | {n} | {name} | {t_loop * 1e3:.2f} | {t_native * 1e3:.2f} | "
                    f"{t_loop / t_native:.2f} | {rel:.1e} |"
                )
    torch.set_num_threads(threads)


def mosaic(rows: int, cols: int) -> torch.Tensor:
    """A ``(3, 512·rows, 768·cols)`` colour photo mosaic of Kodak24 (portrait images turned), in order."""
    import baselines as B

    from kdeq.images.imageio import read_image

    kodak = sorted((B.DATA / "Kodak24").glob("*.png"))
    parts = [read_image(p)[0] for p in kodak]
    parts = [im if im.shape[-1] == 768 else im.transpose(-1, -2) for im in parts]
    grid = [torch.cat([parts[(cols * r + c) % len(parts)] for c in range(cols)], -1) for r in range(rows)]
    return torch.cat(grid, -2)


# the peak is VmHWM, the process's own high-water mark (getrusage's maxrss is inherited from the
# parent across fork and exec, so it would report this benchmark's peak)
TILING_PROBE = """
import sys, time
from kdeq.cli import main
start = time.perf_counter()
code = main(sys.argv[1:])
seconds = time.perf_counter() - start
peak = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(code, peak, seconds)
"""


def holes(shape: tuple[int, int], gen: torch.Generator) -> np.ndarray:
    """An inpainting mask ``(1, H, W)`` (True = missing): half the pixels at random and one 64×64 block
    in every 256×256 cell."""
    miss = torch.rand(1, *shape, generator=gen) < 0.5
    miss.unflatten(1, (-1, 256))[:, :, 96:160].unflatten(-1, (-1, 256))[..., 96:160] = True
    return miss.numpy()


#: a benchmark input: the request's image and files, the images ``kdeq TASK`` reads (by option name),
#: and the batch that the training's score reads (``Training.score``: the target, the mask)
Corrupted = tuple[np.ndarray, dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]


def section_tiling(args: argparse.Namespace) -> None:
    """The default denoiser's tiles (σ = 25 noise, given), the default inpainter's (``holes``), the
    default segmenter's (the mosaic's Otsu mask, 5 % of it flipped, σ = 50 noise), the default
    impulse denoiser's (σ = 25 noise and 10 % salt and pepper, σ estimated), the default photon
    denoiser's (Poisson counts, ``PEAK`` for white, given) and the default super-resolver's (×2 from
    the mosaic's bicubic reduction): ``--tiling-tasks``."""
    from kdeq.registry import TASKS
    from kdeq.train.data import binary_target
    from kdeq.train.trainings import TRAININGS

    gen = torch.Generator().manual_seed(args.seed)

    def noise(clean: torch.Tensor) -> Corrupted:
        noisy = (clean + SIGMA / 255 * torch.randn(clean.shape, generator=gen)).clamp(0, 1)
        return noisy.numpy(), {}, {"image": noisy}, {"target": clean[None]}

    def mask(clean: torch.Tensor) -> Corrupted:
        miss = holes(tuple(clean.shape[-2:]), gen)
        pictures = {"image": clean, "mask": torch.from_numpy(miss).float()}
        return (
            clean.numpy(),
            {"mask": miss},
            pictures,
            {"target": clean[None], "missing": torch.from_numpy(miss)[None]},
        )

    def scan(clean: torch.Tensor) -> Corrupted:
        target = binary_target(clean)
        flipped = torch.where(torch.rand(target.shape, generator=gen) < 0.05, 1 - target, target)
        noisy = (flipped + 50 / 255 * torch.randn(target.shape, generator=gen)).clamp(0, 1)
        return noisy.numpy(), {}, {"image": noisy}, {"target": target[None]}

    def salt(clean: torch.Tensor) -> Corrupted:
        noisy = (clean + SIGMA / 255 * torch.randn(clean.shape, generator=gen)).clamp(0, 1)
        hit = torch.rand(clean.shape[-2:], generator=gen) < 0.1
        noisy[:, hit] = torch.randint(0, 2, (int(hit.sum()),), generator=gen, dtype=noisy.dtype)
        return noisy.numpy(), {}, {"image": noisy}, {"target": clean[None]}

    def photons(clean: torch.Tensor) -> Corrupted:
        counts = torch.poisson(PEAK * clean, generator=gen)
        # the PNG holds the counts as its values (8 bits: the peak keeps them under 256)
        return counts.numpy(), {}, {"image": counts / 255.0}, {"target": clean[None]}

    def small(clean: torch.Tensor) -> Corrupted:
        from kdeq.predictors.super_resolve import degrade

        low = degrade(clean[None], 2)[0].clamp(0, 1)
        return low.numpy(), {}, {"image": low}, {"target": clean[None], "scale": torch.tensor([2])}

    rows = {
        "denoise": (noise, "σ = 25 noise (given)", {"sigma": SIGMA}, ["--sigma", "25"]),
        "inpaint": (mask, "half the pixels and a 64² block per 256² missing", {}, []),
        "segment": (
            scan,
            "their Otsu masks, 5 % flipped, σ = 50 noise",
            {"output": "probability"},
            ["--output", "probability"],
        ),
        "denoise-impulse": (salt, "σ = 25 noise and 10 % salt and pepper (σ estimated)", {}, []),
        "denoise-poisson": (
            photons,
            f"Poisson counts at {PEAK:g} photons for white (peak given)",
            {"peak": PEAK},
            ["--peak", f"{PEAK:g}"],
        ),
        "super-resolve": (small, "×2 from their bicubic reduction (sizes are the outputs')", {}, []),
    }
    for name in args.tiling_tasks:
        # a task without a training (denoise-impulse) is scored as the denoiser: PSNR against the clean image
        _tiling_rows(TASKS[name], TRAININGS.get(name, TRAININGS["denoise"]), *rows[name])


def _tiling_rows(task, training, corrupt, what: str, options: dict, cli: list[str]) -> None:
    """``task``'s default model with ``options`` (``cli`` on the command line) on Kodak24 mosaics
    corrupted by ``corrupt(clean)`` (``Corrupted``): tiled against untiled in process, each scored
    by ``training.score``, then through ``kdeq TASK`` in a fresh process per row (peak memory and time)."""
    import tempfile

    from kdeq.images.imageio import write_png
    from kdeq.serving.tiling import TILE_SIZE, solve_tiled
    from kdeq.tasks.base import solve_batch

    model = load_predictor(find_model(default_models_dir(), f"{task.name}-kglm"), "cpu")
    halo = task.tile_halo(model)
    print(f"\n### Tiles: {model.name}, Kodak24 mosaics, {what}, tiles of {TILE_SIZE}, halo {halo}\n")
    score = training.score_label
    print(f"In process, the same input tiled and untiled (seconds; {score}, the task's own score):\n")
    print(f"| image | untiled s | tiled s | tiled ÷ untiled | untiled {score} | tiled − untiled | max |Δ| |")
    print("|---|---|---|---|---|---|---|")
    for rows, cols in [(2, 2), (3, 3)]:
        clean = mosaic(rows, cols)
        image, files, _, batch = corrupt(clean)
        request = task.prepare(image, None, task.options(**options), files)
        start = time.perf_counter()
        whole = solve_batch(task, model, [request])[0]
        untiled = time.perf_counter() - start
        start = time.perf_counter()
        cut = solve_tiled(task, model, request, TILE_SIZE)
        tiled = time.perf_counter() - start
        scores = [float(training.score(torch.from_numpy(r.output)[None], batch)) for r in (whole, cut)]
        print(
            f"| {clean.shape[-1]}×{clean.shape[-2]} ({clean[0].numel() / 1e6:.1f} MP) | {untiled:.1f} | "
            f"{tiled:.1f} | {tiled / untiled:.2f} | {scores[0]:.4f} | {scores[1] - scores[0]:+.4f} | "
            f"{np.abs(cut.output - whole.output).max():.1e} |"
        )
    shown = " ".join(["kdeq", task.name, "IMG", "-o", "OUT", *cli])
    print(f"\nThrough `{shown}` (reading and writing the PNGs included),")
    print("a fresh process per row; peak resident memory of the whole process:\n")
    print("| image | tiles | peak RSS (MiB) | s | s per MP |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for rows, cols in [(2, 2), (3, 3), (4, 4), (6, 6), (8, 8)]:
            clean = mosaic(rows, cols)
            _, _, pictures, _ = corrupt(clean)
            paths = {name: Path(tmp) / f"{name}.png" for name in pictures}
            for name, picture in pictures.items():
                write_png(paths[name], picture)
            mp = clean[0].numel() / 1e6
            del clean, pictures
            inputs = [str(paths["image"])] + (["--mask", str(paths["mask"])] if "mask" in paths else [])
            for tile in [TILE_SIZE] + ([0] if rows <= 3 else []):
                command = [task.name, *inputs, "-o", str(Path(tmp) / "out.png"), *cli, "--tile", str(tile)]
                out = subprocess.run(
                    [sys.executable, "-c", TILING_PROBE, *command], capture_output=True, text=True, cwd=ROOT
                ).stdout.split()
                code, peak, seconds = int(out[-3]), int(out[-2]) / 1024, float(out[-1])
                where = f"{tile}²" if tile else "none (untiled)"
                note = "" if code == 0 else f" (exit {code})"
                print(
                    f"| {768 * cols}×{512 * rows} ({mp:.1f} MP) | {where} | {peak:.0f}{note} | "
                    f"{seconds:.1f} | {seconds / mp:.2f} |"
                )


def section_png(args: argparse.Namespace) -> None:
    """The default denoiser's outputs (σ = 25 noise, given) on the models section's images, written as
    PNG by Pillow at zlib level 1 (what the service and CLI did before ``kdeq.images.png``) and by
    ``kdeq.images.png``, alternated in one loop: the better median time of each, and the file sizes."""
    import io

    import baselines as B
    from PIL import Image

    from kdeq.images import png

    model = load_predictor(find_model(default_models_dir(), "denoise-kglm"))
    print(f"\n## PNG writing: Pillow (level 1) against kdeq.images.png, {model.name} outputs\n")
    print("| images | Pillow ms | kdeq.images.png ms | ÷ Pillow | size ÷ Pillow |")
    print("|---|---|---|---|---|")
    for label, clean_set in test_sets(args.images).items():
        # the models section's noisy images, denoised: what a response or the CLI writes
        outputs = [
            np.rint(np.clip(denoised(model, B.add_noise(clean, SIGMA, args.seed + k)), 0, 1) * 255).astype(
                np.uint8
            )
            for k, clean in enumerate(clean_set)
        ]

        def pillow(a: np.ndarray) -> bytes:
            buf = io.BytesIO()
            Image.fromarray(a).save(buf, format="PNG", compress_level=1)
            return buf.getvalue()

        times: dict[str, list[float]] = {"pillow": [], "kdeq": []}
        for _ in range(args.repeat):
            for name, fn in (("pillow", pillow), ("kdeq", png.encode)):
                for a in outputs:
                    start = time.perf_counter()
                    fn(a)
                    times[name].append(time.perf_counter() - start)
        t_pil, t_kdeq = (float(np.median(times[k])) for k in ("pillow", "kdeq"))
        size = sum(len(png.encode(a)) for a in outputs) / sum(len(pillow(a)) for a in outputs)
        print(f"| {label} | {t_pil * 1e3:.2f} | {t_kdeq * 1e3:.2f} | {t_kdeq / t_pil:.2f} | {size:.3f} |")


SECTIONS = {
    "models": section_models,
    "linear": section_linear,
    "memory": section_memory,
    "warmstart": section_warmstart,
    "backends": section_backends,
    "loops": section_loops,
    "cli": section_cli,
    "tiling": section_tiling,
    "png": section_png,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images", type=int, default=3, help="images per set in the models section")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cli-images", type=int, default=64, help="images in the cli section")
    parser.add_argument("--no-bm3d", action="store_true")
    parser.add_argument(
        "--compare", nargs="*", default=[], metavar="NAME[:VERSION]", help="more models in the models section"
    )
    parser.add_argument(
        "--network-precision",
        nargs="+",
        choices=["auto", *netprecision.DTYPES],
        default=["float32", "auto"],
        help="the guide networks' arithmetic of the models section's kdeq rows (kdeq.runtime.netprecision), "
        "each",
    )
    parser.add_argument(
        "--guided-backend",
        nargs="+",
        choices=["auto", *native.choice.options],
        default=["auto"],
        help="the guided kernel's loops in the models section's kdeq rows (kdeq.runtime.native), each",
    )
    parser.add_argument(
        "--tiling-tasks",
        nargs="+",
        choices=["denoise", "inpaint", "segment", "denoise-impulse", "denoise-poisson", "super-resolve"],
        default=["denoise", "inpaint", "segment", "denoise-impulse", "denoise-poisson", "super-resolve"],
        help="the tasks of the tiling section",
    )
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    args = parser.parse_args()
    # the C heap as the kdeq command and the service configure it (KDEQ_MALLOC=system: glibc's own)
    kept = heap.configure()
    print(
        json.dumps(
            {
                "machine": platform.platform(),
                "malloc_keep": kept,
                # the kernels torch runs (AVX2, AVX512, …): machines of one name differ in it, and the ratios
                # to other methods moved with it (docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "another
                # machine")
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "cpus": torch.get_num_threads(),
                "torch": torch.__version__,
                "guided_loops_compiled": native.summary(),
                "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "seed": args.seed,
                "command": " ".join(sys.argv),
            }
        )
    )
    for name in args.sections:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
