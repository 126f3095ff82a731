"""The inpainter: a Gaussian kGLM-DEQ whose kernel is restricted to the observed pixels (DESIGN §2.4).

With ``M`` the diagonal of observed pixels (``missing == 0``) the equilibrium is

    z = M K M (y − z)/λ + m,

so on the observed set ``z_O = m_O + K_OO(K_OO + λI)⁻¹(y_O − m_O)`` and the
readout at every pixel is ``η̃ = m + K M (y − z)/λ`` — at a missing pixel
``m + K_{·O}(K_OO + λI)⁻¹(y_O − m_O)``, the kernel-ridge prediction. Known
pixels are returned unchanged. The mask is per pixel (shared by the channels).

With a network (``kdeq.maths.guidenet``, ``condition = "mask"``) the prior mean is its
pilot ``m = p``: the output at a missing pixel is the pilot corrected by the
kernel-ridge interpolation of its residual on the observed pixels.
"""

from __future__ import annotations

import torch

from kdeq.maths.families import Gaussian
from kdeq.maths.filters import normalized_convolution
from kdeq.maths.guidenet import inpaint_pilot
from kdeq.maths.operators import Restriction
from kdeq.predictors.base import (
    GaussianPosterior,
    Prediction,
    Predictor,
    Sizes,
    SolverOverride,
    per_image,
    valid_region,
)
from kdeq.predictors.spec import ModelSpecBase
from kdeq.predictors.uncertainty import conv_kernel, probe_spacing


