"""The segmenter: kernel logistic regression (Appendix G) as a Bernoulli kGLM-DEQ.

The image is reduced to luminance, optionally smoothed, and binarised at a
threshold ``τ`` (Otsu's by default) into labels ``t ∈ {0, 1}``; the equilibrium

    z = logistic((K/λ)(t − z) + m)

is the foreground probability of kernel logistic regression on those labels
(``m = 0`` by default: no prior preference), and the mask is ``z > 1/2``.

Without a mean the solve starts from the equilibrium linearised about ``η = 0``:
``σ(η) ≈ σ(0) + A''(0) η`` turns it into the linear Gaussian kGLM
``u = (K/λ')(t − σ(0) − u)``, ``u = z − σ(0)``, ``λ' = λ/A''(0)``, which a loose
CG solve (``kdeq.maths.linear``) settles in a few convolutions; from there Anderson
needs fewer iterations than from ``σ(0)`` (measured in ``docs/BENCHMARKS.md``).
The start changes where the solve begins, not the fixed point it finds.

With a network (``kdeq.maths.guidenet``, ``condition = "image"``) the mean is learned,
``m = N_θ(x − τ, t)`` from the luminance ``x`` and the labels: the network sees
the grey levels the threshold discarded. Its pilot is ``logistic(m)``, and the
solve starts there.
"""

from __future__ import annotations

import torch

from kdeq.maths.families import Bernoulli, Family, Gaussian
from kdeq.maths.filters import gaussian_taps, separable_blur
from kdeq.maths.guidenet import segment_mean
from kdeq.maths.linear import solve_affine
from kdeq.maths.noise import LUMA
from kdeq.maths.operators import Diagonal
from kdeq.maths.solvers import SolverConfig
from kdeq.predictors.base import GaussianPosterior, Prediction, Predictor, SolverOverride
from kdeq.predictors.spec import Checkpoint, ModelSpecBase
from kdeq.predictors.uncertainty import conv_kernel, probe_spacing


def luminance(x: torch.Tensor) -> torch.Tensor:
    """Luma ``Σ_i w_i x_i`` (BT.601 weights) of colour images ``(…, 3, H, W)``; the channel mean of
    any other channel count; shape ``(…, 1, H, W)``."""
    if x.shape[-3] == 3:
        return sum(w * x[..., i : i + 1, :, :] for i, w in enumerate(LUMA))
    return x.mean(dim=-3, keepdim=True)


#: pixels binned at a time by ``otsu_threshold`` (its float64 and int64 temporaries are this many
#: elements, not an image's: a 25-megapixel scan's took ~1 GiB)
OTSU_CHUNK = 1 << 22


def otsu_threshold(x: torch.Tensor, bins: int = 256) -> torch.Tensor:
    """Otsu's threshold per image ``(B,)`` for ``x`` ``(B, 1, H, W)``: the bin edge between the
    image's minimum and maximum that maximises the between-class variance ``ω₀ω₁(μ₀ − μ₁)²``. The
    histogram is counted ``OTSU_CHUNK`` pixels at a time, each bin computed in float64."""
    flat = x.reshape(x.shape[0], -1)
    lo, hi = flat.min(dim=1).values.to(torch.float64), flat.max(dim=1).values.to(torch.float64)
    width = (hi - lo).clamp(min=1e-12) / bins
    hist = torch.zeros(x.shape[0], bins, dtype=torch.float64, device=x.device)
    for start in range(0, flat.shape[1], OTSU_CHUNK):
        part = flat[:, start : start + OTSU_CHUNK].to(torch.float64)
        idx = ((part - lo[:, None]) / width[:, None]).floor().clamp(0, bins - 1).to(torch.int64)
        hist += torch.stack([torch.bincount(row, minlength=bins) for row in idx]).to(torch.float64)
    centres = lo[:, None] + (torch.arange(bins, dtype=torch.float64, device=x.device) + 0.5) * width[:, None]
    w0 = hist.cumsum(dim=1)
    s0 = (hist * centres).cumsum(dim=1)
    total, mass = w0[:, -1:], s0[:, -1:]
    w1 = total - w0
    mu0 = s0 / w0.clamp(min=1e-12)
    mu1 = (mass - s0) / w1.clamp(min=1e-12)
    between = w0 * w1 * (mu0 - mu1).square()
    k = between[:, :-1].argmax(dim=1)
    return (lo + (k + 1).to(torch.float64) * width).to(x.dtype)


