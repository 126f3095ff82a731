"""The denoiser: kernel ridge regression on the noisy image as a Gaussian kGLM-DEQ.

For observations ``y`` with noise level ``σ`` the equilibrium is

    z = (K/λ)(y − z) + m,      λ = λ(σ)  (DESIGN §2.6),

i.e. ``z = m + K(K + λI)⁻¹(y − m)``, the posterior mean of a Gaussian process
with prior ``N(m, K/s²·…)``. Two kernels:

- ``conv``: a stationary tapered kernel as convolutions (Corollary 11), with
  the image's global mean;
- ``guided``: the adaptive kernel of ``kdeq.maths.adaptive`` on (position, patch of
  the pre-smoothed image), computed per image, symmetrically normalised, with
  the kernel's own local average ``D⁻¹K y`` as the mean (Appendix H). With a
  guide network (``kdeq.maths.guidenet``) the guide is its pilot ``p`` and the mean
  ``(1 − β)·D⁻¹K y + β·p``; with a refinement (``kdeq.maths.refine``) a grey image's pilot, and a colour
  one's with the refinement's colour network, is first mixed per pixel with the non-local means of
  the kernel's own patch distances.

``σ`` is given per call (0–255 scale) or estimated per image (``kdeq.maths.noise``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kdeq.maths import collab, sure
from kdeq.maths.adaptive import GuidedMap, GuidedOperator, weight_budget
from kdeq.maths.deq import KGLMDEQ
from kdeq.maths.families import Gaussian
from kdeq.maths.filters import separable_blur
from kdeq.maths.guidenet import Refine, from_opponent, pilot, to_opponent
from kdeq.maths.operators import Identity
from kdeq.maths.refine import refined_pilot, refines
from kdeq.predictors.base import (
    GaussianPosterior,
    Prediction,
    Predictor,
    Sizes,
    SolverOverride,
    per_image,
    valid_region,
)
from kdeq.predictors.spec import Checkpoint, GuidedArchitecture, ModelSpecBase, NoiseLambda
from kdeq.predictors.uncertainty import (
    conv_kernel,
    guided_kernel,
    noise_amplitude,
    probe_spacing,
)


class Denoiser(Predictor):
    """Gaussian-family denoiser; see the module docstring."""

    task = "denoise"
    architectures = ("conv", "guided")
    network = "sigma"
    extras = frozenset({"chroma", "refine"})

    @classmethod
    def check_spec(cls, spec: ModelSpecBase) -> None:
        super().check_spec(spec)
        if spec.architecture.net is not None and spec.architecture.kind != "guided":
            raise ValueError("the denoiser's network is the guided kernel's guide: use a guided architecture")
        if getattr(spec.architecture, "chroma", "solved") == "prior_mean" and spec.mean == "none":
            raise ValueError("chroma 'prior_mean' leaves the colour differences at the mean: it needs one")

    def __init__(self, checkpoint: Checkpoint, device: str | torch.device = "cpu") -> None:
        super().__init__(checkpoint, device)
        #: factor on the guided kernel's bandwidth ``h`` (learned by the trainer, 1 when loaded)
        self.bandwidth_scale: float | torch.Tensor = 1.0
        #: bytes the guided kernel's weight maps may take before they are recomputed per use
        self.weight_budget = weight_budget(self.device)

    @property
    def pads_exactly(self) -> bool:
        arch = self.config.architecture
        return isinstance(arch, GuidedArchitecture) or arch.padding == "zeros"

    @property
    def reach(self) -> int:
        """``ρ``: the solve's operator rows and mean at a pixel depend on the image within ``ρ`` pixels
        of it (given ``σ`` and ``level``), so a tile whose halo is ``ρ`` poses its core's rows exactly.

        Guided: the pilot reads ``2·depth + 1`` pixels (3×3 layers on the 2×2-unshuffled image), the
        pre-smoothing its radius; a weight ``w(x, x + o)``, ``|o|∞ ≤ R``, reads the guide's patches
        (radius ``p``) at both ends, and the normalisation ``d(x + o)`` another ``R``; a refined pilot
        ``p'`` (``kdeq.maths.refine``) the non-local mean within its network's reach (a patch-aggregated mean
        reads ``p + R`` further), or the collaborative filter (``kdeq.maths.collab.reach``) and the matches'
        spread. Stationary: the kernel's radius. Either: at least a normalised-convolution mean's
        radius."""
        arch = self.config.architecture
        mean = self.mean_taps.shape[0] // 2 if self.config.mean == "normalized_convolution" else 0
        if isinstance(arch, GuidedArchitecture):
            guide = self.tensors["smoothing"].shape[0] // 2
            if arch.net is not None:
                guide = max(guide, 2 * arch.net.depth + 1)
            window = arch.kernel.spatial.radius
            rows = guide + arch.kernel.patch_radius + 2 * window
            refine = None if arch.net is None else arch.net.refine
            if refine is not None:
                # p' reads ν within H_φ's reach (2·depth + 1), ν the guide's patches a window away;
                # aggregated by patch, the patches covering a pixel (p more) and the normalisation of
                # their matches (a window more)
                reads = arch.kernel.patch_radius + window
                reads *= 2 if refine.aggregate == "patch" else 1
                rows = max(rows, guide + reads + 2 * refine.depth + 1)
                if refine.estimate == "collaborative":
                    # the filter reads y alone, no guide: its reach, then H_φ's
                    filter_reach = collab.reach(refine.search_radius, refine.patch_radius)
                    rows = max(rows, filter_reach + 2 * refine.depth + 1)
            return max(rows, mean)
        return max(self.tensors["w1"].shape[-1] // 2, mean)

    @property
    def solve_reach(self) -> int:
        """The halo a tile needs for its core's *solution* to match the whole image's to the solver's
        tolerance: ``reach`` plus, for a stationary kernel, four of its radii. The equilibrium couples
        pixels through ``(K + λI)⁻¹`` beyond ``reach``; the guided kernel's edge-stopping weights and
        its pilot mean, already close to the answer (1–3 CG steps), keep that coupling within its
        reach, while the stationary kernel's 9–15 steps carry it further (``tests/test_tiling.py``
        measures both at this halo)."""
        arch = self.config.architecture
        if isinstance(arch, GuidedArchitecture):
            return self.reach
        return self.coupled_reach(self.reach)

    def forward(
        self,
        images: torch.Tensor,
        sigma: float | Sequence[float] | torch.Tensor | None = None,
        solver: SolverOverride | None = None,
        sizes: Sizes | None = None,
        level: torch.Tensor | None = None,
    ) -> Prediction:
        """Denoise ``images`` ``(B, c, H, W)``; ``sigma`` on the 0–255 scale, scalar or ``(B,)``;
        ``sizes`` each image's ``(h, w)`` in a padded batch (``kdeq.predictors.base``); ``level`` ``(B, c)``
        the per-channel means that the guide network centres on and a ``global`` mean is, in place of
        each image's own (a tile's whole image's, ``kdeq.serving.tiling``)."""
        if sizes is not None and not self.pads_exactly:
            raise ValueError(f"{self.name} cannot batch images of different sizes exactly")
        x = self.images(images)
        if level is not None and (sizes is not None or level.shape != x.shape[:2]):
            raise ValueError(f"level must be (B, c) = {tuple(x.shape[:2])}, for images of one size")
        level = None if level is None else level.to(x.device, x.dtype)
        valid = valid_region(x, sizes)
        s = self.noise_level(x, sigma, sizes)
        lam = self.lam(s)
        cfg = self.solver(solver)
        if isinstance(self.config.architecture, GuidedArchitecture):
            layer, mean, pilot_image = self._guided(x, self._guide_level(s), lam, sizes, valid, level)
            if not self.luminance_only(x.shape[1]):
                out = layer(x, mean=mean, mean_out=mean, solver=cfg)
                return Prediction(out.eta, out.stats, lam, sigma=s * 255.0, pilot=pilot_image)
            y, m = to_opponent(x), to_opponent(mean)
            m0 = m[:, :1]
            out = layer(y[:, :1], mean=m0, mean_out=m0, solver=cfg)
            eta = from_opponent(torch.cat([out.eta, m[:, 1:]], dim=1))
            return Prediction(eta, out.stats, lam, sigma=s * 255.0, pilot=pilot_image)
        layer = self.conv_layer(Gaussian(), lam)
        mean = self._mean(x, valid, sizes, level)
        out = layer(x, mean=mean, mean_out=mean, mask=valid, solver=cfg)
        return Prediction(out.eta, out.stats, lam, sigma=s * 255.0)

    def gaussian_posterior(
        self,
        images: torch.Tensor,
        sigma: float | Sequence[float] | torch.Tensor | None = None,
        solver: SolverOverride | None = None,
        level: torch.Tensor | None = None,
    ) -> GaussianPosterior:
        """``A = I``; ``K`` the stationary bank or the adaptive kernel of the image's guide (as
        ``forward`` builds it); ``λ = λ(σ)``, ``s² = σ²/λ``. Arguments as ``forward``'s, one image size
        (no ``sizes``)."""
        x = self.images(images)
        s = self.noise_level(x, sigma)
        lam = self.lam(s).double()
        amplitude = noise_amplitude(self, s, lam)
        if isinstance(self.config.architecture, GuidedArchitecture):
            level_s = self._guide_level(s)
            op = self._posterior_kernel(x, level_s, None if level is None else level.to(x))
            spacing = probe_spacing(self.tensors["spatial"].shape[0] // 2)
            post = GaussianPosterior(op, Identity(), lam, amplitude, None, tuple(x.shape), None, spacing)
            if self.luminance_only(x.shape[1]):
                post = dataclasses.replace(post, prior_diag=op.diagonal(), prior_share=2 / 3)
            return post
        kernel, stationary = conv_kernel(self, x.shape[0])
        spacing = probe_spacing(stationary.taps.shape[-1] // 2)
        return GaussianPosterior(
            kernel, Identity(), lam, amplitude, None, tuple(x.shape), stationary, spacing
        )

    def _posterior_kernel(
        self, x: torch.Tensor, s: torch.Tensor, level: torch.Tensor | None = None
    ) -> GuidedOperator:
        """The adaptive ``K̃`` of images ``x`` ``(B, c, H, W)`` at guide noise levels ``s`` ``(B,)``, as
        ``guided_operator`` builds it, in float64 (``kdeq.predictors.uncertainty.guided_kernel``)."""
        guide, _ = self.guide(x, s, None, level)
        return guided_kernel(self, guide, self.guide_h2(x.shape[1], s))

    def luminance_only(self, channels: int) -> bool:
        """Whether a ``channels``-channel image has its luminance alone solved: a colour image under
        ``chroma = prior_mean``. In the opponent basis ``Q`` (``kdeq.maths.guidenet.opponent``) the solve is
        then ``z₀ = m₀ + K̃(K̃ + λI)⁻¹(y₀ − m₀)`` and ``z_k = m_k`` for ``k = 1, 2`` (their ``λ`` infinite),
        ``z = Qᵀ(z₀, z₁, z₂)``; ``K̃`` acts on each channel alike, so ``m = Q(RGB mean)`` is the mean of
        the rotated image."""
        arch = self.config.architecture
        return channels == 3 and isinstance(arch, GuidedArchitecture) and arch.chroma == "prior_mean"

    def _mean(
        self, x: torch.Tensor, valid: torch.Tensor | None, sizes: Sizes | None, level: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``Predictor.mean`` ``(B, c, H, W)``, a ``global`` one being ``level`` when given."""
        if level is not None and self.config.mean == "global":
            return level[..., None, None].expand_as(x)
        return self.mean(x, valid, sizes)

    def _guide_level(self, s: torch.Tensor) -> torch.Tensor:
        """``σ`` ``(B,)`` floored as the ``λ`` rule floors it, for the guide and its bandwidth."""
        rule = self.config.lam
        return s.clamp(min=rule.min_sigma / 255.0) if isinstance(rule, NoiseLambda) else s

    def pilot_only(
        self, images: torch.Tensor, sigma: float | Sequence[float] | torch.Tensor | None = None
    ) -> torch.Tensor:
        """The guide network's pilot ``p`` ``(B, c, H, W)`` of ``images`` alone, without the solve
        (the trainer's pilot phase); ``sigma`` as in ``forward``."""
        arch = self.config.architecture
        if not isinstance(arch, GuidedArchitecture) or arch.net is None:
            raise ValueError(f"{self.name} has no guide network")
        x = self.images(images)
        return self.guide(x, self._guide_level(self.noise_level(x, sigma)))[1]

    def guide(
        self,
        x: torch.Tensor,
        s: torch.Tensor,
        sizes: Sizes | None = None,
        level: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The guided kernel's guide ``g`` and the guide network's pilot ``p`` (``None`` without one),
        ``(B, c, H, W)``, for images ``x`` at noise levels ``s`` ``(B,)`` in [0, 1] units (``level``
        as in ``forward``)."""
        arch = self.config.architecture
        taps = self.tensors["smoothing"]
        guide = (
            separable_blur(x, taps)
            if sizes is None
            else per_image(lambda v: separable_blur(v, taps), x, sizes)
        )
        if arch.net is None:
            return guide, None
        net, t = arch.net, self.tensors
        if sizes is None:
            pilot_image = pilot(x, guide, s, t, net, level)
        else:
            pilot_image = torch.zeros_like(x)
            for k, (h, w) in enumerate(sizes):
                part = pilot(x[k : k + 1, :, :h, :w], guide[k : k + 1, :, :h, :w], s[k : k + 1], t, net)
                pilot_image[k, :, :h, :w] = part[0]
        # the weight maps are not differentiated: the guide is learned through the mean and the
        # pilot's own loss, which keeps training at the cost of the no-autograd kernel
        return pilot_image.detach(), pilot_image

    def guided_operator(
        self,
        x: torch.Tensor,
        s: torch.Tensor,
        sizes: Sizes | None = None,
        level: torch.Tensor | None = None,
        mean_of: torch.Tensor | None = None,
    ) -> tuple[GuidedOperator, torch.Tensor | None]:
        """The adaptive kernel ``K`` of the guide of images ``x`` ``(B, c, H, W)`` at noise levels ``s``
        ``(B,)`` in [0, 1] units, and the guide network's pilot ``p`` (``None`` without one); with
        ``mean_of`` ``v``, the operator's ``local_mean`` is ``D⁻¹K v``."""
        kern = self.config.architecture.kernel
        guide, pilot_image = self.guide(x, s, sizes, level)
        h2 = self.guide_h2(x.shape[1], s)
        op = GuidedOperator(
            guide,
            self.tensors["spatial"],
            kern.patch_radius,
            h2,
            kern.normalize,
            self.weight_budget,
            sizes,
            mean_of,
        )
        return op, pilot_image

    def guide_h2(self, channels: int, s: torch.Tensor) -> torch.Tensor:
        """The adaptive kernel's ``h²`` ``(B,)`` for a ``channels``-channel guide of images at noise
        levels ``s`` ``(B,)`` in [0, 1] units (times ``bandwidth_scale²``)."""
        kern = self.config.architecture.kernel
        # the guide's per-pixel noise: σ times the 2-D filter's ℓ2 norm ‖g⊗g‖₂ = ‖g‖₂²
        noise = s * self.tensors["smoothing"].square().sum()
        return kern.h2(channels, noise) * self.bandwidth_scale**2

    def _guided(
        self,
        x: torch.Tensor,
        s: torch.Tensor,
        lam: torch.Tensor,
        sizes: Sizes | None,
        valid: torch.Tensor | None,
        level: torch.Tensor | None,
    ) -> tuple[KGLMDEQ, torch.Tensor | None, torch.Tensor | None]:
        """The guided layer, its mean ``m`` and the guide network's pilot ``p`` (``None`` without one),
        each ``(B, c, H, W)``; with a non-local refinement (``kdeq.maths.refine``) a grey image's ``p'`` takes
        ``p``'s place in ``m``, and a colour image's with the refinement's colour network; with
        ``Refine.blend = "sure"`` a grey image's ``p'`` first moves toward the refinement's estimate ``ν``
        by SURE's weight, ``p' + b·(ν − p')`` (``kdeq.maths.sure``)."""
        local = self.config.mean == "local"
        refine = self.config.architecture.net.refine if self.config.architecture.net else None
        blend = refine is not None and refine.blend == "sure" and x.shape[1] == 1
        # probed before the image's own operator is built, so that the two are never held at once
        probe = self._probed_gap(x, s, sizes, level, refine) if blend else None
        op, pilot_image = self.guided_operator(x, s, sizes, level, mean_of=x if local else None)
        # a local mean keeps the padding's 0: it has no kernel mass (d = 0)
        mean = op.local_mean if local else self._mean(x, valid, sizes, level)
        if pilot_image is not None:
            p = pilot_image
            # a colour image only with a colour network: its kernel compares colour patches, whose matches
            # H_φ, trained on grey images, misreads (0.02-0.04 dB lost on unseen colour scenes,
            # docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "repeated texture through the mean")
            if refine is not None and refines(refine, x.shape[1]):
                p, nu = refined_pilot(op, x, pilot_image, s, self.tensors, refine, sizes)
                if probe is not None:
                    delta, step, probed_gap = probe
                    gap = (nu - p).detach()
                    div = sure.divergence(delta, gap, probed_gap, step, sizes)
                    b = sure.blend_weight(x, p.detach(), gap, div, s, sizes)
                    p = p + b.reshape(-1, 1, 1, 1) * (nu - p)
            beta = self.tensors["net_mean_mix"]
            mean = beta * p + (0.0 if mean is None else (1 - beta) * mean)
        layer = self.kglm_layer(Gaussian(), lam, lambda _, s: GuidedMap(op, s), tied=True)
        return layer, mean, pilot_image

    def _probed_gap(
        self,
        x: torch.Tensor,
        s: torch.Tensor,
        sizes: Sizes | None,
        level: torch.Tensor | None,
        refine: Refine,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For SURE's weight (``Refine.blend = "sure"``, ``kdeq.maths.sure``) of grey images ``x``
        ``(B, 1, H, W)`` at noise levels ``s`` ``(B,)``: the probe ``δ`` ``(B, 1, H, W)``, its step ``ε``
        ``(B,)`` and the gap ``ν − p'`` ``(B, 1, H, W)`` of the whole refinement (guide network, kernel,
        estimate, ``H_φ``) run on ``x + εδ``. Not differentiated: the weight is a constant to the
        training."""
        with torch.no_grad():
            delta = sure.probe(x, sizes)
            step = s * sure.STEP
            probed = x + step.to(x.dtype).reshape(-1, 1, 1, 1) * delta
            op, pilot_image = self.guided_operator(probed, s, sizes, level)
            p, nu = refined_pilot(op, probed, pilot_image, s, self.tensors, refine, sizes)
            return delta, step, nu - p
