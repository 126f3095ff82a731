"""Separable Gaussian smoothing and normalised convolution, used for guides and mean functions.

The 1-D taps are stored in checkpoints (so a fine-tuned model may change
them); borders are mirrored so an image's edge is not darkened.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def gaussian_taps(std: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normalised taps ``g[t] ∝ exp(−t²/2s²)``, ``t = −⌈3s⌉..⌈3s⌉``: ``(2⌈3s⌉+1,)``; ``[1]`` for ``s = 0``."""
    if std < 0:
        raise ValueError(f"smoothing std must be ≥ 0, got {std}")
    if std == 0:
        return torch.ones(1, dtype=dtype)
    r = max(1, math.ceil(3 * std))
    t = torch.arange(-r, r + 1, dtype=torch.float64)
    g = torch.exp(-t * t / (2 * std * std))
    return (g / g.sum()).to(dtype)


def mirror_pad(x: torch.Tensor, r: int) -> torch.Tensor:
    """``x`` ``(B, c, H, W)`` padded by ``r`` on every side, mirrored (edge-repeated for images
    no larger than ``r``, where a mirror does not fit)."""
    if r == 0:
        return x
    mode = "reflect" if min(x.shape[-2:]) > r else "replicate"
    return F.pad(x, (r, r, r, r), mode=mode)


def observed_mean(y: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
    """Per-channel mean of the observed pixels, ``(B, c, 1, 1)``, for ``observed`` ``(B, 1, H, W)``."""
    total = (y * observed).sum(dim=(2, 3), keepdim=True)
    return total / observed.sum(dim=(2, 3), keepdim=True).clamp(min=1)


#: on a CPU, the most pixels per channel (``H·W``) ``separable_blur`` convolves in one call: oneDNN pads
#: a one-channel image to 16 channels for these convolutions, so a 25-megapixel scan's smoothing took
#: 1.6 GiB at once; bands of rows bound that, with the same output bit for bit
BLUR_BAND_PIXELS = 1 << 20


def separable_blur(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, c, H, W)`` convolved with ``taps ⊗ taps`` per channel, mirrored borders; on a CPU in
    bands of rows of at most ``BLUR_BAND_PIXELS`` pixels each (each band reads its neighbours' rows)."""
    r = taps.shape[0] // 2
    if r == 0:
        return x * taps[0]
    c, (height, width) = x.shape[1], x.shape[-2:]
    padded = mirror_pad(x, r)

    def blur(rows: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(rows, taps.reshape(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
        return F.conv2d(y, taps.reshape(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)

    band = max(1, BLUR_BAND_PIXELS // width)
    if x.device.type != "cpu" or band >= height:
        return blur(padded)
    out = x.new_empty(x.shape)
    for start in range(0, height, band):
        stop = min(start + band, height)
        out[..., start:stop, :] = blur(padded[..., start : stop + 2 * r, :])
    return out


def normalized_convolution(
    y: torch.Tensor, observed: torch.Tensor, taps: torch.Tensor, level: torch.Tensor | None = None
) -> torch.Tensor:
    """``G*(M⊙y) / G*M``: the Gaussian-weighted mean of the observed pixels around each pixel.

    ``y`` ``(B, c, H, W)``, ``observed`` ``(B, 1, H, W)`` in {0, 1}. Where no observed
    pixel is within reach, ``level`` ``(B, c)`` is used, by default the image's observed mean.
    """
    num = separable_blur(y * observed, taps)
    den = separable_blur(observed, taps)
    tiny = 1e-6
    fill = observed_mean(y, observed) if level is None else level.to(y.dtype)[..., None, None]
    return torch.where(den > tiny, num / den.clamp(min=tiny), fill.expand_as(num))
