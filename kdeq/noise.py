"""Noise-level estimation and the noise-level rule for ``λ`` (DESIGN §2.6).

The estimator is Donoho and Johnstone's: the finest diagonal Haar wavelet
coefficients ``d = (x₀₀ − x₀₁ − x₁₀ + x₁₁)/2`` of an image are, away from
edges, pure noise with the noise's standard deviation (the Haar transform is
orthonormal), and their median absolute value over ``Φ⁻¹(3/4) ≈ 0.6745``
is a robust estimate of it that edges and texture barely move.
"""

from __future__ import annotations

import torch

MAD_TO_STD = 0.6744897501960817  # Φ⁻¹(3/4): the median of |N(0, 1)|


def estimate_sigma(images: torch.Tensor) -> torch.Tensor:
    """Noise standard deviation per image, ``(B,)``, for ``images`` ``(B, c, H, W)`` with ``H, W ≥ 2``.

    ``σ̂ = median|d| / Φ⁻¹(3/4)`` over the Haar diagonal band ``d`` of all channels,
    on the images' own scale (pixels in [0, 1] give ``σ̂`` in [0, 1] units).
    """
    if images.dim() != 4 or images.shape[-1] < 2 or images.shape[-2] < 2:
        raise ValueError(f"need (B, c, H, W) images with H, W ≥ 2, got {tuple(images.shape)}")
    h, w = images.shape[-2] // 2 * 2, images.shape[-1] // 2 * 2
    x = images[..., :h, :w].to(torch.float32)
    d = (x[..., 0::2, 0::2] - x[..., 0::2, 1::2] - x[..., 1::2, 0::2] + x[..., 1::2, 1::2]) / 2
    return d.abs().reshape(images.shape[0], -1).median(dim=1).values / MAD_TO_STD