class Segmenter(Predictor):
    """Binary foreground segmentation; see the module docstring."""

    task = "segment"
    family = "bernoulli"
    network = "image"

    @classmethod
    def check_spec(cls, spec: ModelSpecBase) -> None:
        super().check_spec(spec)
        if spec.architecture.net is not None and spec.mean != "none":
            raise ValueError("the segmenter's network is its mean: use mean 'none'")

    def __init__(self, checkpoint: Checkpoint, device: str | torch.device = "cpu") -> None:
        super().__init__(checkpoint, device)
        self.presmooth_taps = gaussian_taps(self.config.presmooth).to(self.device)
        #: start the solve from the linearised equilibrium (module docstring) when there is no mean
        self.warm_start = True

    @property
    def reach(self) -> int:
        """``ρ``: the equation of a pixel, ``z = logistic((K/λ)(t − z) + m)`` there, reads the image within
        ``ρ`` pixels of it, given the threshold ``τ``: the labels ``t`` are the pre-smoothed luminance's
        (its radius), read by ``K``'s row (the kernel's radius) and by the network's mean (its
        receptive field on the 2×2-unshuffled image, ``2·depth + 1`` pixels), which reads the
        luminance as well."""
        net = self.config.architecture.net
        smoothing = self.presmooth_taps.shape[0] // 2
        return smoothing + max(self.tensors["w1"].shape[-1] // 2, 0 if net is None else 2 * net.depth + 1)

    @property
    def solve_reach(self) -> int:
        """``coupled_reach``: the equilibrium couples pixels through the kernel beyond the reach."""
        return self.coupled_reach(self.reach)

    def otsu(self, images: torch.Tensor) -> torch.Tensor:
        """Otsu's threshold ``τ`` ``(B,)`` of ``images`` ``(B, c, H, W)``: the one ``forward`` uses
        when none is given."""
        return otsu_threshold(self._smoothed(images)[1])

    def _smoothed(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The luminance ``x`` and its pre-smoothed ``x̄``, each ``(B, 1, H, W)``, of ``images``."""
        grey = luminance(self.images(images))
        return grey, separable_blur(grey, self.presmooth_taps)

    def forward(
        self, images: torch.Tensor, threshold: float | None = None, solver: SolverOverride | None = None
    ) -> Prediction:
        """``images`` ``(B, c, H, W)``; ``threshold`` on the images' [0, 1] scale (default Otsu's per image).

        ``output`` is the foreground probability ``(B, 1, H, W)`` and ``mask`` its ``> 1/2`` set.
        """
        grey, tau, labels = self._labels(images, threshold)
        lam = self.lam(torch.zeros(grey.shape[0], device=self.device))
        family = Bernoulli()
        cfg = self.solver(solver)
        if self.config.architecture.net is not None:
            mean = segment_mean(grey, tau, labels, self.tensors, self.config.architecture.net)
            z0, pilot = None, family.sigma(mean)
        else:
            mean, pilot = self.mean(labels), None
            z0 = self.linear_start(family, labels, lam, cfg) if self.warm_start and mean is None else None
        out = self.conv_layer(family, lam)(labels, mean=mean, mean_out=mean, z0=z0, solver=cfg)
        prob = family.sigma(out.eta)
        return Prediction(prob, out.stats, lam, mask=prob > 0.5, threshold=tau, pilot=pilot)

    def gaussian_posterior(
        self, images: torch.Tensor, threshold: float | None = None, solver: SolverOverride | None = None
    ) -> GaussianPosterior:
        """Laplace's approximation at the equilibrium (``kdeq.predictors.uncertainty``'s docstring):
        ``A = W^{1/2}``, ``W = diag(π(1 − π))`` of the solved probability ``π``; ``K`` the bank;
        ``s² = 1/λ``; the std mapped to the probability by ``π(1 − π)``. Arguments as ``forward``'s."""
        prob = self.forward(images, threshold, solver).output.double()
        weight = prob * (1 - prob)
        lam = self.lam(torch.zeros(prob.shape[0], device=prob.device)).double()
        kernel, stationary = conv_kernel(self, prob.shape[0])
        spacing = probe_spacing(stationary.taps.shape[-1] // 2)
        op = Diagonal(weight.sqrt())
        return GaussianPosterior(
            kernel, op, lam, 1 / lam, None, tuple(prob.shape), stationary, spacing, weight
        )

    def pilot_only(self, images: torch.Tensor) -> torch.Tensor:
        """The network's pilot ``logistic(m)`` ``(B, 1, H, W)`` without the solve (the trainer's pilot
        phase); ``images`` as in ``forward``, thresholded at Otsu's."""
        if self.config.architecture.net is None:
            raise ValueError(f"{self.name} has no network")
        grey, tau, labels = self._labels(images, None)
        return Bernoulli().sigma(segment_mean(grey, tau, labels, self.tensors, self.config.architecture.net))

    def _labels(
        self, images: torch.Tensor, threshold: float | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The luminance ``x`` ``(B, 1, H, W)``, the threshold ``τ`` ``(B,)`` and the labels
        ``t = [x̄ > τ]`` ``(B, 1, H, W)`` of the pre-smoothed luminance ``x̄``."""
        grey, smooth = self._smoothed(images)
        if threshold is None:
            tau = otsu_threshold(smooth)
        else:
            if not (isinstance(threshold, float | int) and 0.0 <= threshold <= 1.0):
                raise ValueError(f"threshold must be a number in [0, 1], got {threshold!r}")
            tau = torch.full((grey.shape[0],), float(threshold), device=self.device)
        return grey, tau, (smooth > tau.reshape(-1, 1, 1, 1)).to(torch.float32)

    def linear_start(
        self, family: Family, labels: torch.Tensor, lam: torch.Tensor, config: SolverConfig
    ) -> torch.Tensor:
        """``σ(0) + u`` ``(B, 1, H, W)`` with ``u`` the linearised equilibrium (module docstring) to a
        relative residual of ``1e-2``, mapped into ``σ``'s open range; no gradient flows through it."""
        with torch.no_grad():
            zero = torch.zeros((), device=labels.device)
            s0, c0 = family.sigma(zero), family.A2(zero)
            layer = self.conv_layer(Gaussian(), lam / c0)
            rough = config.model_copy(update={"method": "cg", "tol": 1e-2})
            start = torch.zeros_like(labels)
            u, _, _ = solve_affine(layer.w1, layer.w2, labels - s0, None, None, start, rough)
            return family.sigma(family.sigma_inv(u + s0))
