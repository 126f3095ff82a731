"""Linear Gaussian kGLM-DEQs solved as the linear systems they are.

With the Gaussian family (``σ`` the identity) and a flat prior the equilibrium
map is affine: with the observed-set mask ``M`` (``I`` when absent)

    f(z) = M W1 M z + b,     b = M W2 M t + m,

so ``z* = f(z*)`` is ``A z* = b`` with ``A = I − M W1 M``, symmetric positive
definite for ``W1 = −K/λ``, ``K`` PSD. Two exact methods, chosen by the maps:

- **transform** (no mask; ``W1``, ``W2`` single-channel stationary filters with a
  ``circular`` border, or a ``symmetric`` border and filters even in each axis):
  ``A`` and ``W2`` are diagonal in the DFT or DCT-II (``kdeq.maths.transforms``), so
  ``ẑ = (ŵ2 t̂ + m̂)/(1 − ŵ1)`` — one forward and one inverse transform.
- **preconditioned CG** otherwise: ``b`` is formed once, each step applies
  ``W1`` once (the generic CG on ``f`` applies ``W1`` and ``W2``), and for a
  stationary ``W1`` with a zero border and no mask (``A`` symmetric) the
  preconditioner is ``A``'s symmetric-border, axis-symmetrised approximation
  inverted by the DCT (exact in the interior, so CG only has the border left
  to fix).

Residuals and statistics follow ``kdeq.maths.solvers``: the relative residual
``‖f(z) − z‖/max(‖f(z)‖, a√n)`` per sample, ``b − Az`` being ``f(z) − z``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kdeq.maths.conv import Stationary
from kdeq.maths.solvers import SolverConfig, SolverStats, linear_cg
from kdeq.maths.transforms import dct2, dct_symbol, dft_symbol, idct2, is_axis_even


class Negated(torch.nn.Module):
    """``x ↦ −W x`` for a map ``W``: the kGLM's ``W2 = −W1`` (Theorem 3) kept as one kernel, which
    ``solve_affine`` recognises to form its first residual with one application instead of two."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def stationary(self) -> Stationary | None:
        """``W`` as one filter with its scale negated, when ``W`` is one (``_stationary``)."""
        inner = _stationary(self.inner)
        return None if inner is None else Stationary(inner.taps, -inner.scale, inner.padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -self.inner(x)


def _stationary(module: object) -> Stationary | None:
    describe = getattr(module, "stationary", None)
    return describe() if callable(describe) else None


def _transform_symbols(
    w1: Stationary, w2: Stationary, size: tuple[int, int]
) -> (
    tuple[
        Callable[[torch.Tensor], torch.Tensor],
        Callable[[torch.Tensor], torch.Tensor],
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
    ]
    | None
):
    """``(T, T⁻¹, ĥ1, ĥ2, weights)`` when ``W1``, ``W2`` are diagonal in one transform, else ``None``.

    ``weights`` makes the transform-domain sum of ``|X|²`` equal ``‖x‖²`` (1 for the DCT;
    the Hermitian half-spectrum of ``rfft2`` counts its inner columns twice).
    """
    if w1.padding != w2.padding or w1.padding not in ("circular", "symmetric"):
        return None
    # the symbols need the filter to fit the image (smaller images take CG)
    k = max(w1.taps.shape[-1], w2.taps.shape[-1])
    if (k if w1.padding == "circular" else k // 2) > min(size):
        return None
    width = size[1]
    if w1.padding == "symmetric":
        if not (is_axis_even(w1.taps) and is_axis_even(w2.taps)):
            return None
        ones = torch.ones((), dtype=w1.taps.dtype, device=w1.taps.device)
        return dct2, idct2, dct_symbol(w1.taps, size), dct_symbol(w2.taps, size), ones

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft2(x, norm="ortho")

    def inverse(y: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft2(y, s=size, norm="ortho")

    weights = torch.full((width // 2 + 1,), 2.0, dtype=w1.taps.dtype, device=w1.taps.device)
    weights[0] = 1.0
    if width % 2 == 0:
        weights[-1] = 1.0
    return forward, inverse, dft_symbol(w1.taps, size), dft_symbol(w2.taps, size), weights


def _constant(mean: torch.Tensor) -> bool:
    """A mean broadcast from one value per sample and channel (e.g. the global mean)."""
    return mean.dim() == 4 and mean.stride(-1) == 0 and mean.stride(-2) == 0


def transform_solve(
    w1: Stationary,
    w2: Stationary,
    t: torch.Tensor,
    mean: torch.Tensor | None,
    config: SolverConfig,
    with_map: bool = False,
) -> tuple[torch.Tensor, SolverStats, torch.Tensor | None] | None:
    """``(z*, stats, f(z*) if with_map)`` with ``z* = T⁻¹[(s2 ĥ2 T t + T m)/(1 − s1 ĥ1)]`` for ``t``
    ``(B, c, H, W)``, or ``None`` when the maps are not diagonal in one transform. ``iterations`` is 0;
    the residual is ``‖f(z) − z‖`` evaluated in the transform domain (the same number, by Parseval) for
    the float64 ``z``, before its rounding to ``t``'s dtype: that rounding's own residual, up to
    ``eps·‖K/λ‖``, belongs to the dtype, not to the solve."""
    # in float64: with ‖K/λ‖ ~ 10⁴ (low noise, deblurring) a float32 z already has a relative residual
    # ~ eps·‖K/λ‖ ~ 10⁻³; solved in float64 and rounded once, z is the float32 image of the exact solution
    dtype = t.dtype
    w1 = Stationary(w1.taps.double(), torch.as_tensor(w1.scale).double(), w1.padding)
    w2 = Stationary(w2.taps.double(), torch.as_tensor(w2.scale).double(), w2.padding)
    t = t.double()
    constant = mean is not None and _constant(mean)
    # a constant mean keeps its stride-0 view (a plain conversion would materialise it)
    mean = None if mean is None else (mean[..., :1, :1].double() if constant else mean.double())
    found = _transform_symbols(w1, w2, tuple(t.shape[-2:]))
    if found is None:
        return None
    forward, inverse, h1, h2, weights = found
    t_hat = forward(t)
    rhs = w2.scale * h2 * t_hat
    if mean is not None:
        if constant:
            # a constant has only the DC coefficient, √(HW)·m in both orthonormal transforms
            dc = mean * (t.shape[-2] * t.shape[-1]) ** 0.5
            rhs[..., :1, :1] += dc
        else:
            rhs = rhs + forward(mean)
    z_hat = rhs / (1.0 - w1.scale * h1)
    z = inverse(z_hat)
    bsz = t.shape[0]
    resid = w1.scale * h1 * z_hat + rhs - z_hat
    floor = max(config.atol * z[0].numel() ** 0.5, torch.finfo(dtype).tiny)
    num = (resid.abs().square() * weights).reshape(bsz, -1).sum(1).sqrt()
    den = ((z_hat + resid).abs().square() * weights).reshape(bsz, -1).sum(1).sqrt()
    res = num / den.clamp(min=floor)
    res = torch.where(torch.isfinite(res), res, torch.inf)
    stats = SolverStats(
        iterations=torch.zeros(bsz, dtype=torch.int64, device=t.device),
        residual=res.to(dtype),
        converged=res <= config.tol,
    )
    return z.to(dtype), stats, inverse(z_hat + resid).to(dtype) if with_map else None


def symmetric_preconditioner(w1: Stationary, size: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``r ↦ D⁻¹[D r/(1 − s1 ĥ)]`` with ``ĥ`` the DCT symbol of ``W1``'s filter averaged over its axis
    flips: the inverse of ``A`` with the border made symmetric — SPD, and ``A``'s exact inverse away
    from the border when ``W1`` is axis-even."""
    taps = 0.25 * (w1.taps + w1.taps.flip(-1) + w1.taps.flip(-2) + w1.taps.flip(-1, -2))
    denom = (1.0 - w1.scale * dct_symbol(taps, size)).clamp(min=1e-6)
    return lambda r: idct2(dct2(r) / denom)


def _restrict(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``M x``: ``x`` on the observed set (all of it without a mask)."""
    return x if mask is None else mask * x


def _start(
    w2: torch.nn.Module,
    t: torch.Tensor,
    mean: torch.Tensor | None,
    mask: torch.Tensor | None,
    z0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CG's start ``z0`` and its residual ``r0 = b − A z0 = M W2 M (t − z0) + m − z0`` ``(B, c, H, W)``
    for ``W2 = −W1``, with one application of ``W2``.

    Given no ``z0``, each sample starts from whichever of the mean ``m`` and the observations
    (``t`` where observed, ``m`` elsewhere) has the smaller residual: ``M W2 M u`` and ``−M u`` for
    ``u = t − m``, both from the one application. The observations win where ``A = I + K/λ`` is
    ill-conditioned (low noise), and there CG's correction ``z − z0`` is small, as float32 needs
    (``kdeq.maths.solvers.linear_cg``); the mean wins at high noise, where it is the closer start.
    Either residual is formed from a difference taken before the kernel multiplies it.
    """
    base = torch.zeros_like(t) if mean is None else mean.expand_as(t)
    if z0 is not None:
        return z0, _restrict(w2(_restrict(t - z0, mask)), mask) - (z0 - base)
    u = _restrict(t - base, mask)
    from_mean = _restrict(w2(u), mask)
    from_observed = -u
    observed = t if mask is None else torch.where(mask > 0, t, base)
    pick = (from_observed.flatten(1).norm(dim=1) < from_mean.flatten(1).norm(dim=1)).view(-1, 1, 1, 1)
    return torch.where(pick, observed, base), torch.where(pick, from_observed, from_mean)


def solve_affine(
    w1: torch.nn.Module,
    w2: torch.nn.Module,
    t: torch.Tensor,
    mean: torch.Tensor | None,
    mask: torch.Tensor | None,
    z0: torch.Tensor | None,
    config: SolverConfig,
    with_map: bool = False,
) -> tuple[torch.Tensor, SolverStats, torch.Tensor | None]:
    """``z* = M W1 M z* + M W2 M t + m`` by the fastest exact method (module docstring), from ``z0``
    or, given none, the better of ``m`` and the observations (``_start``; ``m`` when ``W2 ≠ −W1``).

    Returns the solution ``z``, its statistics and, ``with_map``, ``f(z) = z + b − Az``: CG has the
    true residual ``b − Az`` in hand, so a layer whose readout is its map gets it at no further cost."""
    s1, s2 = _stationary(w1), _stationary(w2)
    if mask is None and s1 is not None and s2 is not None:
        done = transform_solve(s1, s2, t, mean, config, with_map)
        if done is not None:
            return done

    def apply_a(z: torch.Tensor) -> torch.Tensor:
        return z - _restrict(w1(_restrict(z, mask)), mask)

    if isinstance(w2, Negated) and w2.inner is w1:
        z0, r0 = _start(w2, t, mean, mask, z0)
    else:
        if z0 is None:
            z0 = torch.zeros_like(t) if mean is None else mean.expand_as(t)
        # two applications here, and a start at m: W2 is a trained map of its own (Anderson-only
        # models and fine-tuned untied layers), so −M u is not the observations' residual
        b = _restrict(w2(_restrict(t, mask)), mask) + (0.0 if mean is None else mean)
        r0 = b - apply_a(z0)

    precondition = None
    # only where A is symmetric and the symmetric-border inverse approximates it: the zero border
    # (a reflect border, or a symmetric one with a filter not even in each axis, makes A asymmetric)
    symmetric = s1 is not None and s1.padding == "zeros"
    if mask is None and symmetric and min(t.shape[-2:]) > s1.taps.shape[-1] // 2:
        precondition = symmetric_preconditioner(s1, tuple(t.shape[-2:]))
    elif mask is None and callable(getattr(w1, "preconditioner", None)):
        # a map that knows its own approximate inverse (kdeq.maths.operators.Sandwich)
        precondition = w1.preconditioner(tuple(t.shape[-2:]))
    z, stats, r = linear_cg(apply_a, r0, z0, config, precondition)
    return z, stats, z + r if with_map else None
