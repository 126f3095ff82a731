"""The learned guide of an adaptive denoiser: a small CNN whose pilot image ``p`` is the guide ``g``.

The adaptive kernel ``k_s(x − x')·exp(−‖g(x) − g(x')‖²/2h²)`` is PSD for any
guide image (DESIGN §2.5), so a learned guide keeps the layer a kernel GLM. The
pilot of a noisy image ``y`` ``(B, c, H, W)`` at noise level ``σ`` ``(B,)`` is

    p = b + a·(y − b) + N_θ(y, σ),      b = G∗y (the guide's pre-smoothing),

with ``a`` a learned scalar and ``N_θ`` a ReLU CNN on the 2×2 pixel-unshuffled
image (four sub-images and a constant ``σ`` map in, ``depth`` 3×3 convolutions of
``channels`` features, four sub-images out, shuffled back: FFDNet's layout, a
receptive field of ``4·depth + 2`` pixels at a quarter of the cost). At the
kGLM start ``a = 0`` and ``N_θ``'s last layer is zero, so ``p = b``: the model is
the closed-form kGLM denoiser exactly, and training moves it from there.

Each channel is denoised on its own, in the orthonormal opponent basis of the
image's channels for colour (luminance and two colour differences, where noise
stays i.i.d. with the same ``σ``), with its mean removed: one grey network
serves grey and colour images alike.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field


class GuideNet(BaseModel):
    """Shape of ``N_θ``: ``depth`` convolutions (``depth − 1`` followed by ReLU) of ``channels`` features.

    Its tensors: ``net_<i>_weight`` ``(out, in, 3, 3)`` and ``net_<i>_bias`` ``(out,)`` for
    ``i < depth`` (``in = 5`` first, ``out = 4`` last), ``net_skip`` ``(1,)`` (``a``), and
    ``net_mean_mix`` ``(1,)``: the denoiser's mean is ``(1 − β)·D⁻¹K y + β·p`` (``kdeq.denoise``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    depth: int = Field(10, ge=2, le=32)
    channels: int = Field(64, ge=4, le=256)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor names and shapes, in layer order."""
        out: dict[str, tuple[int, ...]] = {}
        for i in range(self.depth):
            cin = 5 if i == 0 else self.channels
            cout = 4 if i == self.depth - 1 else self.channels
            out[f"net_{i}_weight"] = (cout, cin, 3, 3)
            out[f"net_{i}_bias"] = (cout,)
        out["net_skip"] = (1,)
        out["net_mean_mix"] = (1,)
        return out

    def kglm_start(self, seed: int = 0) -> dict[str, torch.Tensor]:
        """Tensors at the kGLM start (``p = b``, mean ``D⁻¹K y``): He-normal hidden layers (seeded, so
        a rebuild is identical), zero biases, a zero last layer and ``a = β = 0``."""
        gen = torch.Generator().manual_seed(seed)
        out = {}
        for name, shape in self.shapes().items():
            if name.endswith("_weight") and not name.startswith(f"net_{self.depth - 1}_"):
                fan_in = shape[1] * shape[2] * shape[3]
                w = torch.randn(shape, generator=gen, dtype=torch.float64) * math.sqrt(2.0 / fan_in)
                out[name] = w.to(torch.float32)
            else:
                out[name] = torch.zeros(shape)
        return out

    def random_start(self, seed: int) -> dict[str, torch.Tensor]:
        """Tensors drawn at random, the last layer included (He-normal), and ``a, β ~ U[0, 1]``."""
        gen = torch.Generator().manual_seed(seed)
        out = {}
        for name, shape in self.shapes().items():
            if name.endswith("_weight"):
                fan_in = shape[1] * shape[2] * shape[3]
                out[name] = (
                    torch.randn(shape, generator=gen, dtype=torch.float64) * math.sqrt(2.0 / fan_in)
                ).float()
            elif name in ("net_skip", "net_mean_mix"):
                out[name] = torch.rand(shape, generator=gen, dtype=torch.float64).float()
            else:
                out[name] = torch.zeros(shape)
        return out


def opponent(c: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An orthonormal ``(c, c)`` basis whose first row is the normalised channel sum (luminance); the
    others are differences: ``[1,1,1]/√3, [1,0,−1]/√2, [1,−2,1]/√6`` for ``c = 3``."""
    if c == 1:
        return torch.ones(1, 1, dtype=dtype)
    if c != 3:
        raise ValueError(f"the guide network takes grey or colour (3-channel) images, got {c} channels")
    t = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, -1.0], [1.0, -2.0, 1.0]], dtype=torch.float64)
    return (t / t.norm(dim=1, keepdim=True)).to(dtype)


def pilot(
    y: torch.Tensor, base: torch.Tensor, sigma: torch.Tensor, tensors: dict[str, torch.Tensor], net: GuideNet
) -> torch.Tensor:
    """``p = b + a·(y − b) + N_θ(y, σ)`` ``(B, c, H, W)`` for ``y`` and ``b`` ``(B, c, H, W)``, ``σ``
    ``(B,)`` in [0, 1] units; see the module docstring."""
    bsz, c, height, width = y.shape
    q = opponent(c, y.dtype).to(y.device)
    u = torch.einsum("dc,bchw->bdhw", q, y).reshape(bsz * c, 1, height, width)
    ub = torch.einsum("dc,bchw->bdhw", q, base).reshape(bsz * c, 1, height, width)
    level = u.mean(dim=(2, 3), keepdim=True)
    # odd sizes are mirrored by one row or column so that the 2×2 unshuffle tiles the image
    ph, pw = height % 2, width % 2
    v = F.pad(u - level, (0, pw, 0, ph), mode="replicate") if ph or pw else u - level
    s = sigma.to(y.dtype).repeat_interleave(c).reshape(-1, 1, 1, 1)
    h = F.pixel_unshuffle(v, 2)
    h = torch.cat([h, s.expand(-1, 1, *h.shape[-2:])], dim=1)
    for i in range(net.depth):
        h = F.conv2d(h, tensors[f"net_{i}_weight"], tensors[f"net_{i}_bias"], padding=1)
        if i < net.depth - 1:
            h = F.relu(h)
    r = F.pixel_shuffle(h, 2)[..., :height, :width]
    p = ub + tensors["net_skip"] * (u - ub) + r
    return torch.einsum("dc,bdhw->bchw", q, p.reshape(bsz, c, height, width))
