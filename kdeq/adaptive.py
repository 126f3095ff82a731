"""Adaptive kernels: a kernel on augmented coordinates ``(position, guide feature)`` (DESIGN §2.5).

    k(x, x') = k_s(x − x') · exp(−‖g(x) − g(x')‖² / 2h²)

``k_s`` is a tapered stationary kernel of radius ``R`` (``kdeq.kernels``) and
``g(x)`` the ``(2p+1)²·c`` values of a guide image in the patch around ``x``
(borders mirrored). Both factors are PSD, so their product is (Schur); so is
``k(x, x')/√(d(x) d(x'))`` for positive ``d``, which with ``d = K1`` (the row
sums) is the symmetric normalisation used by default. The kernel is computed
per image and vanishes beyond ``R``, so it is stored as one weight map per
offset: ``w_o(x) = k(x, x + o)`` for the half set of offsets ``o`` (``(0,0)``
and those lexicographically positive), ``k(x + o, x)`` being the same number.

Shapes: guide and images ``(B, c, H, W)``; weights ``(B, O, H, W)`` with
``O = ((2R+1)² + 1)/2``; pixels outside the image have no weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from kdeq.filters import mirror_pad
from kdeq.kernels import Kernel


class GuidedKernel(BaseModel):
    """Hyperparameters of ``k_s(x − x')·exp(−‖g(x) − g(x')‖²/2h²)``.

    Attributes:
        spatial: ``k_s``; its radius bounds the support.
        patch_radius: ``p``; ``g(x)`` is the ``(2p+1)×(2p+1)`` patch around ``x``.
        bandwidth: ``h`` in units of the noise in the feature distance: with
            guide noise of standard deviation ``σ_g`` per pixel,
            ``h² = bandwidth² · 2·n·σ_g²``, ``n = c(2p+1)²`` (the expected
            ``‖g(x) − g(x')‖²`` of two noisy copies of one patch).
        normalize: use ``k/√(d(x)d(x'))`` with ``d = K1``.

    A checkpoint stores the taps of ``k_s`` (``spatial.filter()``) so they can be fine-tuned.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    spatial: Kernel = Kernel(profile="se", lengthscale=3.0, radius=6)
    patch_radius: int = Field(2, ge=0)
    bandwidth: float = Field(1.0, gt=0)
    normalize: bool = True

    def h2(self, channels: int, guide_sigma: torch.Tensor) -> torch.Tensor:
        """``h²`` per sample from the guide's per-pixel noise ``σ_g`` ``(B,)``."""
        n = channels * (2 * self.patch_radius + 1) ** 2
        return self.bandwidth**2 * 2.0 * n * guide_sigma**2


def half_offsets(radius: int) -> list[tuple[int, int]]:
    """``(0, 0)`` then the offsets ``o`` with ``|o|∞ ≤ R`` that are lexicographically positive."""
    rng = range(-radius, radius + 1)
    return [(0, 0)] + [(a, b) for a in rng for b in rng if a > 0 or (a == 0 and b > 0)]


def _box_sum(x: torch.Tensor, p: int) -> torch.Tensor:
    """Sum over ``(2p+1)²`` windows without padding: ``(B, 1, H+2p, W+2p) → (B, 1, H, W)``."""
    if p == 0:
        return x
    return F.avg_pool2d(x, 2 * p + 1, stride=1) * (2 * p + 1) ** 2


def _radius(weights: torch.Tensor) -> int:
    """``R`` from the number of weight maps ``O = ((2R+1)² + 1)/2``."""
    return math.isqrt(2 * weights.shape[1] - 1) // 2


def guided_weights(
    guide: torch.Tensor, spatial: torch.Tensor, patch_radius: int, h2: torch.Tensor
) -> torch.Tensor:
    """Weight maps ``w_o(x) = k_s(o)·exp(−‖g(x) − g(x+o)‖²/2h²)`` ``(B, O, H, W)``, unnormalised.

    ``guide`` ``(B, c, H, W)``; ``spatial`` the taps ``k_s(o)`` ``(2R+1, 2R+1)``
    centred at ``(R, R)`` and point-symmetric; ``h2`` ``(B,)``.
    """
    bsz, _, height, width = guide.shape
    r, p = spatial.shape[0] // 2, patch_radius
    padded = mirror_pad(guide, p)
    shifted_src = F.pad(padded, (r, r, r, r))
    offsets = half_offsets(r)
    taps = [spatial[r + a, r + b] for a, b in offsets]
    inv = (-0.5 / h2.clamp(min=torch.finfo(guide.dtype).tiny)).reshape(bsz, 1, 1, 1)
    rows = torch.arange(height, device=guide.device).reshape(height, 1)
    cols = torch.arange(width, device=guide.device).reshape(1, width)
    hp, wp = padded.shape[-2:]
    out = torch.empty(bsz, len(offsets), height, width, dtype=guide.dtype, device=guide.device)
    for k, (a, b) in enumerate(offsets):
        moved = shifted_src[..., r + a : r + a + hp, r + b : r + b + wp]
        dist = _box_sum((padded - moved).square().sum(dim=1, keepdim=True), p)
        inside = ((rows + a >= 0) & (rows + a < height) & (cols + b >= 0) & (cols + b < width)).to(
            guide.dtype
        )
        out[:, k : k + 1] = taps[k] * torch.exp(dist * inv) * inside
    return out


def apply_weights(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``K x`` per sample and channel: ``(Kx)(y) = Σ_{x'} k(y, x') x(x')`` for ``x`` ``(B, c, H, W)``.

    Each stored ``w_o(x)`` serves both ``k(x, x+o)`` and ``k(x+o, x)``, so ``K`` is symmetric.
    """
    height, width = x.shape[-2:]
    r = _radius(weights)
    xp = F.pad(x, (r, r, r, r))
    out = weights[:, :1] * x
    back = torch.zeros_like(xp)
    for k, (a, b) in enumerate(half_offsets(r)[1:], start=1):
        w = weights[:, k : k + 1]
        out = out + w * xp[..., r + a : r + a + height, r + b : r + b + width]
        back[..., r + a : r + a + height, r + b : r + b + width] += w * x
    return out + back[..., r : r + height, r : r + width]


def normalize_weights(weights: torch.Tensor, degree: torch.Tensor | None = None) -> torch.Tensor:
    """Weights of ``D^{-1/2} K D^{-1/2}`` with ``d = K1`` (pass ``degree`` ``(B, 1, H, W)`` if
    already computed); same shape ``(B, O, H, W)``."""
    r = _radius(weights)
    height, width = weights.shape[-2:]
    d = apply_weights(weights, torch.ones_like(weights[:, :1])) if degree is None else degree
    s = d.clamp(min=torch.finfo(d.dtype).tiny).rsqrt()
    sp = F.pad(s, (r, r, r, r))
    scaled = torch.empty_like(weights)
    for k, (a, b) in enumerate(half_offsets(r)):
        scaled[:, k : k + 1] = (
            weights[:, k : k + 1] * s * sp[..., r + a : r + a + height, r + b : r + b + width]
        )
    return scaled


def guided_gram(
    guide: torch.Tensor, spatial: torch.Tensor, patch_radius: int, h2: float, normalize: bool
) -> torch.Tensor:
    """Dense ``K`` ``(HW, HW)`` for one guide ``(c, H, W)`` from explicit patch features ``g(x)``
    and positions (an independent check of the weight maps)."""
    _, height, width = guide.shape
    p, r = patch_radius, spatial.shape[0] // 2
    feats = F.unfold(mirror_pad(guide[None], p), 2 * p + 1)[0].T  # (HW, c(2p+1)²)
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    pos = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1)
    delta = pos[:, None, :] - pos[None, :, :]
    near = (delta.abs().amax(dim=-1) <= r).to(guide.dtype)
    k_s = spatial[(delta[..., 0] + r).clamp(0, 2 * r), (delta[..., 1] + r).clamp(0, 2 * r)] * near
    gram = k_s * torch.exp(-torch.cdist(feats, feats).square() / (2 * h2))
    if normalize:
        s = gram.sum(dim=1).rsqrt()
        gram = s[:, None] * gram * s[None, :]
    return gram


class GuidedMap(nn.Module):
    """``x ↦ s·K x`` for per-image weight maps ``(B, O, H, W)`` and a scale ``s`` ``(B,)`` (e.g. ``±1/λ``)."""

    def __init__(self, weights: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.weights = weights
        self.scale = scale.reshape(-1, 1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * apply_weights(self.weights, x)
