"""Adaptive kernels: a kernel on augmented coordinates ``(position, guide feature)`` (DESIGN §2.5).

    k(x, x') = k_s(x − x') · exp(−‖g(x) − g(x')‖² / 2h²)

``k_s`` is a tapered stationary kernel of radius ``R`` (``kdeq.maths.kernels``) and
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

import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from kdeq.maths import fused
from kdeq.maths.filters import mirror_pad, window_sum
from kdeq.maths.kernels import Kernel
from kdeq.runtime import native


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


def _radius(weights: torch.Tensor) -> int:
    """``R`` from the number of weight maps ``O = ((2R+1)² + 1)/2``."""
    return math.isqrt(2 * weights.shape[1] - 1) // 2


Offsets = Sequence[tuple[int, int]]

#: each image's ``(h, w)`` in the top-left corner of a padded batch (``kdeq.predictors.base``)
Sizes = Sequence[tuple[int, int]]


def _inside(shape: tuple[int, int], offsets: Offsets, device: torch.device, sizes: Sizes) -> torch.Tensor:
    """``1[x ∈ image and x + o ∈ image]`` as bool ``(B, len(offsets), H, W)``, each image's ``(h, w)``
    (``sizes``) in the top-left corner of the ``H×W`` batch."""
    height, width = shape
    rows = torch.arange(height, device=device).reshape(1, 1, height, 1)
    cols = torch.arange(width, device=device).reshape(1, 1, 1, width)
    a = torch.tensor([o[0] for o in offsets], device=device).reshape(1, -1, 1, 1)
    b = torch.tensor([o[1] for o in offsets], device=device).reshape(1, -1, 1, 1)
    h = torch.tensor([s[0] for s in sizes], device=device).reshape(-1, 1, 1, 1)
    w = torch.tensor([s[1] for s in sizes], device=device).reshape(-1, 1, 1, 1)
    return (rows < h) & (cols < w) & (rows + a >= 0) & (rows + a < h) & (cols + b >= 0) & (cols + b < w)


def _pad_each(guide: torch.Tensor, p: int, sizes: Sizes | None) -> torch.Tensor:
    """Each image mirrored by ``p`` at its own borders, in a zero ``(B, c, H+2p, W+2p)`` batch."""
    if sizes is None:
        return mirror_pad(guide, p)
    out = guide.new_zeros(*guide.shape[:2], guide.shape[-2] + 2 * p, guide.shape[-1] + 2 * p)
    for k, (h, w) in enumerate(sizes):
        out[k, :, : h + 2 * p, : w + 2 * p] = mirror_pad(guide[k : k + 1, :, :h, :w], p)[0]
    return out


def guided_weights(
    guide: torch.Tensor,
    spatial: torch.Tensor,
    patch_radius: int,
    h2: torch.Tensor,
    offsets: Offsets | None = None,
    sizes: Sizes | None = None,
) -> torch.Tensor:
    """Weight maps ``w_o(x) = k_s(o)·exp(−‖g(x) − g(x+o)‖²/2h²)`` ``(B, O, H, W)``, unnormalised.

    ``guide`` ``(B, c, H, W)``; ``spatial`` the taps ``k_s(o)`` ``(2R+1, 2R+1)``
    centred at ``(R, R)`` and point-symmetric; ``h2`` ``(B,)``; ``offsets`` a
    part of the half set (default all of it; ``O`` is its length), so that a
    large image can be processed a part at a time. ``sizes``: each image's
    ``(h, w)`` when the batch holds smaller images in its top-left corners,
    padded; every weight touching the padding is 0 and each image's weights
    are those it has alone (its guide is mirrored at its own borders).

    The patch distance is a box sum of per-pixel squared differences. Offsets
    are processed a few at a time. Without autograd every step runs in place in
    a scratch buffer or in the output: fresh temporaries of this size cost
    page faults and memory traffic, not arithmetic; on the CPU the compiled
    loop of ``kdeq.runtime.native`` makes them, where it builds.
    """
    bsz, c, height, width = guide.shape
    r, p = spatial.shape[0] // 2, patch_radius
    chosen = half_offsets(r) if offsets is None else list(offsets)
    padded = _pad_each(guide, p, sizes)
    inv = (-0.5 / h2.clamp(min=torch.finfo(guide.dtype).tiny)).reshape(bsz, 1, 1, 1)
    rows, cols, _ = _indices(tuple(chosen), r, spatial.device)
    taps = spatial[rows, cols]
    if fused.enabled(native.choice.pinned(), guide, spatial, h2):
        every = sizes or [(height, width)] * bsz
        return fused.weights(padded, taps, inv.reshape(-1), chosen, every, 2 * p + 1, _CUTOFF)
    # the guide zero-padded by r, read shifted by the gathers and torch's loops (not by the compiled ones)
    if _gathers(guide):
        src = F.pad(padded, (r, r, r, r))
        return _guided_weights_gathered(padded, src, taps, inv, r, 2 * p + 1, chosen, sizes)
    inplace = not (torch.is_grad_enabled() and any(t.requires_grad for t in (guide, spatial, h2)))
    shape = (bsz, len(chosen), height, width)
    out = _kept.take(shape, guide) if inplace else guide.new_empty(shape)
    if native.enabled(guide, spatial, h2):
        native.weights(padded, chosen, taps, inv.reshape(-1), _CUTOFF, out)
        if sizes is not None:
            _zero_outside(out, chosen, sizes)
        return out
    src = F.pad(padded, (r, r, r, r))
    hp, wp = padded.shape[-2:]
    n = 2 * p + 1
    if inplace:
        sq = guide.new_empty(bsz, _CHUNK, hp, wp)
        rows = guide.new_empty(bsz, _CHUNK, hp, width)
        diff = guide.new_empty(bsz, c, hp, wp) if c > 1 else None

    def shifted(a: int, b: int) -> torch.Tensor:
        return src[..., r + a : r + a + hp, r + b : r + b + wp]

    for start in range(0, len(chosen), _CHUNK):
        part = chosen[start : start + _CHUNK]
        tap = taps[start : start + len(part)].reshape(1, -1, 1, 1)
        w = out[:, start : start + len(part)]
        # e^-60 is far below float32 resolution next to the centre weight; cutting there keeps
        # the weights out of subnormal range, where exp and every later product are ~10× slower
        if not inplace:
            dist = torch.stack([(padded - shifted(a, b)).square().sum(dim=1) for a, b in part], dim=1)
            e = torch.exp((window_sum(window_sum(dist, n, -1), n, -2) * inv).clamp(min=_CUTOFF))
            w.copy_(torch.where(e > _FLOOR, e, 0.0) * tap)
        else:
            for j, (a, b) in enumerate(part):
                if diff is None:
                    torch.sub(padded, shifted(a, b), out=sq[:, j : j + 1])
                else:
                    torch.sum(torch.sub(padded, shifted(a, b), out=diff).square_(), dim=1, out=sq[:, j])
            dist = sq[:, : len(part)]
            if diff is None:
                dist.square_()
            window_sum(window_sum(dist, n, -1, rows[:, : len(part)]), n, -2, w).mul_(inv)
            F.threshold(w.clamp_(min=_CUTOFF).exp_(), _FLOOR, 0.0, inplace=True).mul_(tap)
        _zero_outside(w, part, sizes)
    return out


#: the most bytes of weight maps kept between solves on a CPU, to be written again by the next solve
#: of at most that size. Maps beyond glibc's largest mmap threshold (32 MiB) are fresh pages at every
#: solve, each faulted in on its first write: one 512² image's 118 MiB made the default denoiser's
#: solve 1.2x slower than kept maps on this project's 2-core CPU
#: (docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "kept weight maps"). Above this size the maps are
#: allocated per solve, and their memory is given back after it
KEPT_BYTES = 256 << 20


class _KeptBuffer:
    """One CPU buffer of weight maps, kept between solves and handed out again once no tensor uses it."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._free_users = 0  # its storage's user count while only this object holds it
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` on ``like``'s device and dtype: the kept buffer's first
        elements when it is large enough and unused (the operator that had it is gone), else a new
        buffer, kept in its place when within ``KEPT_BYTES``. An unused kept buffer that does not serve
        is let go before the new one is made, so that the two are never held at once. Off the CPU
        (whose allocators cache on their own) a plain ``empty``."""
        if like.device.type != "cpu":
            return like.new_empty(shape)
        numel = math.prod(shape)
        with self._lock:
            if self._buffer is not None and _users(self._buffer) == self._free_users:
                if self._buffer.dtype == like.dtype and self._buffer.numel() >= numel:
                    return self._buffer[:numel].view(shape)
                self._buffer = None
            if numel * like.element_size() > KEPT_BYTES:
                return like.new_empty(shape)
            # made outside inference mode, so that solves in and out of it may both write it
            with torch.inference_mode(False):
                self._buffer = torch.empty(numel, dtype=like.dtype)
            self._free_users = _users(self._buffer)
            return self._buffer.view(shape)


def _users(t: torch.Tensor) -> int:
    """How many tensors hold ``t``'s storage (``t`` and its views), plus the storage object asked."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_kept = _KeptBuffer()


def _zero_outside(w: torch.Tensor, offsets: Offsets, sizes: Sizes | None) -> None:
    """Zero ``w_o(x)`` ``(B, len(offsets), H, W)`` where ``x`` or ``x + o`` is outside its image. For a
    whole batch of one size that is a few border rows and columns per offset (``a ≥ 0`` in the half set)."""
    if sizes is not None:
        w.mul_(_inside(tuple(w.shape[-2:]), offsets, w.device, sizes))
        return
    height, width = w.shape[-2:]
    for j, (a, b) in enumerate(offsets):
        w[:, j, max(height - a, 0) :].zero_()
        if b > 0:
            w[:, j, :, max(width - b, 0) :].zero_()
        elif b < 0:
            w[:, j, :, : min(-b, width)].zero_()


def _power_(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x^k`` in place for an integer ``k ≥ 1``: its odd part by ``pow``, then squarings (the CPU's
    ``pow`` is ~14× slower beyond a cube than its products, on this project's 2-core machine)."""
    twos = (k & -k).bit_length() - 1
    if k >> twos > 1:
        x.pow_(k >> twos)
    for _ in range(twos):
        x.square_()
    return x


_CHUNK = 4
_CUTOFF = -60.0
_FLOOR = math.exp(_CUTOFF)

#: about one core's cache: the patch-aggregated non-local mean processes as many offsets' maps
#: together as fit in it (``GuidedOperator.nonlocal_mean``)
_MATCH_CACHE_BYTES = 1 << 20


def apply_weights(weights: torch.Tensor, x: torch.Tensor, offsets: Offsets | None = None) -> torch.Tensor:
    """``K x`` per sample and channel: ``(Kx)(y) = Σ_{x'} k(y, x') x(x')`` for ``x`` ``(B, c, H, W)``.

    Each stored ``w_o(x)`` serves both ``k(x, x+o)`` and ``k(x+o, x)``, so ``K`` is symmetric.
    ``weights`` ``(B, O, H, W)`` belong to ``offsets`` (default the whole half set); over a
    partition of the half set the products add up to ``K x``. On the CPU, outside autograd, the
    compiled loop of ``kdeq.runtime.native`` computes it, which relies on ``w_o(x) = 0`` wherever ``x + o`` is
    outside the image (as ``guided_weights`` makes them).
    """
    height, width = x.shape[-2:]
    chosen = half_offsets(_radius(weights)) if offsets is None else offsets
    if fused.enabled(native.choice.pinned(), weights, x):
        return fused.apply(weights, x, chosen)
    if native.enabled(weights, x):
        out = torch.zeros_like(x, memory_format=torch.contiguous_format)
        native.pairs(weights, range(len(chosen)), chosen, [1.0] * len(chosen), 1, x, out)
        return out
    r = max(max(abs(a), abs(b)) for a, b in chosen)
    xp = F.pad(x, (r, r, r, r))
    if _gathers(x):
        return _apply_gathered(weights, x, xp, chosen, r)
    out = torch.zeros_like(x)
    back = torch.zeros_like(xp)
    for k, (a, b) in enumerate(chosen):
        w = weights[:, k : k + 1]
        if a == 0 and b == 0:
            out.addcmul_(w, x)
            continue
        out.addcmul_(w, xp[..., r + a : r + a + height, r + b : r + b + width])
        back[..., r + a : r + a + height, r + b : r + b + width].addcmul_(w, x)
    return out + back[..., r : r + height, r : r + width]


#: bytes of temporaries one group of offsets may take in the gathered steps
GATHER_BYTES = 256 << 20
#: the most pixels (batch × height × width) made and applied by gathers on a GPU. There a small
#: batch's time is the loop's ~2,500 launches: gathered, one 256² image was 3.8-4.3x faster on an
#: H100. A large batch's time is the bytes the gathers add: 0.93x at one 1024² image, 0.62x at 32
#: of 256² (same run)
GATHER_PIXELS = 1 << 19


def _compiled(*tensors: torch.Tensor):
    """The compiled loops that sum the non-local matches of ``tensors`` (not differentiated):
    ``kdeq.runtime.native`` on a CPU where it builds, ``kdeq.maths.fused`` on a GPU (both ``pairs`` and
    ``patch_pairs``), or ``None``: torch's operations."""
    if native.enabled(*tensors):
        return native
    if fused.enabled(native.choice.pinned(), *tensors):
        return fused
    return None


def _gathers(x: torch.Tensor) -> bool:
    """Whether the weights for ``x`` ``(B, c, H, W)`` are made and applied by gathers, a group of
    offsets at a time, rather than an offset at a time in place: on a GPU, for at most
    ``GATHER_PIXELS`` pixels. A CPU's caches favour the loop at every size (at one 256² image the
    gathers take 2.7x its time on this project's 2-core machine)."""
    return x.device.type != "cpu" and x.shape[0] * x.shape[-2] * x.shape[-1] <= GATHER_PIXELS


@functools.lru_cache(maxsize=256)
def _indices(offsets: tuple[tuple[int, int], ...], r: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(r + a, r + b)`` of each offset as index tensors on ``device``, made once (a copy to a GPU
    from ordinary host memory waits for it)."""
    with torch.inference_mode(False):  # made while serving, used again while training
        rows = torch.tensor([r + a for a, _ in offsets], device=device)
        cols = torch.tensor([r + b for _, b in offsets], device=device)
        return rows, cols, torch.arange(len(offsets), device=device)


def _groups(offsets: Offsets, per_offset: int) -> list[tuple[int, Offsets]]:
    """``offsets`` in consecutive groups (with each group's start) whose temporaries, ``per_offset``
    bytes each, stay within ``GATHER_BYTES``."""
    size = max(1, GATHER_BYTES // max(per_offset, 1))
    return [(i, offsets[i : i + size]) for i in range(0, len(offsets), size)]


def _shifts(src: torch.Tensor, offsets: Offsets, r: int, height: int, width: int) -> torch.Tensor:
    """``S_o x = src[..., r+a : r+a+height, r+b : r+b+width]`` for every offset ``o = (a, b)``, in one
    gather: ``(B, c, L, height, width)`` from ``src`` ``(B, c, height + 2r, width + 2r)``."""
    rows, cols, _ = _indices(tuple(offsets), r, src.device)
    return src.unfold(2, height, 1).unfold(3, width, 1)[:, :, rows, cols]


def _guided_weights_gathered(
    padded: torch.Tensor,
    src: torch.Tensor,
    taps: torch.Tensor,
    inv: torch.Tensor,
    r: int,
    n: int,
    chosen: Offsets,
    sizes: Sizes | None,
) -> torch.Tensor:
    """``guided_weights`` by gathers, a group of offsets a few launches rather than a few per offset
    (on a GPU the launches, not the arithmetic, bound a small image): the same weights, with the same
    additions in the same order per element. ``padded`` the guide mirrored by the patch radius
    ``(B, c, H+2p, W+2p)``, ``src`` that zero-padded by ``r``, ``inv`` ``−1/2h²`` ``(B, 1, 1, 1)``."""
    bsz, c, hp, wp = padded.shape
    height, width = hp - n + 1, wp - n + 1
    shape = (height, width)
    inside = _inside(shape, chosen, padded.device, sizes or [shape] * bsz)
    parts = []
    for start, part in _groups(chosen, 3 * bsz * (c + 1) * hp * wp * padded.element_size()):
        dist = (padded.unsqueeze(2) - _shifts(src, part, r, hp, wp)).square().sum(dim=1)
        e = torch.exp((window_sum(window_sum(dist, n, -1), n, -2) * inv).clamp(min=_CUTOFF))
        tap = taps[start : start + len(part)].reshape(1, -1, 1, 1)
        parts.append(torch.where(e > _FLOOR, e, 0.0) * tap * inside[:, start : start + len(part)])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _apply_gathered(
    weights: torch.Tensor, x: torch.Tensor, xp: torch.Tensor, chosen: Offsets, r: int
) -> torch.Tensor:
    """``apply_weights``' ``K x = Σ_o w_o ⊙ S_o x + Σ_{o ≠ 0} S_{−o}(w_o ⊙ x)`` by gathers (see
    ``_guided_weights_gathered``), ``xp`` ``x`` zero-padded by ``r``. The second sum pads each
    product ``w_o ⊙ x`` and reads it back shifted by ``−o``: one gather for a group of offsets."""
    bsz, c, height, width = x.shape
    out = torch.zeros_like(x)
    for start, part in _groups(chosen, 4 * bsz * c * (height + 2 * r) * (width + 2 * r) * x.element_size()):
        w = weights[:, start : start + len(part)].unsqueeze(1)  # (B, 1, L, H, W)
        out = out + (w * _shifts(xp, part, r, height, width)).sum(dim=2)
        if (0, 0) in part:  # the centre is its own mirror image: counted once, above
            j = list(part).index((0, 0))
            w, part = torch.cat([w[:, :, :j], w[:, :, j + 1 :]], dim=2), [*part[:j], *part[j + 1 :]]
        if not part:
            continue
        products = F.pad(w * x.unsqueeze(2), (r, r, r, r))  # (B, c, L, H + 2r, W + 2r)
        rows, cols, index = _indices(tuple((-a, -b) for a, b in part), r, x.device)
        back = products.unfold(3, height, 1).unfold(4, width, 1)[:, :, index, rows, cols]
        out = out + back.sum(dim=2)
    return out


#: memory for weight maps and their temporaries on a CPU (bytes); beyond it they are recomputed
WEIGHT_BUDGET = 1 << 30
#: share of a CUDA device's free memory the weight maps may take (the rest is for the solve itself,
#: the other models and a batch's other tensors)
WEIGHT_BUDGET_FREE_SHARE = 0.25


def weight_budget(device: torch.device) -> int:
    """Bytes the guided kernel's weight maps may take on ``device``: ``WEIGHT_BUDGET`` on a CPU, and
    ``WEIGHT_BUDGET_FREE_SHARE`` of the memory free on a CUDA device when this is called (a model
    asks when it is loaded; the figure counts what every process on the device holds)."""
    if device.type != "cuda":
        return WEIGHT_BUDGET
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * WEIGHT_BUDGET_FREE_SHARE)


def _spread(mass: torch.Tensor, centre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the matches' mass ``Σ_o u_o`` and largest match ``max_o u_o`` ``(B, 1, H, W)``: the spread
    ``log(1 + Σ_o u_o / c)``, the centre's weight ``c`` (the largest match, 1 where there is none) and
    the normaliser ``Z = c + Σ_o u_o``."""
    centre = torch.where(centre > 0, centre, 1.0)
    return torch.log1p(mass / centre), centre, mass + centre


class GuidedOperator:
    """``K̃``: ``K`` or ``D^{-1/2} K D^{-1/2}`` (``d = K1``) of a batch of guides, as an operator.

    One offset's weight map holds ``B·H·W`` numbers (the temporaries that make
    them are a few maps at a time). When the ``O`` maps fit in ``budget`` bytes
    they are made once and kept; otherwise they are remade at every
    application, in parts of as many offsets as fit, so a solve's memory stays
    within the budget whatever the image size, at the price of recomputing the
    weights. Both give the same ``K̃``. ``sizes`` as in ``guided_weights``.

    Attributes:
        degree: ``d = K1`` ``(B, 1, H, W)`` of the unnormalised kernel.
        local_mean: ``D⁻¹K v`` ``(B, c, H, W)``, the kernel-weighted local mean of ``mean_of`` ``v``
            (``None`` without it), made in the same pass over the weights as ``d``: one pass rather
            than two, each channel's arithmetic that of a pass of its own.
        parts: how many parts the offsets are processed in (1: the weights are kept).
    """

    def __init__(
        self,
        guide: torch.Tensor,
        spatial: torch.Tensor,
        patch_radius: int,
        h2: torch.Tensor,
        normalize: bool,
        budget: int = WEIGHT_BUDGET,
        sizes: Sizes | None = None,
        mean_of: torch.Tensor | None = None,
    ) -> None:
        self._args = (guide, spatial, patch_radius, h2)
        self._sizes = sizes
        offsets = half_offsets(spatial.shape[0] // 2)
        per_offset = guide.shape[0] * guide.shape[-2] * guide.shape[-1] * guide.element_size()
        size = max(1, min(len(offsets), budget // per_offset))
        self._parts = [offsets[i : i + size] for i in range(0, len(offsets), size)]
        self._weights = guided_weights(*self._args, sizes=sizes) if len(self._parts) == 1 else None
        ones = torch.ones_like(guide[:, :1])
        both = self.kernel(ones if mean_of is None else torch.cat([ones, mean_of.to(ones.dtype)], dim=1))
        self.degree = both[:, :1]
        tiny = torch.finfo(guide.dtype).tiny
        self.local_mean = None if mean_of is None else both[:, 1:] / self.degree.clamp(min=tiny)
        # 0 on a padded batch's padding (d = 0 there), not tiny^{-1/2}: its square overflowed float64 and
        # its products with the gradients there did too, NaN through the weights' masks (K̃x is 0 there
        # either way; inside an image d ≥ k_s(0) and s is as it was)
        scale = self.degree.clamp(min=tiny).rsqrt()
        self._scale = torch.where(self.degree > 0, scale, 0.0) if normalize else None

    @property
    def parts(self) -> int:
        return len(self._parts)

    def diagonal(self) -> torch.Tensor:
        """``diag K̃`` ``(B, 1, H, W)``: ``k(x, x) = k_s(0)·e⁰``, times ``s(x)² = 1/d(x)`` when normalised
        (0 on a padded batch's padding)."""
        guide, spatial = self._args[:2]
        r = spatial.shape[0] // 2
        centre = spatial[r, r].expand(guide.shape[0], 1, *guide.shape[-2:])
        if self._sizes is not None:
            centre = centre * _inside(tuple(guide.shape[-2:]), [(0, 0)], guide.device, self._sizes)
        return centre if self._scale is None else centre * self._scale.square()

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """``K x`` of the unnormalised kernel for ``x`` ``(B, c, H, W)``."""
        if self._weights is not None:
            return apply_weights(self._weights, x)
        out = torch.zeros_like(x)
        for part, weights in self._weight_parts():
            out = out + apply_weights(weights, x, part)
        return out

    def _weight_parts(self) -> Iterator[tuple[Offsets, torch.Tensor]]:
        """Each part of the half set of offsets with its weight maps ``(B, len(part), H, W)``: the kept
        maps, or made again a part at a time."""
        if self._weights is not None:
            yield self._parts[0], self._weights
            return
        for part in self._parts:
            yield part, guided_weights(*self._args, part, self._sizes)

    def nonlocal_mean(
        self, v: torch.Tensor, power: int, patches: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-local means of ``v`` ``(B, c, H, W)`` with this kernel's patch distances at the bandwidth
        ``h/√κ`` (``κ = power``) over its whole window, and the matches' mass:

            u_o(x) = (w_o(x)/k_s(o))^κ = exp(−κ‖g(x) − g(x+o)‖²/2h²),    o ≠ 0, both directions,
            ν(x) = (c(x)·v(x) + Σ_o u_o(x)·v(x+o)) / Z(x),    Z(x) = c(x) + Σ_o u_o(x),
            c(x) = max_o u_o(x) (1 where it is 0: no match, ν = v),

        the centre weighing as the best match rather than as ``u_0 = 1``, non-local means' rule. With
        ``patches``, each patch's group of matches estimates every pixel of the patch, and a pixel's
        estimate averages those of the ``(2p+1)²`` patches that cover it (block matching's
        aggregation), the weights normalised symmetrically as the kernel's are:

            ν(q) = Σ_{|d|≤p} Σ_o s_o(q−d)·v(q+o) / Σ_{|d|≤p} Σ_o s_o(q−d),
            s_o(z) = u_o(z)/√(Z(z)·Z(z+o)),   s_0(z) = c(z)/Z(z),

        over patch centres ``z`` inside the image. Returns ``ν`` ``(B, c, H, W)`` and
        ``log(1 + Σ_o u_o / c)`` ``(B, 1, H, W)``, at most ``log (2R+1)²`` (``c`` is the sum's largest
        term). Not differentiated."""
        inside = self._inside_of(v)
        both = torch.cat([inside, v], dim=1)
        with torch.no_grad():
            # the patch mean needs Z alone from this pass: the mass without the matches
            total, centre = self._match_sums(inside if patches else both, power)
            spread, centre, norm = _spread(total[:, :1], centre)
            if not patches:
                return (total[:, 1:] + centre * v) / norm, spread
            return self._patch_mean(v, both, centre, norm, inside, power), spread

    def match_spread(self, like: torch.Tensor, power: int) -> torch.Tensor:
        """``nonlocal_mean``'s ``log(1 + Σ_o u_o / c)`` ``(B, 1, H, W)`` alone, for images shaped as
        ``like`` ``(B, c, H, W)``: one pass over the matches' mass. Not differentiated."""
        with torch.no_grad():
            return _spread(*self._match_sums(self._inside_of(like), power))[0]

    def _inside_of(self, v: torch.Tensor) -> torch.Tensor:
        """``(B, 1, H, W)``: 1 inside each image, 0 on a padded batch's padding (a patch's pixels may
        lie there, its centre not)."""
        if self._sizes is None:
            return torch.ones_like(v[:, :1])
        return _inside(tuple(v.shape[-2:]), [(0, 0)], v.device, self._sizes).to(v.dtype)

    def _match_sums(self, summed: torch.Tensor, power: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``Σ_o u_o ⊙ S_o m + S_{−o}(u_o ⊙ m)`` over the offsets ``o ≠ 0`` of the half set, for ``m`` =
        ``summed`` ``(B, C, H, W)``, and ``max_o`` of ``u_o`` and ``S_{−o} u_o`` ``(B, 1, H, W)``: ``u_o(x)``
        is a match of ``x`` at ``+o`` and of ``x + o`` at ``−o``, so each offset's map adds to both, as
        ``K``'s weights do (``apply_weights``)."""
        best = torch.zeros_like(summed[:, :1], memory_format=torch.contiguous_format)
        loops = _compiled(summed, self._args[0])
        if loops is not None:
            total = torch.zeros_like(summed, memory_format=torch.contiguous_format)
            for weights, index, offsets, inverse in self._matches():
                loops.pairs(weights, index, offsets, inverse, power, summed, total, best)
            return total, best
        r = self._args[1].shape[0] // 2
        height, width = summed.shape[-2:]
        summed = F.pad(summed, (r, r, r, r))
        total, best = torch.zeros_like(summed), F.pad(best, (r, r, r, r))
        here = (..., slice(r, r + height), slice(r, r + width))
        total_here, summed_here, best_here = total[here], summed[here], best[here]

        def add(u: torch.Tensor, offsets: Offsets) -> None:
            a, b = offsets[0]
            there = (..., slice(r + a, r + a + height), slice(r + b, r + b + width))
            total_here.addcmul_(u, summed[there])
            total[there].addcmul_(u, summed_here)
            torch.maximum(best_here, u, out=best_here)
            best_there = best[there]
            torch.maximum(best_there, u, out=best_there)

        self._each_match(power, add)
        return total_here, best_here

    def _matches(self) -> Iterator[tuple[torch.Tensor, list[int], Offsets, list[float]]]:
        """Each part's weight maps ``(B, L, H, W)`` with the indices among them, the offsets and the
        ``1/|k_s(o)|`` of its offsets ``o ≠ 0`` whose taps are not 0: the centre weighs ``c``, and a
        zero tap's offset has no weight (``w_o/k_s(o) ≥ 0`` whatever the tap's sign)."""
        r = self._args[1].shape[0] // 2
        taps = self._args[1].tolist()
        for part, weights in self._weight_parts():
            index = [k for k, (a, b) in enumerate(part) if (a, b) != (0, 0) and taps[r + a][r + b] != 0]
            offsets = [part[k] for k in index]
            yield weights, index, offsets, [abs(1 / taps[r + a][r + b]) for a, b in offsets]

    def _each_match(self, power: int, step: Callable[[torch.Tensor, Offsets], None], chunk: int = 1) -> None:
        """``step(u, offsets)`` for runs of at most ``chunk`` consecutive offsets of ``_matches``, with
        ``u_o = (w_o/k_s(o))^κ`` ``(B, len(offsets), H, W)`` in one buffer: a few maps at a time, in
        cache for ``step``'s products."""
        for weights, index, offsets, inverse in self._matches():
            buffer = weights.new_empty(weights.shape[0], chunk, *weights.shape[-2:])
            start = 0
            while start < len(index):
                end = start + 1
                while end - start < chunk and end < len(index) and index[end] == index[end - 1] + 1:
                    end += 1
                u = buffer[:, : end - start]
                if end - start == 1:
                    torch.mul(weights[:, index[start] : index[start] + 1], inverse[start], out=u)
                else:
                    scale = weights.new_tensor(inverse[start:end]).reshape(1, -1, 1, 1)
                    torch.mul(weights[:, index[start] : index[end - 1] + 1], scale, out=u)
                step(_power_(u, power), offsets[start:end])
                start = end

    def _patch_mean(
        self,
        v: torch.Tensor,
        both: torch.Tensor,
        centre: torch.Tensor,
        norm: torch.Tensor,
        inside: torch.Tensor,
        power: int,
    ) -> torch.Tensor:
        """``nonlocal_mean``'s patch-aggregated ``ν`` ``(B, c, H, W)`` from ``c``, ``Z``,
        ``1[x ∈ image]`` ``(B, 1, H, W)`` and ``[1, v]`` ``(B, 1 + c, H, W)``."""
        spatial, p = self._args[1], self._args[2]
        r, n = spatial.shape[0] // 2, 2 * p + 1
        height, width = v.shape[-2:]
        # Z^{-1/2} at patch centres inside the image, 0 elsewhere: a group is only an image's patch
        scale = norm.rsqrt() * inside
        # c/Z, not c·s²: s² overflows where Z is subnormal (u_o^κ of weak matches); its box sum over
        # the centres, zero beyond the image (no patch is centred there)
        box = window_sum(window_sum(F.pad(centre / norm * inside, (p, p, p, p)), n, -1), n, -2)
        loops = _compiled(both, self._args[0])
        if loops is not None:
            total = (box * both).contiguous()
            for weights, index, offsets, inverse in self._matches():
                loops.patch_pairs(weights, index, offsets, inverse, power, scale, p, both, total)
            return torch.where(inside > 0, total[:, 1:] / total[:, :1], v)
        here = (..., slice(r, r + height), slice(r, r + width))
        both, scale = F.pad(both, (r, r, r, r)), F.pad(scale, (r, r, r, r))
        total = torch.zeros_like(both)
        # a few offsets' maps at a time, together within about a core's cache: fewer, larger operations where
        # the maps are small, one map at a time where one fills it (the pass is bound by memory: all of a
        # row's offsets at once was slower: docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "matches
        # aggregated by patch")
        chunk = max(1, min(16, _MATCH_CACHE_BYTES // (both.shape[0] * height * width * both.element_size())))
        box_in = both.new_zeros(both.shape[0], chunk, height + 2 * p, width + 2 * p)
        rows = both.new_empty(both.shape[0], chunk, height + 2 * p, width)
        boxed = both.new_empty(both.shape[0], chunk, height, width)

        def interior(k: int) -> torch.Tensor:
            return box_in[:, :k, p : p + height, p : p + width]

        def box_sums(k: int) -> torch.Tensor:
            return window_sum(window_sum(box_in[:, :k], n, -1, rows[:, :k]), n, -2, boxed[:, :k])

        total_here, both_here, scale_here = total[here], both[here], scale[here]
        total_here.addcmul_(box, both_here)

        # each group's weights summed over the patches covering a pixel: a box sum of s_o over centres;
        # one box serves o and −o, since s_o(z) = s_{−o}(z + o) and a pixel q + d of z + o's patch
        # matches q + d − o of z's
        def add(u: torch.Tensor, offsets: Offsets) -> None:
            k = len(offsets)
            inner = torch.mul(u, scale_here, out=interior(k))
            for j, (a, b) in enumerate(offsets):
                inner[:, j : j + 1].mul_(scale[..., r + a : r + a + height, r + b : r + b + width])
            sums = box_sums(k)
            for j, (a, b) in enumerate(offsets):
                there = (..., slice(r + a, r + a + height), slice(r + b, r + b + width))
                total_here.addcmul_(sums[:, j : j + 1], both[there])
                total[there].addcmul_(sums[:, j : j + 1], both_here)

        self._each_match(power, add, chunk)
        total = total[here]
        # a padded batch's padding is no image's pixel: v as it is there
        return torch.where(inside > 0, total[:, 1:] / total[:, :1], v)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``K̃ x``: ``K x``, or ``s ⊙ K(s ⊙ x)`` with ``s = d^{-1/2}`` when normalised."""
        if self._scale is None:
            return self.kernel(x)
        return self._scale * self.kernel(self._scale * x)


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
    """``x ↦ s·K̃ x`` for a ``GuidedOperator`` ``K̃`` and a scale ``s`` ``(B,)`` (e.g. ``±1/λ``)."""

    def __init__(self, operator: GuidedOperator, scale: torch.Tensor) -> None:
        super().__init__()
        self.operator = operator
        self.scale = scale.reshape(-1, 1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.operator(x)