class Inpainter(Predictor):
    """Fill the missing pixels of a batch; see the module docstring."""

    task = "inpaint"
    network = "mask"

    @classmethod
    def check_spec(cls, spec: ModelSpecBase) -> None:
        super().check_spec(spec)
        if spec.architecture.net is not None and spec.mean != "normalized_convolution":
            raise ValueError("the inpainter's network adds to the normalized_convolution mean")

    @property
    def pads_exactly(self) -> bool:
        return self.config.architecture.padding == "zeros"

    @property
    def reach(self) -> int:
        """``ρ``: the equation of a pixel, ``z = M K M (y − z)/λ + m`` there, reads the image and the mask
        within ``ρ`` pixels of it, given the observed channel means (``level``): the kernel's radius
        for ``K``'s row, the normalised convolution's for ``m``, and the network's receptive field
        (``depth`` 3×3 layers on the 2×2-unshuffled image: ``2·depth + 1`` pixels)."""
        net = self.config.architecture.net
        mean = self.mean_taps.shape[0] // 2 if self.config.mean == "normalized_convolution" else 0
        pilot = 0 if net is None else 2 * net.depth + 1
        return max(self.tensors["w1"].shape[-1] // 2, mean, pilot)

    @property
    def solve_reach(self) -> int:
        """``coupled_reach``: the observed pixels' equilibrium couples them through ``(K_OO + λI)⁻¹``
        beyond the reach."""
        return self.coupled_reach(self.reach)

    def forward(
        self,
        images: torch.Tensor,
        missing: torch.Tensor,
        solver: SolverOverride | None = None,
        sizes: Sizes | None = None,
        level: torch.Tensor | None = None,
    ) -> Prediction:
        """``images`` ``(B, c, H, W)``; ``missing`` ``(B, 1, H, W)`` or ``(B, H, W)``, non-zero = missing;
        ``sizes`` each image's ``(h, w)`` in a padded batch (``kdeq.predictors.base``); ``level`` ``(B, c)``
        the observed pixels' channel means in place of each image's own (a tile's whole image's,
        ``kdeq.serving.tiling``): the mean where no observed pixel is near and what the network centres on.
        With it an image may have no observed pixel (a tile inside a hole).

        Values of ``images`` at missing pixels are ignored.
        """
        if sizes is not None and not self.pads_exactly:
            raise ValueError(f"{self.name} cannot batch images of different sizes exactly")
        if level is not None and (sizes is not None or level.shape != images.shape[:2]):
            raise ValueError(f"level must be (B, c) = {tuple(images.shape[:2])}, for images of one size")
        x, observed = self._observed(images, missing, sizes, empty=level is not None)
        y = x * observed
        lam = self.lam(torch.zeros(x.shape[0], device=self.device))
        mean = self.prior_mean(y, observed, sizes, level)
        pilot_image = mean if self.config.architecture.net is not None else None
        out = self.conv_layer(Gaussian(), lam)(
            y, mean=mean, mean_out=mean, mask=observed, solver=self.solver(solver)
        )
        return Prediction(torch.where(observed > 0, x, out.eta), out.stats, lam, pilot=pilot_image)

    def gaussian_posterior(
        self,
        images: torch.Tensor,
        missing: torch.Tensor,
        solver: SolverOverride | None = None,
        level: torch.Tensor | None = None,
    ) -> GaussianPosterior:
        """``A = M`` (the observed pixels); ``K`` the bank; fixed ``λ``; ``s²`` by maximum likelihood
        around the model's mean (its network's pilot where it has one), from the image's own observed
        pixels: a tile (``level`` given, ``kdeq.serving.tiling``) with none has no estimate, and is
        refused. Arguments as ``forward``'s, one image size (no ``sizes``)."""
        x, observed = self._observed(images, missing, None, empty=level is not None)
        if bool((observed.sum(dim=(1, 2, 3)) == 0).any()):
            raise ValueError(
                "a tile of the image has no observed pixel, so its uncertainty cannot be estimated from it: "
                "ask without uncertainty, or for a smaller image, solved whole"
            )
        y = x * observed
        lam = self.lam(torch.zeros(x.shape[0], device=x.device)).double()
        mean = self.prior_mean(y, observed, None, level)
        op = Restriction(observed.double())
        centred = op.forward((x - (0.0 if mean is None else mean)).double())
        kernel, stationary = conv_kernel(self, x.shape[0])
        spacing = probe_spacing(stationary.taps.shape[-1] // 2)
        return GaussianPosterior(kernel, op, lam, None, centred, tuple(x.shape), stationary, spacing)

    def prior_mean(
        self,
        y: torch.Tensor,
        observed: torch.Tensor,
        sizes: Sizes | None = None,
        level: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The prior mean ``m`` ``(B, c, H, W)`` of the observed values ``y = M⊙x`` and the mask ``M``
        ``(B, 1, H, W)``: the checkpoint's mean, then its network's pilot on it where it has one
        (``sizes`` and ``level`` as in ``forward``)."""
        level = None if level is None else level.to(y.device, y.dtype)
        if level is not None and self.config.mean == "normalized_convolution":
            mean = normalized_convolution(y, observed, self.mean_taps, level)
        else:
            mean = self.mean(y, observed, sizes)
        if self.config.architecture.net is not None:
            mean = self._pilot(y, observed, mean, sizes, level)
        return mean

    def pilot_only(self, images: torch.Tensor, missing: torch.Tensor) -> torch.Tensor:
        """The network's pilot ``p`` ``(B, c, H, W)`` without the solve (the trainer's pilot phase);
        arguments as in ``forward``. It is ``p`` at every pixel, the observed ones included: the
        solve corrects ``p`` by its residual there, so the pilot's loss covers them too."""
        if self.config.architecture.net is None:
            raise ValueError(f"{self.name} has no network")
        x, observed = self._observed(images, missing, None)
        return self.prior_mean(x * observed, observed)

    def _observed(
        self, images: torch.Tensor, missing: torch.Tensor, sizes: Sizes | None, empty: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The checked images ``(B, c, H, W)`` and their observed mask ``M`` ``(B, 1, H, W)``
        (0 on missing pixels and a padded batch's padding); an image without an observed pixel is
        refused unless ``empty``."""
        x = self.images(images)
        miss = torch.as_tensor(missing, device=self.device)
        if miss.dim() == 3:
            miss = miss[:, None]
        if miss.shape != (x.shape[0], 1, *x.shape[-2:]):
            raise ValueError(f"mask shape {tuple(miss.shape)} does not match the images {tuple(x.shape)}")
        observed = (miss == 0).to(torch.float32)
        valid = valid_region(x, sizes)
        if valid is not None:
            observed = observed * valid
        none = observed.sum(dim=(1, 2, 3)) == 0
        if not empty and bool(none.any()):
            raise ValueError(f"images {none.nonzero().flatten().tolist()} have no observed pixels")
        return x, observed

    def _pilot(
        self,
        y: torch.Tensor,
        observed: torch.Tensor,
        base: torch.Tensor,
        sizes: Sizes | None,
        level: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inpaint_pilot`` ``(B, c, H, W)``, each image of a padded batch on its own pixels."""
        net, t = self.config.architecture.net, self.tensors
        if sizes is None:
            return inpaint_pilot(y, observed, base, t, net, level)
        c = y.shape[1]
        both = torch.cat([y, observed, base], dim=1)
        return per_image(
            lambda v: inpaint_pilot(v[:, :c], v[:, c : c + 1], v[:, c + 1 :], t, net), both, sizes
        )
