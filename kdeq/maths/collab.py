"""Collaborative filtering of matched patches: the two stages of block matching and 3-D filtering
(Dabov, Foi, Katkovnik and Egiazarian, "Image denoising by sparse 3-D transform-domain collaborative
filtering", IEEE TIP 2007), written for the denoiser's refinement (``kdeq.maths.refine``).

A weighted mean of matched patches (``GuidedOperator.nonlocal_mean``) keeps only what the group has
in common, noise included. Filtering the group jointly does more: stacked, the ``K`` matches of a
patch are a 3-D signal whose spectrum (a 2-D transform of each patch, then one along the stack) is
sparse where they repeat, so shrinking the spectrum removes the noise from what repeats and keeps
each patch's own detail where it rises above the noise (Barbara's stripes).

For a reference patch ``P_r`` (``n × n``, ``n = 2p + 1``, ``p`` the patch radius, by default
``PATCH_RADIUS``) on a grid of step ``STEP``, its group ``G_r`` is the ``K`` patches of the ``(2R+1)²``
window whose centres are nearest to it in the matching image (``P_r`` itself first);
``T = H_K ⊗ (D_n ⊗ D_n)`` with ``D_n`` the orthonormal DCT-II and ``H_K`` the orthonormal Haar matrix,
so ``T`` is orthonormal and the noise's spectrum is white with the same ``σ``:

    stage 1 (``hard``):   Ĝ_r = Tᵀ·thr(T·Y_r),  thr(s) = s·[|s| ≥ λσ],     weight 1/N_r (N_r = kept
                          coefficients), groups matched on the noisy image ``y``;
    stage 2 (``wiener``): Ĝ_r = Tᵀ·(ω ⊙ T·Y_r),  ω = (T·B_r)²/((T·B_r)² + σ²), weight 1/‖ω‖², groups
                          matched on the first stage's estimate ``b`` (and ``B_r`` taken from it).

With ``first_stage = "dct+biorthogonal"`` the first stage's estimate is the mean of two: the one
above, and the same groups' patches ``2p`` pixels a side (``−(p − 1)…p`` about each matched centre,
``2p`` a power of two) thresholded in ``T_b = H_K ⊗ (B ⊗ B)``, ``B`` the periodic wavelet transform of
the biorthogonal spline wavelet ``bior1.5`` (BM3D's own first-stage transform). ``T_b`` is not
orthonormal: coefficient ``j``'s noise has std ``σ‖t_j‖`` (``t_j`` its row), its threshold is
``λσ‖t_j‖``, and the estimate is read back through ``T_b⁻¹``. Its wavelets suit edges and smooth
regions (House), the DCT stripes (Barbara); the Wiener stage's pilot, their mean, keeps most of each.

Each pixel is the weighted mean of every estimate of it (each group member covers ``n²`` pixels),
each weighted further by a Kaiser window over the patch. Both stages' weights are the reciprocal of
the estimate's noise variance, as the paper's, up to ``σ²``, which is the same for every group.
Patches take their pixels from the image mirrored at its borders (``mirror_pad``), as the guided
kernel's do."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

import torch

from kdeq.maths.adaptive import Sizes, guided_weights, half_offsets
from kdeq.maths.filters import mirror_pad
from kdeq.maths.transforms import dct_matrix
from kdeq.runtime import native

#: patches of ``2p + 1`` pixels a side (``p`` the patch radius, by default ``PATCH_RADIUS``), matched
#: in a window of ``2·R + 1`` (``R`` the search radius, by default ``SEARCH_RADIUS``), reference patches
#: every ``STEP`` pixels (and on the last row and column)
PATCH_RADIUS = 3
SEARCH_RADIUS = 7
STEP = 3
#: group sizes (powers of two, for the Haar transform along the stack) of the two stages
GROUP_HARD = 16
GROUP_WIENER = 16
#: the hard threshold, in units of σ
THRESHOLD = 2.7
#: the Kaiser window's β over a patch
KAISER_BETA = 2.0
#: reference patches matched at a time by torch's loop, and filtered at a time off the CPU in groups
#: of 16 grey 7×7 patches (fewer for larger ones, ``filtered``): a 512² image's groups are ~23 M
#: values at once otherwise
CHUNK = 4096
#: the groups filtered at a time on a CPU, counted as ``CHUNK``'s: each array of a chunk then stays within the
#: blocks the C heap reuses (``kdeq.runtime.heap``), and in the cache longer. Against 4096,
#: ``denoise-kglm-collab:5`` took 0.91 of the time on grey 512² images and the 4-megapixel mosaic in tiles
#: 0.97 of the time at 0.81 of the peak memory, bit for bit the same
#: (docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "the C heap kept for the next tensor")
CPU_CHUNK = 1024
#: offsets whose patch distances are held at once while matching (of the window's ``((2R + 1)² − 1)/2``)
OFFSETS_AT_ONCE = 16


def reach(radius: int = SEARCH_RADIUS, patch_radius: int = PATCH_RADIUS) -> int:
    """How far from a pixel its estimate reads ``y`` (given the reference grid) with search radius ``R``
    = ``radius`` and patch radius ``p`` = ``patch_radius``: a stage's estimate of ``q`` comes from
    every group member covering it (within ``p``), each group's reference (within ``R`` of its
    members) and the reference's other members and matching candidates (``R`` further, and their
    pixels ``p``); the second stage reads the first's estimate as far: ``2·(2R + 2p)``."""
    return 2 * (2 * radius + 2 * patch_radius)


