"""Solver benchmark: iterations and time to relative residual 1e-4 on a 512×512 grey image.

The problem is the linear Gaussian kGLM-DEQ ``z = K(Y − z)/λ + m`` (circular
borders, so the closed form ``ẑ = (K̂Ŷ/λ + m̂)/(1 + K̂/λ)`` by FFT is the exact
reference), with ``λ = ‖K‖/C`` for each ``C``. Solvers: plain iteration,
Anderson and CG from ``kdeq``, and torchdeq 0.1.0's Anderson when it is
installed (a comparison only; ``pip install torchdeq==0.1.0`` in the benchmark
environment). Every row reports evaluations of ``f`` (counted by a wrapper),
wall time, time as a ratio to the FFT solve measured in the same run, the
final relative residual and the distance to the FFT solution.

    python bench/solvers.py [--image PATH] [--seed 0] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from kdeq import Kernel, SolverConfig, circular_spectral_norm, conv, filter_symbol, solve

DEFAULT_IMAGE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "Set12" / "08.png"
RATIOS = (0.5, 0.9, 0.99, 10.0, 100.0)
TOL = 1e-4


def load_image(path: Path | None, seed: int) -> tuple[torch.Tensor, str]:
    """A ``(1, 1, 512, 512)`` float32 image in [0, 1] plus AWGN σ=25/255, and where it came from."""
    gen = torch.Generator().manual_seed(seed)
    if path is not None and path.exists():
        from PIL import Image

        clean = torch.from_numpy(np.asarray(Image.open(path).convert("L"), dtype=np.float32) / 255.0)
        source = str(path.resolve())
    else:
        ii, jj = torch.meshgrid(torch.arange(512.0), torch.arange(512.0), indexing="ij")
        clean = 0.5 + 0.25 * torch.sin(ii / 23.0) * torch.cos(jj / 31.0) + 0.2 * ((ii // 64 + jj // 64) % 2)
        source = "synthetic pattern (no ../shared/data)"
    noisy = clean + (25.0 / 255.0) * torch.randn(clean.shape, generator=gen)
    return noisy[None, None].float(), source


def rel_residual(f, z: torch.Tensor) -> float:
    fz = f(z)
    return ((fz - z).norm() / fz.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--image", type=Path, default=DEFAULT_IMAGE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    y, source = load_image(args.image, args.seed)
    kern = Kernel(profile="se", lengthscale=2.0, radius=6, taper="triangular")
    bank = kern.filter()[None, None]
    symbol = filter_symbol(bank.double(), tuple(y.shape[-2:]))[..., 0, 0].real.float()
    norm = circular_spectral_norm(bank, tuple(y.shape[-2:]))
    mean = y.mean()

    try:
        from torchdeq.solver import get_solver

        torchdeq_anderson = get_solver("anderson")
    except ImportError:
        torchdeq_anderson = None

    print(
        f"# machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    print(f"# image: {source}, 512×512, AWGN σ=25/255 seed {args.seed}; kernel: {kern!r}")
    print(f"# tol {TOL} relative residual ‖f(z)−z‖/‖f(z)‖; float32; circular borders; ‖K‖ = {norm:.4f}")
    print("| C | solver | f evals | time (s) | time / FFT | residual | converged | ‖z − z_FFT‖/‖z_FFT‖ |")
    print("|---|---|---|---|---|---|---|---|")

    calls = [0]
    for ratio in RATIOS:
        lam = norm / ratio

        def f(z: torch.Tensor, lam: float = lam) -> torch.Tensor:
            calls[0] += 1
            return conv(y - z, bank, "circular") / lam + mean

        def fft_solve(lam: float = lam) -> torch.Tensor:
            rhs = symbol / lam * torch.fft.fft2(y[0, 0]) + torch.fft.fft2(torch.full_like(y[0, 0], mean))
            return torch.fft.ifft2(rhs / (1.0 + symbol / lam)).real[None, None]

        fft_solve()
        start = time.perf_counter()
        for _ in range(5):
            z_fft = fft_solve()
        t_fft = (time.perf_counter() - start) / 5
        rows = [("FFT closed form", 0, t_fft, z_fft)]

        z0 = torch.full_like(y, mean)
        runs = {
            "kdeq plain": SolverConfig(method="fixed_point", damping=1.0, tol=TOL, max_iter=3000),
            "kdeq Anderson": SolverConfig(method="anderson", tol=TOL, max_iter=1000),
            "kdeq CG": SolverConfig(method="cg", tol=TOL, max_iter=1000),
        }
        for name, cfg in runs.items():
            calls[0] = 0
            start = time.perf_counter()
            with torch.inference_mode():
                z, _ = solve(f, z0, cfg)
            rows.append((name, calls[0], time.perf_counter() - start, z))
        if torchdeq_anderson is not None:
            for label, kwargs in [("m=6, τ=1, lam=1e-4", {}), ("m=10, τ=0.5", {"m": 10, "tau": 0.5})]:
                calls[0] = 0
                start = time.perf_counter()
                with torch.inference_mode():
                    z, _, _ = torchdeq_anderson(f, z0, max_iter=1000, tol=TOL, stop_mode="rel", **kwargs)
                rows.append((f"torchdeq 0.1.0 Anderson ({label})", calls[0], time.perf_counter() - start, z))

        for name, evals, seconds, z in rows:
            res = rel_residual(f, z)
            err = ((z - z_fft).norm() / z_fft.norm()).item()
            res_txt = f"{res:.1e}" if np.isfinite(res) else "non-finite"
            ok = "yes" if res <= TOL else "no"
            print(
                f"| {ratio:g} | {name} | {evals} | {seconds:.3f} | {seconds / t_fft:.1f}× | "
                f"{res_txt} | {ok} | {err:.1e} |"
            )


if __name__ == "__main__":
    main()
