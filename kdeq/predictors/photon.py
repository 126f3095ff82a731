"""The photon-count denoiser: a Poisson kGLM-DEQ on the counts themselves (DESIGN §2.10).

For counts ``y ~ Poisson(r)`` per pixel the kGLM with the log link has the equilibrium

    z = exp((K/λ)(y − z) + m),      r̂ = exp(η̃) = z  (the readout at ``X̃ = X``),

the rate that maximises ``Σᵢ [rᵢ − yᵢ log rᵢ] + (λ/2)‖f‖²_K`` over ``log r = f + m``: the exact
Poisson likelihood, counts never rescaled. ``λ`` is the prior's precision on the log-rate, so it
does not depend on the light level: the data's weight grows with the counts by itself (each
pixel's Fisher information on ``log r`` is ``r``).

The kernel is the denoiser's adaptive kernel (``kdeq.predictors.denoise``) computed on the variance-stabilised
image: the Anscombe transform ``a = 2√(y + 3/8)`` (standard deviation ≈ 1 for rates above ~2),
scaled to ``u = (a − a(0))/(a(P) − a(0))`` with ``P`` the counts' 99.9th percentile, whose noise
is then ``σ_u = 1/(a(P) − a(0))``. Only the guide sees the stabilised image; the likelihood sees
the counts. The mean is the kernel's own local average of the counts ``D⁻¹K y``, and with a guide
network ``(1 − β)·D⁻¹K y + β·I(p)``, ``p`` its pilot on ``u`` mapped back to a rate by the
Makitalo–Foi inverse ``I``; ``m`` is its logarithm (floored at ``RATE_FLOOR`` counts). The solve is
Anderson's from ``z = e^m``, damped so that it contracts at any light level (``_damped``).

The output is ``r̂/peak`` with ``peak`` given or the 99.5th percentile of ``r̂`` per image (at least
one photon): an image whose full scale (white) is ``peak`` counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kdeq.maths.adaptive import GuidedMap
from kdeq.maths.families import Poisson
from kdeq.maths.operators import Diagonal
from kdeq.maths.solvers import SolverConfig
from kdeq.predictors.base import GaussianPosterior, Prediction, SolverOverride
from kdeq.predictors.denoise import Denoiser
from kdeq.predictors.uncertainty import probe_spacing

#: the smallest rate, in counts, the mean's logarithm takes (a dark region's local average may be 0)
RATE_FLOOR = 1e-3
#: the counts' quantile that sets the stabilised guide's scale ``P``
GUIDE_QUANTILE = 0.999
#: the estimate's quantile that is full scale when no peak is given
PEAK_QUANTILE = 0.995
#: ``η_max`` of the Poisson family, above the log of the largest count or mean rate by this margin
ETA_MARGIN = 3.0
#: rows per band when ``WholeImage.of`` sums a large image
LEVEL_ROWS = 512


#: ``a(0) = 2√(3/8)``, the Anscombe transform of no photons
ANSCOMBE_ZERO = 2.0 * math.sqrt(0.375)


def anscombe(y: torch.Tensor) -> torch.Tensor:
    """The Anscombe transform ``2√(y + 3/8)``, elementwise: Poisson counts to noise of std ≈ 1."""
    return 2.0 * torch.sqrt(y + 0.375)


def inverse_anscombe(d: torch.Tensor) -> torch.Tensor:
    """The closed-form approximation of the exact unbiased inverse of the Anscombe transform
    (Mäkitalo & Foi, 2011), ``¼d² + ¼√(3/2)d⁻¹ − (11/8)d⁻² + (5/8)√(3/2)d⁻³ − 1/8``, clamped at 0:
    the rate ``r`` whose ``E[2√(y + 3/8)]`` is ``d``, for ``d`` the denoised stabilised value."""
    d = d.clamp(min=0.5)  # below a(0) ≈ 1.22 every value means a rate of 0; keeps d⁻³ finite
    c = math.sqrt(1.5)
    rate = 0.25 * d**2 + 0.25 * c / d - 1.375 / d**2 + 0.625 * c / d**3 - 0.125
    return rate.clamp(min=0.0)


def quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q``-quantile of each image of ``x`` ``(B, c, H, W)``, ``(B,)`` (``torch.quantile``
    refuses more than 2²⁴ values, so large images take ``kthvalue``)."""
    flat = x.reshape(x.shape[0], -1)
    k = min(max(1, math.ceil(q * flat.shape[1])), flat.shape[1])
    return flat.kthvalue(k, dim=1).values


def guide_bright(counts: torch.Tensor) -> torch.Tensor:
    """The guide's scale ``P`` ``(B,)``: ``GUIDE_QUANTILE`` of each image of ``counts`` ``(B, c, H, W)``,
    at least one photon."""
    return quantile(counts, GUIDE_QUANTILE).clamp(min=1.0)