def haar_matrix(k: int) -> torch.Tensor:
    """The orthonormal Haar matrix ``(k, k)`` for ``k`` a power of two: the mean row, then the
    differences of halves at every scale, each row of unit norm."""
    if k < 1 or k & (k - 1):
        raise ValueError(f"the Haar matrix needs a power of two, got {k}")
    f64 = torch.float64
    out = torch.ones(1, 1, dtype=f64)
    pair, step = torch.tensor([[1.0, 1.0]], dtype=f64), torch.tensor([[1.0, -1.0]], dtype=f64)
    while out.shape[0] < k:
        # the coarser rows spread over twice the length, then a difference of neighbours at the finest
        out = torch.cat([torch.kron(out, pair), torch.kron(torch.eye(out.shape[0], dtype=f64), step)])
        out = out / math.sqrt(2)
    return out


#: the analysis low-pass taps of ``bior1.5`` at ``t = −4…5`` about a pair ``(2k, 2k + 1)``; its high-pass
#: is Haar's, ``(x_2k − x_2k+1)/√2``
BIOR_LOW = (3, -3, -22, 22, 128, 128, 22, -22, -3, 3)
#: the first stages (``Refine.first_stage``): the DCT's alone, or the mean of the DCT's and the
#: biorthogonal wavelets' estimates
FirstStage = Literal["dct", "dct+biorthogonal"]
FIRST_STAGES = get_args(FirstStage)


