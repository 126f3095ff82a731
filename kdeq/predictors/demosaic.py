"""The demosaicker: a Gaussian kGLM-DEQ observed through a colour filter array (DESIGN §2.4).

A Bayer sensor records one colour per pixel: channel ``c`` of the ``(3, H, W)`` image is observed on
the sites ``O_c`` of the pattern that carry colour ``c`` (``cfa_mask``). With ``M`` the diagonal of the
observed (channel, pixel) pairs and ``K`` a coregionalised kernel over the three channels
(``kdeq.maths.kernels.Coregional``: the channels' covariance lets green, sampled twice as densely,
inform red and blue), the equilibrium is the inpainter's with a per-channel mask,

    z = M K M (y − z)/λ + m,

and the readout at every (channel, pixel) is ``f = m + K M (y − z)/λ``, that is

    f = m + K Aᵀ (A K Aᵀ + λI)⁻¹ (y − A m),

``A`` the restriction to the observed pairs, ``m`` the checkpoint's mean of each channel's own samples
(``Predictor.mean``; the shipped model's: their normalised convolution) and ``λ`` fixed. Observed
samples are returned unchanged.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from kdeq.maths.families import Gaussian
from kdeq.predictors.base import Prediction, Predictor, Sizes, SolverOverride, valid_region
from kdeq.predictors.spec import ConvArchitecture, ModelSpecBase

Pattern = Literal["RGGB", "BGGR", "GRBG", "GBRG"]

#: the channel index of each colour letter of a pattern
_CHANNEL = {"R": 0, "G": 1, "B": 2}


def cfa_mask(pattern: Pattern, height: int, width: int, device: torch.device | None = None) -> torch.Tensor:
    """The observed set of a Bayer ``pattern`` on an ``H×W`` sensor: ``(3, H, W)`` bool, channel ``c``
    true where the pixel records colour ``c``. The pattern's four letters are the colours of the 2×2
    tile at the top-left corner, row by row (``RGGB``: red at ``(0, 0)``, blue at ``(1, 1)``)."""
    if pattern not in get_args(Pattern):
        raise ValueError(f"unknown Bayer pattern {pattern!r}; use RGGB, BGGR, GRBG or GBRG")
    rows = torch.arange(height, device=device)[:, None] % 2
    cols = torch.arange(width, device=device)[None, :] % 2
    site = 2 * rows + cols  # the pixel's position in the 2×2 tile, row-major
    colour = torch.tensor([_CHANNEL[letter] for letter in pattern], device=device)[site]
    return colour[None] == torch.arange(3, device=device)[:, None, None]


class Demosaicker(Predictor):
    """Reconstruct a colour image from its Bayer samples; see the module docstring."""

    task = "demosaic"

    @classmethod
    def check_spec(cls, spec: ModelSpecBase) -> None:
        """Also: a coregional kernel over the 3 colour channels (so that one colour informs another) and
        a fixed ``λ`` (a mosaic's samples carry no noise level)."""
        super().check_spec(spec)
        arch = spec.architecture
        if not isinstance(arch, ConvArchitecture) or arch.kernel.channels != 3:
            raise ValueError("a demosaicking model's kernel is coregional over the 3 colour channels")
        if spec.lam.rule != "fixed":
            raise ValueError("a demosaicking model's λ is fixed")

    @property
    def pads_exactly(self) -> bool:
        return self.config.architecture.padding == "zeros"

    def forward(
        self,
        images: torch.Tensor,
        pattern: Pattern = "RGGB",
        solver: SolverOverride | None = None,
        sizes: Sizes | None = None,
    ) -> Prediction:
        """``images`` ``(B, 1, H, W)``, a Bayer mosaic (one sample per pixel), or ``(B, 3, H, W)``, read
        at each pixel's own colour of ``pattern`` only (the rest ignored); ``sizes`` each image's
        ``(h, w)`` in a padded batch (``kdeq.predictors.base``), every image's pattern starting at its
        top-left corner. Returns the ``(B, 3, H, W)`` colour image."""
        if sizes is not None and not self.pads_exactly:
            raise ValueError(f"{self.name} cannot batch images of different sizes exactly")
        if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] not in (1, 3):
            raise ValueError("images must be a (B, 1, H, W) mosaic or (B, 3, H, W) colour images")
        # a mosaic's one sample per pixel is read as that pixel's colour: the same in every channel
        x = self.images(images.expand(-1, 3, -1, -1))
        observed = cfa_mask(pattern, *x.shape[-2:], device=x.device)[None].to(x.dtype)
        valid = valid_region(x, sizes)
        observed = observed if valid is None else observed * valid
        y = x * observed
        lam = self.lam(torch.zeros(x.shape[0], device=self.device))
        mean = self.mean(y, observed, sizes)
        out = self.conv_layer(Gaussian(), lam)(
            y, mean=mean, mean_out=mean, mask=observed, solver=self.solver(solver)
        )
        return Prediction(torch.where(observed > 0, x, out.eta), out.stats, lam)