def full_scale(estimate: torch.Tensor) -> torch.Tensor:
    """The counts shown as white when no peak is given, ``(B,)``: ``PEAK_QUANTILE`` of each rate
    estimate ``(B, c, H, W)``, at least one photon (a frame that caught (almost) none shows dark, not
    its noise as white)."""
    return quantile(estimate, PEAK_QUANTILE).clamp(min=1.0)


@dataclass(frozen=True)
class WholeImage:
    """What a tile of an image of counts takes from its whole image (``kdeq.serving.tiling``): the guide's
    scale ``P`` (``bright`` ``(1,)``), the stabilised image's channel means that the guide network
    centres on (``level`` ``(1, c)``), and its largest count ``top``."""

    bright: torch.Tensor
    level: torch.Tensor
    top: float

    @classmethod
    def of(cls, counts: torch.Tensor) -> WholeImage:
        """The statistics of one image of ``counts`` ``(1, c, H, W)`` (``PhotonDenoiser.stabilised``)."""
        bright = guide_bright(counts)
        span = anscombe(bright) - ANSCOMBE_ZERO
        rows = counts.shape[-2]
        # the stabilised image's channel sums in float64, a band of rows at a time: a float64 copy
        # of a 25-megapixel image would be 600 MiB
        sums = sum(
            (anscombe(counts[0, :, top : top + LEVEL_ROWS].double()) - ANSCOMBE_ZERO).sum(dim=(1, 2))
            for top in range(0, rows, LEVEL_ROWS)
        )
        level = (sums / (rows * counts.shape[-1]) / span.double()).float()
        return cls(bright, level.reshape(1, -1), max(float(counts.max()), 1.0))


