"""The denoiser's non-local refinement of its pilot: repeated texture, found by the kernel's own weights.

The guided kernel's weights ``w_o(x) = k_s(o)·exp(−‖g(x) − g(x+o)‖²/2h²)`` compare the pilot's
patches at every offset ``o`` of the window. Freed of the taper and raised to an integer power
``κ``, they are non-local means' weights at the bandwidth ``h/√κ``, and

    ν = the non-local mean of y     (``GuidedOperator.nonlocal_mean``)

averages the noisy image over every patch of the window that repeats the pixel's own: it keeps a
periodic texture (Barbara's cloth) that the pilot's small CNN smooths away, and is noisier than the
pilot everywhere else. With ``Refine.aggregate = "patch"`` each patch's group of matches estimates
every pixel of the patch, and a pixel averages the estimates of the ``(2p+1)²`` patches that cover
it (block matching's aggregation): more estimates per pixel, less noise (on Barbara at σ = 25, ν
scores 29.51 dB against the pixel-wise 29.07). A second small CNN ``H_φ`` (``kdeq.maths.guidenet.Refine``)
decides per pixel how far to trust it, from what the two disagree on, measured in noise units, and
from how many matches the pixel has:

    p' = p + a ⊙ (ν − p),      a = H_φ((ν − p)/σ, (y − p)/σ, log(1 + Σu/c), σ).

With ``Refine.estimate = "collaborative"`` a grey image's ``ν`` is instead the collaborative
filter's estimate (``kdeq.maths.collab``: the matched patches shrunk together in a 3-D transform, not
averaged), and the matches' mass still the kernel's.

For grey images: a colour image's kernel compares colour patches, whose matches ``H_φ``, trained
on grey images, misreads. ``Refine.colour_channels`` adds ``H_φ^c`` for them, trained on colour
images, which weighs each opponent channel of ``ν − p`` (without it ``kdeq.predictors.denoise`` leaves colour
pilots as they are). ``p'`` takes the pilot's place in the denoiser's mean,
``m = β·p' + (1 − β)·D⁻¹K y``; the kernel, its guide ``p`` and the equilibrium are unchanged (a prior
mean may be any function of ``y``: DESIGN §2.6). At the start the networks' last layers are zero, so
``p' = p``: the model is the one it was refined from.
"""

from __future__ import annotations

import torch

from kdeq.maths.adaptive import GuidedOperator, Sizes
from kdeq.maths.collab import each_collaborative
from kdeq.maths.guidenet import (
    REFINE,
    REFINE_COLOUR,
    Refine,
    conv_stack,
    from_opponent,
    to_opponent,
    unshuffle,
)


def refines(refine: Refine, channels: int) -> bool:
    """Whether ``refine`` refines the pilot of a ``channels``-channel image: a grey one always, a colour
    one with its colour network ``H_φ^c``."""
    return channels == 1 or (channels == 3 and refine.colour_channels is not None)


def refined_pilot(
    op: GuidedOperator,
    y: torch.Tensor,
    p: torch.Tensor,
    sigma: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    refine: Refine,
    sizes: Sizes | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``p'`` and the estimate ``ν`` it read, each ``(B, c, H, W)``, for images ``y`` and their pilot ``p``
    ``(B, c, H, W)`` at noise levels ``σ`` ``(B,)`` in [0, 1] units, ``op`` the guided kernel of ``p``:
    grey (``c = 1``, ``H_φ``) or, with ``refine.colour_channels``, colour (``c = 3``, ``H_φ^c``);
    ``sizes`` each image's ``(h, w)`` in a padded batch (the network then runs on each image alone, as
    it would unbatched)."""
    if not refines(refine, y.shape[1]):
        raise ValueError(
            f"the non-local refinement is for grey images, or colour ones with a colour network; got "
            f"{y.shape[1]} channels"
        )
    if refine.estimate == "collaborative" and y.shape[1] == 1:
        radii = (refine.search_radius, refine.patch_radius)
        nu = each_collaborative(y, sigma, sizes, *radii, refine.first_stage)
        spread = op.match_spread(y, refine.sharpness)
    else:
        nu, spread = op.nonlocal_mean(y, refine.sharpness, patches=refine.aggregate == "patch")
    if sizes is None:
        return _refined(y, p, nu, spread, sigma, tensors, refine), nu
    out = p.clone()
    for k, (h, w) in enumerate(sizes):
        crop = (slice(k, k + 1), slice(None), slice(0, h), slice(0, w))
        out[crop] = _refined(y[crop], p[crop], nu[crop], spread[crop], sigma[k : k + 1], tensors, refine)
    return out, nu


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
    ``log(1 + Σu/c)`` ``(B, 1, H, W)``); for colour ``p + Qᵀ(a ⊙ Q(ν − p))``, ``Q`` the opponent basis."""
    s = sigma.to(y.dtype).reshape(-1, 1, 1, 1)
    gap, noisy = nu - p, y - p
    if y.shape[1] == 3:
        gap, noisy = to_opponent(gap), to_opponent(noisy)
    h = unshuffle(torch.cat([gap / s, noisy / s, spread], dim=1))
    h = torch.cat([h, s.expand(-1, 1, *h.shape[-2:])], dim=1)
    prefix, features = (
        (REFINE, refine.channels) if y.shape[1] == 1 else (REFINE_COLOUR, refine.colour_channels)
    )
    assert features is not None, "a colour refinement needs its colour network"
    a = conv_stack(h, tensors, prefix, features, refine.depth, tuple(y.shape[-2:]))
    if y.shape[1] == 1:
        return p + a * gap
    return p + from_opponent(a * gap)
