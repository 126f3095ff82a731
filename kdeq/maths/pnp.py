"""Plug-and-play half-quadratic splitting: a denoiser as the prior of a linear inverse problem.

For observations ``y = A f + ε``, ``ε ~ N(0, σ²I)``, half-quadratic splitting alternates, for noise
levels ``σ_1 > … > σ_K = σ̄`` (geometric; ``σ̄`` the observations' ``σ``, floored as the ``λ`` rule
floors it),

    x_k = argmin_x ‖y − A x‖²/σ̄² + ‖x − z_{k−1}‖²/(v·σ_k²)      (the data step)
    z_k = D(x_k, σ_k)                                             (the prior step)

from a start ``z_0`` on the image grid (the observations themselves for a blur), and returns
``z_K``. The data step is the kGLM of ``kdeq.maths.operators`` with the white kernel ``K = I``
observed through ``A`` around the mean ``z_{k−1}`` (DESIGN §2 fact 8 with ``K = I``):

    x_k = z_{k−1} + Aᵀ (A Aᵀ + λ_k I)⁻¹ (y − A z_{k−1}),     λ_k = λ(σ̄)/σ_k² = σ̄²/(v·σ_k²),

the posterior mean of ``x ~ N(z_{k−1}, v·σ_k² I)`` seen through ``A``, equal to
``(AᵀA + λ_k I)⁻¹(Aᵀy + λ_k z_{k−1})``; ``λ(σ) = σ²/v`` is the model's noise rule, so ``1/v`` weighs
the prior's belief in its last estimate. For a symmetric-border blur with a PSF even in each axis
``A Aᵀ`` is diagonal in the DCT-II and the data step is one transform (``kdeq.maths.operators.Sandwich``);
any other PSF takes preconditioned CG. The prior step is a denoiser given its noise level: the
schedule hands it a decreasing ``σ_k``, from strong smoothing to the observations' own noise (Zhang
et al., "Plug-and-Play Image Restoration with Deep Denoiser Prior", 2021, whose schedule this is).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kdeq.maths.operators import KernelMap, Operator, solve_observed
from kdeq.maths.solvers import SolverConfig, SolverStats, chained

#: ``(x, σ) ↦ (D(x, σ), stats)``: a denoiser of images ``(B, c, H, W)`` at noise levels ``(B,)`` in
#: [0, 1] units, with its solve's statistics
Denoise = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, SolverStats]]


def noise_schedule(start: float, final: torch.Tensor, steps: int) -> torch.Tensor:
    """``σ_k``, ``(steps, B)`` in [0, 1] units: geometric from ``max(start, σ̄)`` to the final
    levels ``σ̄ = final`` ``(B,)`` (a single step is at ``σ̄``)."""
    final = final.reshape(-1)
    first = final.clamp(min=start)
    if steps == 1:
        return final[None]
    t = torch.linspace(0.0, 1.0, steps, dtype=final.dtype, device=final.device)[:, None]
    return first ** (1 - t) * final**t


def white_kernel(images: torch.Tensor) -> KernelMap:
    """``K = I`` as a 1×1 symmetric-border kernel map on images like ``images`` (the data step's)."""
    one = torch.ones(1, 1, 1, 1, dtype=images.dtype, device=images.device)
    return KernelMap(one, torch.ones(images.shape[0], dtype=images.dtype, device=images.device), "symmetric")


def data_step(
    op: Operator, y: torch.Tensor, z: torch.Tensor, lam: torch.Tensor, config: SolverConfig
) -> tuple[torch.Tensor, SolverStats]:
    """``x = z + Aᵀ(A Aᵀ + λI)⁻¹(y − A z)`` ``(B, c, H, W)`` for observations ``y`` ``(B, c, H', W')``,
    the mean ``z`` ``(B, c, H, W)`` and ``λ`` ``(B,)``: ``kdeq.maths.operators.solve_observed`` with
    ``K = I`` (differentiable in ``z`` and ``λ``)."""
    return solve_observed(op, white_kernel(z), y, lam, z, config)


def plug_and_play(
    op: Operator,
    y: torch.Tensor,
    start: torch.Tensor,
    lam: torch.Tensor,
    levels: torch.Tensor,
    denoise: Denoise,
    config: SolverConfig,
) -> tuple[torch.Tensor, SolverStats]:
    """``z_K`` ``(B, c, H, W)`` of the module docstring's iteration for observations ``y``
    ``(B, c, H', W')`` from ``z_0 = start`` ``(B, c, H, W)``, with ``λ(σ̄)`` ``(B,)`` and the schedule
    ``levels`` ``(K, B)`` (``noise_schedule``). The statistics are every solve's, data and prior
    steps' alike: iterations summed, the worst residual, converged when every solve did."""
    z = start
    solves = []
    for sigma in levels:
        x, stats = data_step(op, y, z, lam / sigma.square(), config)
        z, prior = denoise(x, sigma)
        solves += [stats, prior]
    return z, chained(solves)