class PhotonDenoiser(Denoiser):
    """Poisson-family denoiser of photon counts; see the module docstring."""

    task = "denoise-poisson"
    family = "poisson"
    architectures = ("guided",)
    network = "sigma"
    extras = frozenset()

    @property
    def pads_exactly(self) -> bool:
        return False

    def stabilised(
        self, counts: torch.Tensor, bright: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``u`` ``(B, c, H, W)``, its noise ``σ_u`` ``(B,)`` and its span ``a(P) − a(0)`` ``(B,)`` for
        ``counts`` ``(B, c, H, W)`` (module docstring); ``P`` is ``bright`` ``(B,)`` where given (a
        tile's whole image's, ``kdeq.serving.tiling``), else ``GUIDE_QUANTILE`` of the counts, at least 1."""
        if bright is None:
            bright = guide_bright(counts)
        span = anscombe(bright) - ANSCOMBE_ZERO
        u = (anscombe(counts) - ANSCOMBE_ZERO) / span.reshape(-1, 1, 1, 1)
        return u, 1.0 / span, span

    def forward(
        self,
        counts: torch.Tensor,
        peak: float | Sequence[float] | torch.Tensor | None = None,
        solver: SolverOverride | None = None,
        whole: WholeImage | None = None,
    ) -> Prediction:
        """Estimate the rate of ``counts`` ``(B, c, H, W)`` (non-negative, photon counts); ``peak``
        the counts shown as full scale, scalar or ``(B,)`` (default ``PEAK_QUANTILE`` of the estimate);
        ``whole`` a tile's whole image's statistics (``kdeq.serving.tiling``), one image's.

        ``output`` is ``r̂/peak`` ``(B, c, H, W)``, ``peak`` the peak used ``(B,)``, ``pilot`` the
        guide network's ``I(p)/peak``, on the output's scale (``None`` without one)."""
        y = self.counts(counts)
        u, s_u, span = self.stabilised(y, None if whole is None else whole.bright.to(y))
        level = None if whole is None else whole.level.to(y)
        op, pilot_u = self.guided_operator(u, s_u, level=level, mean_of=y)
        rate = op.local_mean
        pilot = None
        if pilot_u is not None:
            pilot = self.pilot_rate(pilot_u, span)
            beta = self.tensors["net_mean_mix"]
            rate = beta * pilot + (1 - beta) * rate
        mean = torch.log(rate.clamp(min=RATE_FLOOR))
        # a tile takes at least its whole image's brightest count: the family's range and the damping
        # then follow the image, not the tile (each only bounds the iteration, not its fixed point)
        top = max(float(y.max()), float(rate.detach().max()), 1.0, 0.0 if whole is None else whole.top)
        family = Poisson(eta_max=math.log(top) + ETA_MARGIN)
        lam = self.lam(torch.zeros(y.shape[0], device=y.device))
        layer = self.kglm_layer(family, lam, lambda _, s: GuidedMap(op, s), tied=True)
        out = layer(y, mean=mean, mean_out=mean, z0=family.sigma(mean), solver=self._damped(solver, top, lam))
        estimate = family.sigma(out.eta)
        full = self.peak(estimate, peak).reshape(-1, 1, 1, 1)
        shown = None if pilot is None else pilot / full
        return Prediction(estimate / full, out.stats, lam, pilot=shown, peak=full.reshape(-1))

    def gaussian_posterior(
        self,
        counts: torch.Tensor,
        peak: float | Sequence[float] | torch.Tensor | None = None,
        solver: SolverOverride | None = None,
        whole: WholeImage | None = None,
    ) -> GaussianPosterior:
        """Laplace's approximation at the equilibrium, as the segmenter's: the log-rate's covariance
        ``(λK⁻¹ + W)⁻¹`` with ``W = diag(r̂)`` (``A''(η) = e^η``), i.e. ``A = W^{1/2}``, ``s² = 1/λ``, ``K``
        the adaptive kernel of the stabilised image (module docstring; a tile's with its whole image's
        ``WholeImage``); the std mapped to the output ``r̂/peak`` by the delta method
        (``d(e^η)/dη = r̂``), so the factor is the output itself. Arguments as ``forward``'s."""
        found = self.forward(counts, peak, solver, whole)
        out = found.output.double()
        rate = out * found.peak.double().reshape(-1, 1, 1, 1)
        x = self.images(counts)
        u, s_u, _ = self.stabilised(x, None if whole is None else whole.bright.to(x))
        op = self._posterior_kernel(u, s_u, None if whole is None else whole.level.to(x))
        lam = found.lam.double()
        spacing = probe_spacing(self.tensors["spatial"].shape[0] // 2)
        weight = Diagonal(rate.sqrt())
        return GaussianPosterior(op, weight, lam, 1 / lam, None, tuple(out.shape), None, spacing, out)

    def pilot_only(self, counts: torch.Tensor, peak: float | Sequence[float] | torch.Tensor) -> torch.Tensor:
        """The guide network's rate ``I(p)/peak`` ``(B, c, H, W)`` alone, without the solve (the
        trainer's pilot phase), for ``counts`` ``(B, c, H, W)`` and ``peak`` scalar or ``(B,)``."""
        if self.config.architecture.net is None:
            raise ValueError(f"{self.name} has no guide network")
        y = self.counts(counts)
        u, s_u, span = self.stabilised(y)
        rate = self.pilot_rate(self.guide(u, s_u)[1], span)
        return rate / self.peak(rate, peak).reshape(-1, 1, 1, 1)

    def counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` ``(B, c, H, W)`` on the model's device and dtype; ``ValueError`` for a negative one."""
        y = self.images(counts)
        if bool((y < 0).any()):
            raise ValueError("photon counts are non-negative")
        return y

    @staticmethod
    def pilot_rate(pilot_u: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
        """``I(p·span + a(0))`` ``(B, c, H, W)``: the guide network's pilot ``p`` ``(B, c, H, W)`` of the
        stabilised image mapped back to counts (``span`` ``(B,)``, module docstring)."""
        return inverse_anscombe(pilot_u * span.reshape(-1, 1, 1, 1) + ANSCOMBE_ZERO)

    def _damped(self, override: SolverOverride | None, top: float, lam: torch.Tensor) -> SolverConfig:
        """The solver with its damping at most ``2/(1 + L)``, ``L = top/min λ``: the map's Jacobian
        ``−diag(z)K/λ`` has eigenvalues in ``[−L, 0]`` for rates up to ``top`` and a normalised kernel
        (spectral radius ≤ 1), so ``z ↦ (1 − β)z + βf(z)`` contracts its linearisation. At a few
        photons nothing changes; at thousands the undamped map overshoots (``tests/test_photon.py``)."""
        config = self.solver(override)
        bound = 2.0 / (1.0 + top / float(lam.detach().min()))
        return config.model_copy(update={"damping": min(config.damping, bound)})

    def peak(
        self, estimate: torch.Tensor, peak: float | Sequence[float] | torch.Tensor | None
    ) -> torch.Tensor:
        """The full-scale counts ``(B,)``: ``peak`` as given (positive and finite), or ``PEAK_QUANTILE``
        of each ``estimate`` ``(B, c, H, W)``, at least 1."""
        if peak is None:
            return full_scale(estimate)
        p = torch.as_tensor(peak, dtype=estimate.dtype, device=estimate.device).reshape(-1)
        if p.numel() == 1:
            p = p.expand(estimate.shape[0])
        if p.numel() != estimate.shape[0]:
            raise ValueError(f"got {p.numel()} peaks for {estimate.shape[0]} images")
        if not bool(torch.isfinite(p).all()) or bool((p <= 0).any()):
            raise ValueError("peak must be a positive, finite count")
        return p
