"""The deblurrer: undo a known blur, ``y = h * f + ε``, as the kGLM-DEQ observed through ``A = H``.

The deblurrer is kernel ridge regression through the blur (DESIGN §2 fact 8): with the prior mean
``m`` (the image's global mean) and ``λ = λ(σ)`` from the noise level (given or estimated),

    f = m + K Hᵀ (H K Hᵀ + λI)⁻¹ (y − H m),

the posterior mean of a Gaussian process ``f ~ GP(m, K/s²…)`` seen through the blur. ``H`` is the
convolution with the PSF under the model's border rule (``kdeq.maths.operators.Blur``). With a
``symmetric`` border, a PSF even in each axis (Gaussian, disk, horizontal or vertical motion) and
a symmetric-border kernel, ``H K Hᵀ`` is diagonal in the DCT-II and the solve is one transform
(``kdeq.maths.operators.Sandwich``); any other PSF takes CG.

With the adaptive kernel (a ``guided`` architecture, DESIGN §2.5) the same regression is solved
twice: first with a flat guide, where the normalised kernel is the stationary ``k_s/Σk_s`` (the
first solve ``f₀``, a symmetric border: one transform for an even PSF), then with
``K̃ = D^{-1/2} K D^{-1/2}`` for ``k(x, x') = k_s(x − x')·exp(−‖g(x) − g(x')‖²/2h²)`` on patches
of the smoothed ``g = G∗f₀``, ``h²`` from the guide's own estimated noise (the deconvolution
amplifies the observations'), and ``K̃``'s local average ``D⁻¹K f₀`` as the mean (CG, a handful of
iterations). The kernel follows the image's edges, so the second solve sharpens them without
ringing across them. The statistics are both solves' (``kdeq.maths.solvers.chained``: iterations
summed, the worse residual, converged when both did); the prediction's ``pilot`` is ``f₀``.

With a network (``kdeq.maths.guidenet``, ``condition = "sigma"``) its pilot ``p`` of ``f₀`` is the guide
and, mixed by ``β``, the mean ``(1 − β)·D⁻¹K f₀ + β·p``: the denoiser's network, removing what the
deconvolution left. At the kGLM start (``p = G∗f₀``, ``β = 0``) the model is the one without.

A ``pnp`` architecture is a denoiser plugged into the blur (``kdeq.maths.pnp``): ``steps`` alternations of
the data step, the same regression with the white kernel ``K = I`` around the last denoised image
(one DCT transform for an even PSF), and the embedded denoiser at a decreasing noise level, the
checkpoint's ``λ`` rule weighing the two; the statistics sum every solve's iterations.

Its posterior (``gaussian_posterior``, ``kdeq.predictors.uncertainty``) is the Gaussian model ``A = H``
with the stationary bank, or the adaptive kernel given the first solve ``f₀``; the plug-and-play
deblurrer has none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kdeq.maths.adaptive import GuidedMap, GuidedOperator, weight_budget
from kdeq.maths.filters import separable_blur
from kdeq.maths.guidenet import pilot
from kdeq.maths.noise import haar_sigma
from kdeq.maths.operators import Blur, KernelMap, solve_observed
from kdeq.maths.pnp import noise_schedule, plug_and_play
from kdeq.maths.psf import check_psf
from kdeq.maths.solvers import SolverConfig, SolverStats, chained
from kdeq.predictors.base import GaussianPosterior, Prediction, Predictor, SolverOverride
from kdeq.predictors.denoise import Denoiser
from kdeq.predictors.spec import (
    Checkpoint,
    GuidedArchitecture,
    ModelSpecBase,
    NoiseLambda,
    PlugAndPlayArchitecture,
    prior_checkpoint,
)
from kdeq.predictors.uncertainty import (
    conv_kernel,
    guided_kernel,
    noise_amplitude,
    probe_spacing,
)


class Deblurrer(Predictor):
    """Gaussian kGLM deblurrer; see the module docstring."""

    task = "deblur"
    architectures = ("conv", "guided", "pnp")
    network = "sigma"
    reads = frozenset({"w1", "spatial", "smoothing"})

    @classmethod
    def check_spec(cls, spec: ModelSpecBase) -> None:
        super().check_spec(spec)
        arch = spec.architecture
        if arch.kind == "pnp":
            if not isinstance(spec.lam, NoiseLambda) or spec.mean != "none" or spec.solver.method != "cg":
                raise ValueError(
                    "the plug-and-play deblurrer weighs its steps by the noise λ rule, takes its mean "
                    "from the prior (mean none) and solves its data steps by CG"
                )
            return
        if arch.kind == "guided":
            if not arch.kernel.normalize or spec.mean != "local":
                raise ValueError("the guided deblurrer's kernel is normalised, with its own local mean")
            return
        if arch.kernel.channels != 1:
            raise ValueError("the deblurrer applies one kernel to every channel (channels = 1)")
        if arch.padding not in ("zeros", "symmetric"):
            raise ValueError("the deblurrer's border (padding) is zeros or symmetric")
        if spec.mean not in ("none", "global"):
            raise ValueError("the deblurrer's mean is none or global")

    def __init__(self, checkpoint: Checkpoint, device: str | torch.device = "cpu") -> None:
        super().__init__(checkpoint, device)
        #: factor on the guided kernel's bandwidth ``h`` (learned by the trainer, 1 when loaded)
        self.bandwidth_scale: float | torch.Tensor = 1.0
        #: bytes the guided kernel's weight maps may take before they are recomputed per use
        self.weight_budget = weight_budget(self.device)
        #: a ``pnp`` model's denoiser on the same device (``None`` for the others; ``kdeq train``
        #: refuses ``pnp`` models, so it keeps the tensors it was built with)
        self.prior = Denoiser(prior_checkpoint(checkpoint), self.device) if self.plug_and_play else None

    def forward(
        self,
        images: torch.Tensor,
        psf: torch.Tensor,
        sigma: float | Sequence[float] | torch.Tensor | None = None,
        solver: SolverOverride | None = None,
    ) -> Prediction:
        """Deblur ``images`` ``(B, c, H, W)`` blurred by ``psf`` ``(k, k)`` (odd sides, normalised to
        sum 1 here); ``sigma`` the noise level on the 0–255 scale, scalar or ``(B,)``, estimated per
        image when ``None``. ``output`` is ``f`` ``(B, c, H, W)``."""
        x = self.images(images)
        blur = self._blur(psf)
        s = self.noise_level(x, sigma)
        lam = self.lam(s)
        cfg = self.solver(solver)
        if self.prior is not None:
            return self._plug_and_play(blur, x, s, lam, cfg, solver)
        if not self.guided:
            kernel = KernelMap(self.tensors["w1"], torch.ones_like(lam), self.config.architecture.padding)
            f, stats = solve_observed(blur, kernel, x, lam, self.mean(x), cfg)
            return Prediction(f, stats, lam, sigma=s * 255.0)
        f0, first = self._first(blur, x, lam, cfg)
        kern = self.config.architecture.kernel
        guide, learned = self._guide(f0, s)
        # the guide's own noise (the deconvolution amplifies the observations'), per image; the Haar
        # estimate for colour too: the deconvolution's noise is not white, which the patch estimate
        # assumes, and the bandwidth was chosen with this one
        h2 = kern.h2(x.shape[1], haar_sigma(guide)) * self.bandwidth_scale**2
        spatial, budget = self.tensors["spatial"], self.weight_budget
        op = GuidedOperator(guide, spatial, kern.patch_radius, h2, kern.normalize, budget, mean_of=f0)
        mean = op.local_mean
        if learned is not None:
            beta = self.tensors["net_mean_mix"]
            mean = beta * learned + (1 - beta) * mean
        f, stats = solve_observed(blur, GuidedMap(op, torch.ones_like(lam)), x, lam, mean, cfg)
        stats = chained([first, stats])
        return Prediction(f, stats, lam, sigma=s * 255.0, pilot=f0 if learned is None else learned)

    def _plug_and_play(
        self,
        blur: Blur,
        x: torch.Tensor,
        s: torch.Tensor,
        lam: torch.Tensor,
        cfg: SolverConfig,
        solver: SolverOverride | None,
    ) -> Prediction:
        """``kdeq.maths.pnp.plug_and_play`` from the observations ``x`` ``(B, c, H, W)`` at levels ``s``
        ``(B,)`` (``λ = λ(s)``, the schedule ending at ``s`` floored as ``λ``'s rule floors it),
        with the embedded denoiser at each ``σ_k``. The request's ``solver`` override applies to every
        solve, the data steps' (``cfg``) and the denoiser's, so that its tolerance and step budget
        are what the reported statistics are held to."""
        arch = self.config.architecture
        final = s.clamp(min=self.config.lam.min_sigma / 255.0)
        levels = noise_schedule(arch.start_sigma / 255.0, final, arch.steps)

        def denoise(v: torch.Tensor, level: torch.Tensor) -> tuple[torch.Tensor, SolverStats]:
            out = self.prior.forward(v, sigma=level * 255.0, solver=solver)
            return out.output, out.stats

        f, stats = plug_and_play(blur, x, x, lam, levels, denoise, cfg)
        return Prediction(f, stats, lam, sigma=s * 255.0)

    def gaussian_posterior(
        self,
        images: torch.Tensor,
        psf: torch.Tensor,
        sigma: float | Sequence[float] | torch.Tensor | None = None,
        solver: SolverOverride | None = None,
    ) -> GaussianPosterior:
        """``A = H``; ``K`` the bank (conv) or the second solve's adaptive kernel, guided by the first
        solve ``f₀`` (its posterior given ``f₀``); ``λ = λ(σ)``, ``s² = σ²/λ``. The plug-and-play
        deblurrer's output is no Gaussian posterior mean: refused. Arguments as ``forward``'s."""
        if self.plug_and_play:
            raise ValueError(f"{self.name}: a plug-and-play deblurrer has no Gaussian posterior")
        x = self.images(images)
        blur = self._blur(psf)
        s = self.noise_level(x, sigma)
        lam = self.lam(s)
        amplitude = noise_amplitude(self, s, lam)
        op = Blur(blur.psf.double(), blur.border)
        if not self.guided:
            kernel, stationary = conv_kernel(self, x.shape[0])
            spacing = probe_spacing(stationary.taps.shape[-1] // 2)
            shape = tuple(x.shape)
            return GaussianPosterior(kernel, op, lam.double(), amplitude, None, shape, stationary, spacing)
        f0, _ = self._first(blur, x, lam, self.solver(None))
        guide, _ = self._guide(f0, s)
        kern = self.config.architecture.kernel
        h2 = kern.h2(x.shape[1], haar_sigma(guide)) * self.bandwidth_scale**2  # as forward
        kernel = guided_kernel(self, guide, h2)
        spacing = probe_spacing(self.tensors["spatial"].shape[0] // 2)
        return GaussianPosterior(kernel, op, lam.double(), amplitude, None, tuple(x.shape), None, spacing)

    def pilot_only(
        self,
        images: torch.Tensor,
        psf: torch.Tensor,
        sigma: float | Sequence[float] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The network's pilot ``p`` ``(B, c, H, W)`` alone, on the first solve (the trainer's pilot
        phase; the solve is not differentiated); arguments as ``forward``'s."""
        if not self.guided or self.config.architecture.net is None:
            raise ValueError(f"{self.name} has no network")
        x = self.images(images)
        s = self.noise_level(x, sigma)
        with torch.no_grad():
            f0, _ = self._first(self._blur(psf), x, self.lam(s), self.solver(None))
        return self._guide(f0, s)[1]

    def _blur(self, psf: torch.Tensor | np.ndarray) -> Blur:
        """``H`` for ``psf`` ``(k, k)`` (normalised to sum 1) under the model's border rule."""
        h = check_psf(psf.detach().cpu() if isinstance(psf, torch.Tensor) else psf).to(self.device)
        arch = self.config.architecture
        return Blur(h, arch.padding if arch.kind == "conv" else "symmetric")

    def _first(
        self, blur: Blur, x: torch.Tensor, lam: torch.Tensor, cfg: SolverConfig
    ) -> tuple[torch.Tensor, SolverStats]:
        """The first solve ``f₀`` ``(B, c, H, W)``: the same regression with a flat guide, whose
        normalised kernel is ``k_s/Σk_s`` (symmetric border), around the images' global means."""
        spatial = self.tensors["spatial"]
        flat = KernelMap((spatial / spatial.sum())[None, None], torch.ones_like(lam), "symmetric")
        return solve_observed(blur, flat, x, lam, x.mean(dim=(-2, -1), keepdim=True).expand_as(x), cfg)

    def _guide(self, first: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The second solve's guide ``g`` and the network's pilot ``p`` (``None`` without one),
        ``(B, c, H, W)``, from the first solve ``f₀`` of images at noise levels ``s`` ``(B,)`` in [0, 1]
        units: ``g = G∗f₀`` without a network; with one, ``p`` of ``f₀`` (``kdeq.maths.guidenet.pilot``,
        ``σ`` floored as ``λ``'s rule floors it) and ``g = p``, not differentiated (the network learns
        through the mean and its own loss, as the denoiser's)."""
        smooth = separable_blur(first, self.tensors["smoothing"])
        net = self.config.architecture.net
        if net is None:
            return smooth, None
        rule = self.config.lam
        level = s.clamp(min=rule.min_sigma / 255.0) if isinstance(rule, NoiseLambda) else s
        learned = pilot(first, smooth, level, self.tensors, net)
        return learned.detach(), learned

    @property
    def guided(self) -> bool:
        """Whether the kernel is the adaptive one, guided by the stationary model's pilot."""
        return isinstance(self.config.architecture, GuidedArchitecture)

    @property
    def plug_and_play(self) -> bool:
        """Whether the model is a denoiser plugged into the blur (``kdeq.maths.pnp``)."""
        return isinstance(self.config.architecture, PlugAndPlayArchitecture)