def biorthogonal_matrix(n: int) -> torch.Tensor:
    """The analysis matrix ``B`` ``(n, n)``, ``n`` a power of two, of the periodic discrete wavelet
    transform over all ``log₂ n`` levels with the biorthogonal spline wavelet of orders 1 and 5
    (Cohen, Daubechies and Feauveau; ``bior1.5``). One level maps a length-``m`` signal ``x`` to

        a_k = (√2/256)·Σ_{t=−4}^{5} ℓ_t·x_{(2k + t) mod m},   d_k = (x_{2k} − x_{2k+1})/√2,   k < m/2,

    ``ℓ`` = ``BIOR_LOW``, and the next level transforms ``a``: the rows are the last level's ``a``, then
    each level's ``d``, coarsest first. Not orthogonal (its rows' norms are 1 to 1.06 at ``n = 8``);
    its inverse is the synthesis by the Haar scaling function and the long wavelet."""
    if n < 2 or n & (n - 1):
        raise ValueError(f"the wavelet transform needs a power of two, got {n}")
    f64 = torch.float64
    out = torch.eye(n, dtype=f64)
    m = n
    while m > 1:
        step = torch.eye(n, dtype=f64)  # the finished details pass through
        step[:m, :m] = 0
        for k in range(m // 2):
            for t, tap in zip(range(-4, 6), BIOR_LOW, strict=True):
                step[k, (2 * k + t) % m] += math.sqrt(2) / 256 * tap
            step[m // 2 + k, 2 * k] = 1 / math.sqrt(2)
            step[m // 2 + k, 2 * k + 1] = -1 / math.sqrt(2)
        out = step @ out
        m //= 2
    return out


def transformed(groups: torch.Tensor, stack: torch.Tensor, patch: torch.Tensor) -> torch.Tensor:
    """``(S ⊗ P)·g`` for each group ``g`` of ``groups`` ``(G, K, c, q)``: ``P`` ``(q, q)`` on every patch
    (one matrix product over all of them), then ``S`` ``(K, K)`` along the stack (``G`` small ones:
    half the time of ``einsum``'s plan on this project's CPU)."""
    g, k, c, q = groups.shape
    flat = (groups.reshape(-1, q) @ patch.T).reshape(g, k, c * q)
    return torch.matmul(stack, flat).reshape(g, k, c, q)


def grid(length: int) -> torch.Tensor:
    """Reference positions along a side of ``length``: every ``STEP``-th, and the last."""
    out = list(range(0, length, STEP))
    if out[-1] != length - 1:
        out.append(length - 1)
    return torch.tensor(out)


def matches(
    guide: torch.Tensor,
    sigma: float,
    group: int,
    radius: int = SEARCH_RADIUS,
    patch_radius: int = PATCH_RADIUS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``guide`` ``(c, H, W)``: the reference pixels ``(G,)`` (flat indices, on the grid) and their
    groups ``(G, K)``: the flat indices of the centres of the ``K = group`` patches of the
    ``(2·radius + 1)²`` window nearest to each reference's in ``guide`` (Euclidean distance over the
    ``n × n × c`` patch, ``n = 2·patch_radius + 1``), the reference itself first. ``sigma`` (in [0, 1]
    units) sets the scale of the weights the distances are read from (``guided_weights`` with flat
    taps), not the ranking."""
    c, height, width = guide.shape
    n = 2 * patch_radius + 1
    offsets = half_offsets(radius)
    taps = torch.ones(2 * radius + 1, 2 * radius + 1, dtype=guide.dtype, device=guide.device)
    # distances reach ~2·n²·c·σ² between noisy patches; h² of 8 times that keeps every weight far
    # from the cut at e^-60, so that the weights rank the distances
    h2 = torch.tensor([16.0 * n * n * c * max(sigma, 1 / 255) ** 2], dtype=guide.dtype, device=guide.device)
    ys, xs = grid(height).to(guide.device), grid(width).to(guide.device)
    ry, rx = ys[:, None].expand(-1, len(xs)).reshape(-1), xs[None, :].expand(len(ys), -1).reshape(-1)
    refs = ry * width + rx

    def inside(v: torch.Tensor, length: int) -> torch.Tensor:
        """How many of the window's rows (columns) at each position ``v`` lie in the image."""
        return (v + radius).clamp(max=length - 1) - (v - radius).clamp(min=0) + 1

    # the fewest candidates any reference has (a corner's), itself included
    group = min(group, int(inside(ys, height).min() * inside(xs, width).min()))
    # the best so far of each reference: below every candidate's score (an outside one's is −1)
    scores = guide.new_full((refs.numel(), group), -2.0)
    members = torch.zeros(refs.numel(), group, dtype=torch.long, device=guide.device)
    # a part of the offsets at a time: their weight maps, not the window's 113, are what a tile keeps
    for first in range(0, len(offsets), OFFSETS_AT_ONCE):
        part = offsets[first : first + OFFSETS_AT_ONCE]
        weights = guided_weights(guide[None], taps, patch_radius, h2, offsets=part)[0].reshape(len(part), -1)
        select = native.select if native.enabled(weights) else running_best
        select(weights, part, first == 0, refs, height, width, scores, members)
    return refs, members


def running_best(
    weights: torch.Tensor,
    offsets: Sequence[tuple[int, int]],
    self_first: bool,
    refs: torch.Tensor,
    height: int,
    width: int,
    scores: torch.Tensor,
    members: torch.Tensor,
) -> None:
    """``matches``'s selection in place, torch's loop for ``native.select`` (the same arguments and
    result): each reference ``r`` of ``refs`` ``(G,)`` keeps its ``K`` best candidates, ``scores``
    ``(G, K)`` highest first and ``members`` ``(G, K)`` their pixels, of the forward ``r + o_j`` (score
    ``weights[j](r)``) then backward ``r − o_j`` (``weights[j](r − o_j)``) candidates of ``offsets``,
    in a stable sort, highest first; with ``self_first`` the reference itself (``o_0 = 0``) scores 2.
    ``weights`` ``(n, H·W)``."""
    device = weights.device
    group = scores.shape[1]
    a = torch.tensor([o[0] for o in offsets], device=device)
    b = torch.tensor([o[1] for o in offsets], device=device)
    rows = torch.arange(len(offsets), device=device)[None, :]
    # a chunk of references at a time: their candidates' indices are int64, 2 per offset
    for start in range(0, refs.numel(), CHUNK):
        here = refs[start : start + CHUNK]
        cy, cx = here // width, here % width
        # w_o(x) pairs x with x + o: a reference r meets r + o in w_o(r), and r − o in w_o(r − o)
        ty, tx = cy[:, None] + a, cx[:, None] + b
        sy, sx = cy[:, None] - a, cx[:, None] - b
        ahead = (ty >= 0) & (ty < height) & (tx >= 0) & (tx < width)
        behind = (sy >= 0) & (sy < height) & (sx >= 0) & (sx < width) & ((a != 0) | (b != 0))
        forward = (ty * width + tx).clamp(0, height * width - 1)
        backward = (sy * width + sx).clamp(0, height * width - 1)
        # a candidate outside the image scores −1, under any weight: at least K lie inside
        found = torch.cat(
            [
                torch.where(ahead, weights[rows, here[:, None].expand_as(forward)], -1.0),
                torch.where(behind, weights[rows, backward], -1.0),
            ],
            dim=1,
        )
        if self_first:
            found[:, 0] = 2.0  # the reference first (offset (0, 0)), whatever ties at weight 1
        kept = slice(start, start + CHUNK)
        # stable, so that ties keep the order the candidates came in (the compiled loop's too)
        best = torch.cat([scores[kept], found], dim=1).sort(dim=1, descending=True, stable=True)
        scores[kept] = best.values[:, :group]
        chosen = best.indices[:, :group]
        members[kept] = torch.cat([members[kept], forward, backward], dim=1).gather(1, chosen)


def collaborative(
    y: torch.Tensor,
    sigma: float,
    radius: int = SEARCH_RADIUS,
    patch_radius: int = PATCH_RADIUS,
    first_stage: str = "dct",
) -> torch.Tensor:
    """Both stages' estimate ``(c, H, W)`` of the clean image from ``y`` ``(c, H, W)`` with white noise
    of std ``sigma`` (in [0, 1] units), patches of radius ``patch_radius`` matched within ``radius``:
    the hard-threshold stage on ``y`` (``first_stage``: the DCT's, or its mean with the biorthogonal
    wavelets' on the same groups), then the Wiener stage guided by it (the module docstring)."""
    if first_stage not in FIRST_STAGES:
        raise ValueError(f"the first stage is one of {FIRST_STAGES}, got {first_stage!r}")
    groups = matches(y, sigma, GROUP_HARD, radius, patch_radius)
    basic = filtered(y, y, sigma, "hard", radius, patch_radius, groups=groups)
    if first_stage == "dct+biorthogonal":
        wavelets = filtered(y, y, sigma, "hard", radius, patch_radius, "biorthogonal", groups)
        basic = (basic + wavelets) / 2
    return filtered(y, basic, sigma, "wiener", radius, patch_radius)


def each_collaborative(
    y: torch.Tensor,
    sigma: torch.Tensor,
    sizes: Sizes | None = None,
    radius: int = SEARCH_RADIUS,
    patch_radius: int = PATCH_RADIUS,
    first_stage: str = "dct",
) -> torch.Tensor:
    """``collaborative`` of each image of ``y`` ``(B, c, H, W)`` at its noise level ``σ`` ``(B,)`` (in
    [0, 1] units), each alone: its own ``(h, w)`` of ``sizes`` in a padded batch (the padding stays 0).
    Not differentiated."""
    out = torch.zeros_like(y)
    with torch.no_grad():
        for k in range(y.shape[0]):
            h, w = y.shape[-2:] if sizes is None else sizes[k]
            image = y[k, :, :h, :w]
            out[k, :, :h, :w] = collaborative(image, float(sigma[k]), radius, patch_radius, first_stage)
    return out


def filtered(
    y: torch.Tensor,
    guide: torch.Tensor,
    sigma: float,
    stage: str,
    radius: int = SEARCH_RADIUS,
    patch_radius: int = PATCH_RADIUS,
    basis: str = "dct",
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One stage's estimate ``(c, H, W)`` from ``y`` ``(c, H, W)``: groups of patches of radius
    ``patch_radius`` matched within ``radius`` on ``guide`` (``y`` itself for ``hard``; the first
    stage's estimate, also the Wiener filter's pilot, for ``wiener``), or ``groups``, ``matches``'s
    already made on ``guide``. ``basis`` (``hard`` only): the DCT on the matched patches, or the
    biorthogonal wavelets on their ``2p``-pixel part ``−(p − 1)…p`` (the module docstring)."""
    c, height, width = y.shape
    p = patch_radius
    group = GROUP_HARD if stage == "hard" else GROUP_WIENER
    refs, members = matches(guide, sigma, group, radius, patch_radius) if groups is None else groups
    k = members.shape[1]
    k = 1 << (k.bit_length() - 1)  # a power of two for the Haar transform
    members = members[:, :k]
    if basis == "dct":
        n, low = 2 * p + 1, p
        factor = dct_matrix(n)
    elif basis == "biorthogonal" and stage == "hard":
        n, low = 2 * p, p - 1
        factor = biorthogonal_matrix(n)
    else:
        raise ValueError(f"the {stage} stage has no {basis!r} basis")
    transform = torch.kron(factor, factor)  # (n², n²) on a patch flattened row by row
    # the DCT is orthonormal: its inverse is its transpose
    inverse = (transform.T if basis == "dct" else torch.linalg.inv(transform)).to(y.device, y.dtype)
    transform = transform.to(y.device, y.dtype)
    stack = haar_matrix(k).to(y.device, y.dtype)
    window = torch.kaiser_window(n, periodic=False, beta=KAISER_BETA, dtype=torch.float64)
    window = torch.outer(window, window).reshape(-1).to(y.device, y.dtype)
    wide = width + 2 * p

    def canvas(image: torch.Tensor) -> torch.Tensor:
        """``image`` mirrored at its borders by ``p``, flat: ``(c, (H + 2p)·(W + 2p))``."""
        return mirror_pad(image[None], p)[0].reshape(c, -1)

    noisy = canvas(y)
    pilot = None if stage == "hard" else canvas(guide)
    # a patch about (i, j) covers the padded canvas's (i + p + di, j + p + dj), −low ≤ di, dj < n − low
    centre = (torch.arange(height)[:, None] + p) * wide + (torch.arange(width)[None, :] + p)
    centre = centre.reshape(-1).to(y.device)
    offsets = torch.arange(n, device=y.device) - low
    spread = (offsets[:, None] * wide + offsets[None, :]).reshape(-1)
    total = torch.zeros_like(noisy)
    mass = y.new_zeros(noisy.shape[1])
    # each coefficient's noise has std σ times its row's norm: 1 for the orthonormal DCT, so that its
    # threshold is λσ exactly
    threshold = THRESHOLD * sigma
    if basis != "dct":
        threshold = (threshold * transform.norm(dim=1)).to(y.device, y.dtype)
    # as many groups at a time as CHUNK (on a CPU, CPU_CHUNK) groups of the default grey patches hold
    # values: larger patches' chunks are smaller, so that their arrays, not the image's, set the
    # filter's peak memory
    default = GROUP_HARD * (2 * PATCH_RADIUS + 1) ** 2
    at_once = CPU_CHUNK if y.device.type == "cpu" else CHUNK
    chunk = max(1, at_once * default // (group * n * n * c))
    for start in range(0, refs.numel(), chunk):
        pixels = centre[members[start : start + chunk]][..., None] + spread  # (g, K, n²)
        spectrum = transformed(noisy[:, pixels].permute(1, 2, 0, 3), stack, transform)
        if stage == "hard":
            spectrum = spectrum * (spectrum.abs() >= threshold)
            weight = 1.0 / spectrum.ne(0).sum(dim=(1, 2, 3)).clamp(min=1).to(y.dtype)
        else:
            power = transformed(pilot[:, pixels].permute(1, 2, 0, 3), stack, transform).square()
            shrink = power / (power + sigma**2)
            spectrum = spectrum * shrink
            weight = 1.0 / shrink.square().sum(dim=(1, 2, 3)).clamp(min=torch.finfo(y.dtype).tiny)
        estimate = transformed(spectrum, stack.T, inverse)
        scale = (weight[:, None, None] * window).expand(-1, k, -1)
        flat = pixels.reshape(-1)
        total.index_add_(1, flat, (estimate * scale[:, :, None, :]).permute(2, 0, 1, 3).reshape(c, -1))
        mass.index_add_(0, flat, scale.reshape(-1))
    out = total / mass.clamp(min=torch.finfo(y.dtype).tiny)
    return out.reshape(c, height + 2 * p, wide)[:, p : p + height, p : p + width]
