"""How far to move one estimate of an image toward another: Stein's unbiased risk estimate (SURE).

For ``y = x + n`` with ``n ~ N(0, σ²I)`` over ``N`` values and an estimate ``f(y)`` weakly
differentiable in ``y``, Stein's lemma gives ``E⟨n, f(y)⟩ = σ²·E div f(y)``, so

    SURE(f) = ‖y − f(y)‖² − Nσ² + 2σ²·div f(y),      E SURE(f) = E‖f(y) − x‖²

without ``x``. For the blend ``f_b = p + b·g`` of an estimate ``p`` and the gap ``g = ν − p`` to
another, ``ν`` (both functions of ``y``),

    SURE(b) = ‖y − p − b·g‖² − Nσ² + 2σ²·(div p + b·div g)

is a convex quadratic in ``b``, least over ``[0, 1]`` at

    b* = clip((⟨y − p, g⟩ − σ²·div g) / ‖g‖², 0, 1).

Without the divergence term ``b*`` would credit ``ν`` with the noise it keeps: ``⟨n, g⟩`` is that
term's expectation. The gain ``⟨y − p, g⟩ − σ²·div g`` estimates ``⟨x − p, g⟩`` with a noise that a
small gap's gain does not clear: ``⟨n, g⟩``'s alone has a standard deviation of ``σ‖g‖`` for a ``g``
independent of ``n``, and measured (against the clean image, on 20 crops of Train400's validation
split at σ = 15, 25 and 50) the whole noise's was 3.1–3.2 ``σ‖g‖``, ``g`` being mostly filtered
noise itself. On a smooth 96² image at σ = 25 the filter's gap held 0.009σ² a pixel and its gain
−0.0013σ² (``ν`` the worse). So the weight taken is the cautious

    b = clip((⟨y − p, g⟩ − σ²·div g − z·σ‖g‖) / ‖g‖², 0, 1),      z = ``MARGIN``,

SURE's least once its gain is lowered by about two of its standard errors: ``ν`` is moved toward
only as far as the evidence holds. On Barbara (σ = 15 to 50) the margin is 7–9 % of the gain.

``div g = Σ_j ∂g_j/∂y_j`` is probed by Monte Carlo (Ramani, Blu and Unser, "Monte-Carlo SURE", IEEE
TIP 2008): for a ``δ`` of independent ±1 entries, ``E_δ δᵀ(g(y + εδ) − g(y))/ε`` is the divergence
of ``g`` to first order in ``ε``, and one probe over an image's ``N ~ 10⁵`` values carries little of
its own noise.
"""

from __future__ import annotations

import torch

from kdeq.maths.adaptive import Sizes

#: the probe's step ``ε`` in units of ``σ``. What it probes is not smooth (a hard threshold, patch
#: matches, ReLUs), and a small step reads the kinks it lands on: on a smooth 96² image whose ``ν`` is
#: worse than ``p``, ``σ/20`` gave ``b`` 0.10 with float32 networks, 0.01 with bfloat16; ``σ/5`` gave 0
#: with both, and Set12's mean at σ = 25 is the same to 0.001 dB with either step
STEP = 1 / 5
#: ``z``, the margin in units of ``σ‖g‖`` given up before moving toward ``ν``: about two standard
#: errors of SURE's gain (the module docstring). On Train400's validation split ``z`` = 2, 3, 4 and 6
#: scored 28.1303, 28.1360, 28.1398 and 28.1440 dB, against 28.1444 with ``b = 0`` (version 1)
MARGIN = 6.0
#: the probe's seed: an image's probe is a function of its shape alone
SEED = 0


def probe(like: torch.Tensor, sizes: Sizes | None = None) -> torch.Tensor:
    """A Rademacher ``δ`` shaped as ``like`` ``(B, c, H, W)``: each image's from ``SEED`` over its own
    ``(c, h, w)`` of ``sizes`` (the whole image without), 0 in a padded batch's padding, drawn on the CPU
    so that every device probes alike."""
    out = torch.zeros(like.shape, dtype=like.dtype)
    c, height, width = like.shape[1:]
    for k in range(like.shape[0]):
        h, w = (height, width) if sizes is None else sizes[k]
        draw = torch.randint(0, 2, (c, h, w), generator=torch.Generator().manual_seed(SEED))
        out[k, :, :h, :w] = draw.to(like.dtype) * 2 - 1
    return out.to(like.device)


def _sums(v: torch.Tensor, sizes: Sizes | None) -> torch.Tensor:
    """``Σ`` of each image's values of ``v`` ``(B, c, H, W)`` over its own ``(h, w)``: ``(B,)``."""
    if sizes is None:
        return v.sum(dim=(1, 2, 3))
    return torch.stack([v[k, :, :h, :w].sum() for k, (h, w) in enumerate(sizes)])


def divergence(
    delta: torch.Tensor,
    before: torch.Tensor,
    after: torch.Tensor,
    step: torch.Tensor,
    sizes: Sizes | None = None,
) -> torch.Tensor:
    """The probed ``div g`` ``(B,)``: ``δᵀ(g(y + εδ) − g(y))/ε`` over each image's own ``(h, w)``, for
    ``before = g(y)``, ``after = g(y + εδ)`` and the probe ``δ`` (each ``(B, c, H, W)``) at steps ``ε``
    ``step`` ``(B,)``. Exact, ``δᵀAδ``, for a linear ``g = A y``."""
    return _sums(delta * (after - before), sizes) / step


def blend_weight(
    y: torch.Tensor,
    p: torch.Tensor,
    g: torch.Tensor,
    div: torch.Tensor,
    sigma: torch.Tensor,
    sizes: Sizes | None = None,
) -> torch.Tensor:
    """The cautious weight ``b`` ``(B,)`` for images ``y``, their estimate ``p`` and gap ``g = ν − p``
    (each ``(B, c, H, W)``), the gap's divergence ``div`` and the noise levels ``σ`` (each ``(B,)``): the
    module docstring's ``clip((⟨y − p, g⟩ − σ²·div g − z·σ‖g‖)/‖g‖², 0, 1)``, 0 for a zero gap."""
    s = sigma.to(y.dtype)
    energy = _sums(g * g, sizes)
    gain = _sums((y - p) * g, sizes) - s**2 * div - MARGIN * s * energy.sqrt()
    b = torch.where(energy > 0, gain / energy.clamp(min=torch.finfo(y.dtype).tiny), torch.zeros_like(gain))
    return b.clamp(0, 1)
