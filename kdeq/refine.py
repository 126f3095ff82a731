"""The denoiser's non-local refinement of its pilot: repeated texture, found by the kernel's own weights.

The guided kernel's weights ``w_o(x) = k_s(o)·exp(−‖g(x) − g(x+o)‖²/2h²)`` compare the pilot's
patches at every offset ``o`` of the window. Freed of the taper and raised to an integer power
``κ``, they are non-local means' weights at the bandwidth ``h/√κ``, and

    ν = the non-local mean of y     (``GuidedOperator.nonlocal_mean``)

averages the noisy image over every patch of the window that repeats the pixel's own: it keeps a
periodic texture (Barbara's cloth) that the pilot's small CNN smooths away, and is noisier than the
pilot everywhere else. A second small CNN ``H_φ`` (``kdeq.guidenet.Refine``) decides per pixel how
far to trust it, from what the two disagree on, measured in noise units, and from how many matches
the pixel has:

    p' = p + a ⊙ (ν − p),      a = H_φ((ν − p)/σ, (y − p)/σ, log(1 + Σu/c), σ).

For grey images: a colour image's kernel compares colour patches, whose matches ``H_φ``, trained
on grey images, misreads (``kdeq.denoise`` leaves colour pilots as they are). ``p'`` takes the
pilot's place in the denoiser's mean, ``m = β·p' + (1 − β)·D⁻¹K y``; the kernel, its guide ``p`` and
the equilibrium are unchanged (a prior mean may be any function of ``y``: DESIGN §2.6). At the start
``H_φ``'s last layer is zero, so ``p' = p``: the model is the one it was refined from.
"""

from __future__ import annotations

import torch

from kdeq.adaptive import GuidedOperator, Sizes
from kdeq.guidenet import REFINE, Refine, conv_stack, unshuffle


def refined_pilot(
    op: GuidedOperator,
    y: torch.Tensor,
    p: torch.Tensor,
    sigma: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    refine: Refine,
    sizes: Sizes | None = None,
) -> torch.Tensor:
    """``p'`` ``(B, 1, H, W)`` for grey images ``y`` and their pilot ``p`` ``(B, 1, H, W)`` at noise
    levels ``σ`` ``(B,)`` in [0, 1] units, ``op`` the guided kernel of ``p``; ``sizes`` each image's
    ``(h, w)`` in a padded batch (``H_φ`` then runs on each image alone, as it would unbatched)."""
    if y.shape[1] != 1:
        raise ValueError(f"the non-local refinement is for grey images, got {y.shape[1]} channels")
    nu, spread = op.nonlocal_mean(y, refine.sharpness)
    if sizes is None:
        return _refined(y, p, nu, spread, sigma, tensors, refine)
    out = p.clone()
    for k, (h, w) in enumerate(sizes):
        crop = (slice(k, k + 1), slice(None), slice(0, h), slice(0, w))
        out[crop] = _refined(y[crop], p[crop], nu[crop], spread[crop], sigma[k : k + 1], tensors, refine)
    return out


def _refined(
    y: torch.Tensor,
    p: torch.Tensor,
    nu: torch.Tensor,
    spread: torch.Tensor,
    sigma: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    refine: Refine,
) -> torch.Tensor:
    """``p + a ⊙ (ν − p)`` for one size of images (shapes as in ``refined_pilot``; ``spread``
    ``log(1 + Σu/c)`` ``(B, 1, H, W)``)."""
    s = sigma.to(y.dtype).reshape(-1, 1, 1, 1)
    gap = nu - p
    h = unshuffle(torch.cat([gap / s, (y - p) / s, spread], dim=1))
    h = torch.cat([h, s.expand(-1, 1, *h.shape[-2:])], dim=1)
    a = conv_stack(h, tensors, REFINE, refine.channels, refine.depth, tuple(y.shape[-2:]))
    return p + a * gap
