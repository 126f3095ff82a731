"""The guided kernel's offset loops as fused Triton kernels, for GPUs (``KDEQ_GUIDED_BACKEND=triton``).

``kdeq.maths.adaptive`` makes the weight maps, applies ``K`` and sums the non-local matches an offset at a
time or by gathers: on a GPU a few launches per offset (about 1,900 per solve of one 256² image on an
H200, the chip idle four fifths of the time) or temporaries ``L`` times an image. Here each of those is
one launch per batch whatever the number of offsets ``L``: a program owns a tile of output pixels and
loops over the offsets, reading its inputs from cache, so that nothing is written but the output and
no two programs write one pixel (no atomics: the sums are deterministic).

- ``weights``: ``w_j(x) = k_j·e^{inv·D_j(x)}`` (0 where the exponent is at most ``cutoff`` or ``x``,
  ``x + o_j`` are not both in the image), ``D_j`` the patch distance.
- ``apply``: ``K x = Σ_j w_j ⊙ S_{o_j} x + Σ_{o_j ≠ 0} S_{−o_j}(w_j ⊙ x)``.
- ``pairs`` / ``patch_pairs``: the non-local means' sums (``GuidedOperator.nonlocal_mean``), the same
  signatures as ``kdeq.runtime.native``'s.

``weights`` and ``apply`` are ``torch.autograd.Function``\\ s with backward kernels of their own: ``K``
is symmetric, so ``∂L/∂x = K ∂L/∂out``; ``∂L/∂w_j(y) = ⟨g(y), x(y + o_j)⟩ + ⟨g(y + o_j), x(y)⟩``; and the
weights' gradient reaches the guide through the patch distances (``_guide_grad_kernel``), the taps and
``inv``. The trainer differentiates through them as through torch's loops.

Triton is an optional dependency (the ``gpu`` extra; torch's CUDA wheels carry it). Without it
``available()`` is false and kdeq uses its other backends. On a CPU the kernels run only through
Triton's interpreter (``TRITON_INTERPRET=1``, read when the kernels are first compiled), which is how
the test suite checks them on machines without a GPU. Kernels are compiled on first use, not at import,
and call only ``triton.language``'s builtins: its jitted helpers (``tl.zeros``) are wrapped when Triton
is imported, so that they would not run interpreted where ``TRITON_INTERPRET`` is set later, as the
tests set it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from kdeq.maths.filters import window_sum

try:  # the gpu extra; kdeq runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

log = logging.getLogger("kdeq.fused")

#: a tile of output pixels per program: rows × columns
BLOCK_H, BLOCK_W = 8, 32

Offsets = Sequence[tuple[int, int]]


def available() -> bool:
    """Whether Triton imports."""
    return triton is not None


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (``TRITON_INTERPRET=1``): on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _warn_cpu() -> None:
    log.warning(
        "the guided kernel's triton backend runs on CUDA devices, or on the CPU under "
        "TRITON_INTERPRET=1; torch's loops are used instead"
    )


def enabled(pinned: str | None, *tensors: torch.Tensor) -> bool:
    """Whether the guided kernel's loops for ``tensors`` run here, for the backend ``pinned`` (``None``:
    ``auto``): with Triton installed, all tensors on one device in one of float32 and float64, and
    ``triton`` pinned or ``auto`` on a CUDA device; a CPU only through the interpreter."""
    if pinned not in (None, "triton") or triton is None:
        return False
    device, dtype = tensors[0].device, tensors[0].dtype
    if dtype not in (torch.float32, torch.float64):
        return False
    if any(t.device != device or t.dtype != dtype for t in tensors):
        return False
    if device.type == "cuda":
        return True
    if pinned != "triton":  # auto: a CPU keeps its own loops
        return False
    if not interpreting():
        _warn_cpu()
        return False
    return device.type == "cpu"


# The kernels. They are plain functions here, compiled by ``triton.jit`` on first use (``_kernels``),
# so that TRITON_INTERPRET is read then rather than at import. A tile is ``ys`` (BH, 1) × ``xs`` (1, BW).


def _weights_kernel(
    P, SIZES, INV, TAPS, OA, OB, OUT,
    C, H, W, HP, WP, L, cutoff,
    N: tl.constexpr, DIST: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    # program (b·L + j, row tile, column tile): w_j or, with DIST, D_j (−1 outside the image)
    bj = tl.program_id(0).to(tl.int64)  # planes × their size may pass 2³¹
    b = bj // L
    j = bj % L
    ys = tl.program_id(1) * BH + tl.arange(0, BH)[:, None]
    xs = tl.program_id(2) * BW + tl.arange(0, BW)[None, :]
    a = tl.load(OA + j)
    c0 = tl.load(OB + j)
    h = tl.load(SIZES + 2 * b)
    w = tl.load(SIZES + 2 * b + 1)
    inside = (ys < h) & (xs < w) & (ys + a >= 0) & (ys + a < h) & (xs + c0 >= 0) & (xs + c0 < w)
    total = tl.full((BH, BW), 0, OUT.dtype.element_ty)
    # the torch loop's order: channels summed per pixel, then a patch row left to right, then the rows
    for dy in tl.static_range(N):
        row = tl.full((BH, BW), 0, OUT.dtype.element_ty)
        for dx in tl.static_range(N):
            sq = tl.full((BH, BW), 0, OUT.dtype.element_ty)
            for c in range(C):
                base = P + (b * C + c) * HP * WP
                here = tl.load(base + (ys + dy) * WP + xs + dx, mask=inside, other=0.0)
                there = tl.load(base + (ys + a + dy) * WP + xs + c0 + dx, mask=inside, other=0.0)
                d = here - there
                sq += d * d
            row += sq
        total += row
    valid = (ys < H) & (xs < W)
    target = OUT + (bj * H + ys) * W + xs
    if DIST:
        tl.store(target, tl.where(inside, total, -1.0), mask=valid)
    else:
        # the cut on the exponent, not on the exponential: compiled, tl.exp of float32 is the hardware's
        # approximate one, whose e^cutoff may land either side of the cut
        s = total * tl.load(INV + b)
        keep = inside & (s > cutoff)
        tl.store(target, tl.where(keep, tl.exp(s) * tl.load(TAPS + j), 0.0), mask=valid)


def _pairs_kernel(
    WGT, IDX, OA, OB, SCALE, X, OUT, BEST,
    C, LW, H, W, L,
    POWER: tl.constexpr, HAS_BEST: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    # program (b·C + channel, row tile, column tile): out += Σ_k u_k(y)x(y+o_k) + u_k(y−o_k)x(y−o_k),
    # u_k = (scale_k·w_{idx_k})^POWER, the second term left out for o_k = 0
    bc = tl.program_id(0).to(tl.int64)  # planes × their size may pass 2³¹
    b = bc // C
    ys = tl.program_id(1) * BH + tl.arange(0, BH)[:, None]
    xs = tl.program_id(2) * BW + tl.arange(0, BW)[None, :]
    valid = (ys < H) & (xs < W)
    image = X + bc * H * W
    acc = tl.load(OUT + bc * H * W + ys * W + xs, mask=valid, other=0.0)
    best = tl.full((BH, BW), 0, acc.dtype)
    for k in range(L):
        j = tl.load(IDX + k)
        a = tl.load(OA + k)
        c0 = tl.load(OB + k)
        scale = tl.load(SCALE + k)
        maps = WGT + (b * LW + j) * H * W
        ahead = valid & (ys + a >= 0) & (ys + a < H) & (xs + c0 >= 0) & (xs + c0 < W)
        u = tl.load(maps + ys * W + xs, mask=valid, other=0.0) * scale
        # o_k ≠ 0 as a tile, not a scalar: Triton's interpreter refuses a mask and-ed with a scalar
        moved = (ys * 0 + a * a + c0 * c0) != 0
        behind = valid & (ys - a >= 0) & (ys - a < H) & (xs - c0 >= 0) & (xs - c0 < W) & moved
        v = tl.load(maps + (ys - a) * W + xs - c0, mask=behind, other=0.0) * scale
        u0 = u
        v0 = v
        for _ in tl.static_range(POWER - 1):
            u = u * u0
            v = v * v0
        acc += u * tl.load(image + (ys + a) * W + xs + c0, mask=ahead, other=0.0)
        acc += v * tl.load(image + (ys - a) * W + xs - c0, mask=behind, other=0.0)
        if HAS_BEST:
            best = tl.maximum(best, tl.maximum(u, v))
    tl.store(OUT + bc * H * W + ys * W + xs, acc, mask=valid)
    if HAS_BEST:
        # every channel's program finds the same best; the first one writes it
        keep = valid & ((ys * 0 + bc % C) == 0)
        old = tl.load(BEST + b * H * W + ys * W + xs, mask=keep, other=0.0)
        tl.store(BEST + b * H * W + ys * W + xs, tl.maximum(old, best), mask=keep)


def _patch_kernel(
    WGT, IDX, OA, OB, SCALE, T, S,
    LW, H, W, L,
    POWER: tl.constexpr, PR: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    # program (b·L + k, tiles): S_k(q) = Σ_{|d|≤p} s_k(q + d), s_k(z) = u_k(z)·t(z)·t(z + o_k)
    bk = tl.program_id(0).to(tl.int64)  # planes × their size may pass 2³¹
    b = bk // L
    k = bk % L
    ys = tl.program_id(1) * BH + tl.arange(0, BH)[:, None]
    xs = tl.program_id(2) * BW + tl.arange(0, BW)[None, :]
    j = tl.load(IDX + k)
    a = tl.load(OA + k)
    c0 = tl.load(OB + k)
    scale = tl.load(SCALE + k)
    maps = WGT + (b * LW + j) * H * W
    t = T + b * H * W
    total = tl.full((BH, BW), 0, S.dtype.element_ty)
    for dy in tl.static_range(2 * PR + 1):
        row = tl.full((BH, BW), 0, S.dtype.element_ty)
        for dx in tl.static_range(2 * PR + 1):
            zy = ys + dy - PR
            zx = xs + dx - PR
            there = (zy >= 0) & (zy < H) & (zx >= 0) & (zx < W)
            match = there & (zy + a >= 0) & (zy + a < H) & (zx + c0 >= 0) & (zx + c0 < W)
            u = tl.load(maps + zy * W + zx, mask=match, other=0.0) * scale
            u0 = u
            for _ in tl.static_range(POWER - 1):
                u = u * u0
            u = u * tl.load(t + zy * W + zx, mask=match, other=0.0)
            row += u * tl.load(t + (zy + a) * W + zx + c0, mask=match, other=0.0)
        total += row
    tl.store(S + (bk * H + ys) * W + xs, total, mask=(ys < H) & (xs < W))


def _pairs_grad_kernel(
    G, X, OA, OB, OUT,
    C, H, W, L,
    BH: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    # program (b·L + j, tiles): ∂L/∂w_j(y) = Σ_c g(y)x(y + o_j) + [o_j ≠ 0] g(y + o_j)x(y)
    bj = tl.program_id(0).to(tl.int64)  # planes × their size may pass 2³¹
    b = bj // L
    j = bj % L
    ys = tl.program_id(1) * BH + tl.arange(0, BH)[:, None]
    xs = tl.program_id(2) * BW + tl.arange(0, BW)[None, :]
    a = tl.load(OA + j)
    c0 = tl.load(OB + j)
    valid = (ys < H) & (xs < W)
    ahead = valid & (ys + a >= 0) & (ys + a < H) & (xs + c0 >= 0) & (xs + c0 < W)
    twice = ahead & ((ys * 0 + a * a + c0 * c0) != 0)  # o_j ≠ 0, as a tile (see _pairs_kernel)
    acc = tl.full((BH, BW), 0, OUT.dtype.element_ty)
    for c in range(C):
        g = G + (b * C + c) * H * W
        x = X + (b * C + c) * H * W
        acc += tl.load(g + ys * W + xs, mask=valid, other=0.0) * tl.load(
            x + (ys + a) * W + xs + c0, mask=ahead, other=0.0
        )
        acc += tl.load(g + (ys + a) * W + xs + c0, mask=twice, other=0.0) * tl.load(
            x + ys * W + xs, mask=twice, other=0.0
        )
    tl.store(OUT + (bj * H + ys) * W + xs, acc, mask=valid)


def _guide_grad_kernel(
    P, Q, OA, OB, OUT,
    C, HP, WP, L,
    BH: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    # program (b·C + c, tiles of the padded guide): ∂L/∂P(z) = Σ_j 2Q_j(z)(P(z) − P(z + o_j))
    #                                                         + 2Q_j(z − o_j)(P(z) − P(z − o_j))
    bc = tl.program_id(0).to(tl.int64)  # planes × their size may pass 2³¹
    b = bc // C
    ys = tl.program_id(1) * BH + tl.arange(0, BH)[:, None]
    xs = tl.program_id(2) * BW + tl.arange(0, BW)[None, :]
    valid = (ys < HP) & (xs < WP)
    guide = P + bc * HP * WP
    here = tl.load(guide + ys * WP + xs, mask=valid, other=0.0)
    acc = tl.full((BH, BW), 0, OUT.dtype.element_ty)
    for j in range(L):
        a = tl.load(OA + j)
        c0 = tl.load(OB + j)
        q = Q + (b * L + j) * HP * WP
        ahead = valid & (ys + a >= 0) & (ys + a < HP) & (xs + c0 >= 0) & (xs + c0 < WP)
        behind = valid & (ys - a >= 0) & (ys - a < HP) & (xs - c0 >= 0) & (xs - c0 < WP)
        forward = tl.load(q + ys * WP + xs, mask=ahead, other=0.0)
        acc += forward * (here - tl.load(guide + (ys + a) * WP + xs + c0, mask=ahead, other=0.0))
        backward = tl.load(q + (ys - a) * WP + xs - c0, mask=behind, other=0.0)
        acc += backward * (here - tl.load(guide + (ys - a) * WP + xs - c0, mask=behind, other=0.0))
    tl.store(OUT + bc * HP * WP + ys * WP + xs, 2.0 * acc, mask=valid)


def _kernels() -> SimpleNamespace:
    """The kernels compiled by ``triton.jit``, or wrapped by its interpreter under ``TRITON_INTERPRET=1``."""
    return _jitted(interpreting())


@functools.cache
def _jitted(interpret: bool) -> SimpleNamespace:
    """The kernels, once per process and mode: ``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps."""
    names = ("weights", "pairs", "patch", "pairs_grad", "guide_grad")
    return SimpleNamespace(**{n: triton.jit(globals()[f"_{n}_kernel"]) for n in names})


def _grid(count: int, height: int, width: int) -> tuple[int, int, int]:
    return (count, triton.cdiv(height, BLOCK_H), triton.cdiv(width, BLOCK_W))


# Unbounded: a CUDA graph replaying ``apply`` reads these tensors by address without holding them, so
# they must live as long as the process (a few per model: its offsets, their indices and unit scales)
@functools.cache
def _ints(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``values`` as an int32 tensor on ``device``, made once (a copy from host memory waits)."""
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=torch.int32, device=device)


@functools.cache
def _reals(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=dtype, device=device)


def _offsets(offsets: Offsets, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The offsets' rows ``a`` and columns ``b`` as int32 ``(L,)`` tensors on ``device``."""
    return _ints(tuple(a for a, _ in offsets), device), _ints(tuple(b for _, b in offsets), device)


def _launch(device: torch.device) -> contextlib.AbstractContextManager:
    """The device guard a launch needs: Triton launches on the current CUDA device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _weight_maps(
    padded: torch.Tensor,
    taps: torch.Tensor,
    inv: torch.Tensor,
    sizes: torch.Tensor,
    oa: torch.Tensor,
    ob: torch.Tensor,
    n: int,
    cutoff: float,
    dist: bool,
) -> torch.Tensor:
    """``(B, L, H, W)``: the weight maps, or with ``dist`` the patch distances ``D_j`` (−1 where ``x`` or
    ``x + o_j`` is outside the image), of the mirrored guide ``padded`` ``(B, c, H + n − 1, W + n − 1)``."""
    bsz, channels, hp, wp = padded.shape
    height, width, count = hp - n + 1, wp - n + 1, oa.numel()
    out = padded.new_empty(bsz, count, height, width)
    with _launch(padded.device):
        _kernels().weights[_grid(bsz * count, height, width)](
            padded, sizes, inv, taps, oa, ob, out,
            channels, height, width, hp, wp, count, cutoff,
            N=n, DIST=dist, BH=BLOCK_H, BW=BLOCK_W,
        )  # fmt: skip
    return out


class _Weights(torch.autograd.Function):
    """``w = weights(padded, taps, inv)`` ``(B, L, H, W)``, differentiable w.r.t. all three."""

    @staticmethod
    def forward(ctx, padded, taps, inv, sizes, oa, ob, n, cutoff):
        padded, taps, inv = padded.contiguous(), taps.contiguous(), inv.contiguous()
        ctx.save_for_backward(padded, taps, inv, sizes, oa, ob)
        ctx.n, ctx.cutoff = n, cutoff
        return _weight_maps(padded, taps, inv, sizes, oa, ob, n, cutoff, dist=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        # w_j = k_j·E_j where kept, E_j = e^{inv·D_j}: ∂w/∂k_j = E_j and ∂w/∂(inv·D_j) = w_j
        padded, taps, inv, sizes, oa, ob = ctx.saved_tensors
        n, cutoff = ctx.n, ctx.cutoff
        bsz, channels, hp, wp = padded.shape
        # the distances made again rather than kept: a map per offset held per solve otherwise
        dist = _weight_maps(padded, taps, inv, sizes, oa, ob, n, cutoff, dist=True)
        exponent = dist * inv.reshape(-1, 1, 1, 1)
        e = torch.exp(exponent.clamp(min=cutoff))
        grad_e = torch.where((dist >= 0) & (exponent > cutoff), grad * e, 0.0)
        grad_taps = grad_e.sum(dim=(0, 2, 3))
        grad_exponent = grad_e * taps.reshape(1, -1, 1, 1)
        grad_inv = (grad_exponent * dist).sum(dim=(1, 2, 3))
        grad_dist = grad_exponent * inv.reshape(-1, 1, 1, 1)
        # Q_j(z) = Σ_{d ∈ [0, n)²} ∂L/∂D_j(z − d): the patch's box sum, transposed, (B, L, H + n − 1, ·)
        q = window_sum(window_sum(F.pad(grad_dist, (n - 1, n - 1, n - 1, n - 1)), n, -1), n, -2).contiguous()
        grad_padded = torch.empty_like(padded)
        with _launch(padded.device):
            _kernels().guide_grad[_grid(bsz * channels, hp, wp)](
                padded, q, oa, ob, grad_padded, channels, hp, wp, oa.numel(), BH=BLOCK_H, BW=BLOCK_W
            )
        return grad_padded, grad_taps, grad_inv, None, None, None, None, None


def _pairs(
    weights: torch.Tensor,
    index: torch.Tensor,
    oa: torch.Tensor,
    ob: torch.Tensor,
    scale: torch.Tensor,
    power: int,
    x: torch.Tensor,
    out: torch.Tensor,
    best: torch.Tensor | None,
) -> None:
    """``_pairs_kernel``'s sums added to ``out`` in place (``best`` too, where given)."""
    bsz, channels, height, width = x.shape
    with _launch(x.device):
        _kernels().pairs[_grid(bsz * channels, height, width)](
            weights, index, oa, ob, scale, x, out, out if best is None else best,
            channels, weights.shape[1], height, width, index.numel(),
            POWER=power, HAS_BEST=best is not None, BH=BLOCK_H, BW=BLOCK_W,
        )  # fmt: skip


class _Apply(torch.autograd.Function):
    """``K x`` ``(B, C, H, W)`` from weight maps ``(B, L, H, W)``, differentiable w.r.t. both."""

    @staticmethod
    def forward(ctx, weights, x, oa, ob):
        weights, x = weights.contiguous(), x.contiguous()
        ctx.save_for_backward(weights, x, oa, ob)
        return _kx(weights, x, oa, ob)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        weights, x, oa, ob = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_x = _kx(weights, grad, oa, ob)  # K is symmetric
        if ctx.needs_input_grad[0]:
            bsz, channels, height, width = x.shape
            grad_w = torch.empty_like(weights)
            with _launch(x.device):
                _kernels().pairs_grad[_grid(bsz * oa.numel(), height, width)](
                    grad, x, oa, ob, grad_w, channels, height, width, oa.numel(), BH=BLOCK_H, BW=BLOCK_W
                )
        return grad_w, grad_x, None, None


def _kx(weights: torch.Tensor, x: torch.Tensor, oa: torch.Tensor, ob: torch.Tensor) -> torch.Tensor:
    count = oa.numel()
    index = _ints(tuple(range(count)), x.device)
    out = torch.zeros_like(x, memory_format=torch.contiguous_format)
    _pairs(weights, index, oa, ob, _reals((1.0,) * count, x.dtype, x.device), 1, x, out, None)
    return out


def weights(
    padded: torch.Tensor,
    taps: torch.Tensor,
    inv: torch.Tensor,
    offsets: Offsets,
    sizes: Sequence[tuple[int, int]],
    patch: int,
    cutoff: float,
) -> torch.Tensor:
    """The guided kernel's weight maps ``(B, L, H, W)``: ``w_j(x) = k_j·e^{inv·D_j(x)}``, 0 where the
    exponent is at most ``cutoff`` or ``x`` or ``x + o_j`` is outside its image, with
    ``D_j(x) = ‖g(x) − g(x + o_j)‖²`` the distance of ``patch × patch`` patches of ``padded``
    ``(B, c, H + patch − 1, W + patch − 1)`` (each image mirrored at its own borders); ``taps`` ``k``
    ``(L,)``, ``inv`` ``(B,)``, ``sizes`` each image's ``(h, w)`` in its top-left corner. Differentiable
    w.r.t. ``padded``, ``taps`` and ``inv``."""
    device = padded.device
    oa, ob = _offsets(offsets, device)
    # not cached: every batch's sizes differ, and the weights are made outside the replayed steps
    box = torch.tensor([v for hw in sizes for v in hw], dtype=torch.int32, device=device)
    return _Weights.apply(padded, taps, inv, box, oa, ob, patch, cutoff)


def apply(weights: torch.Tensor, x: torch.Tensor, offsets: Offsets) -> torch.Tensor:
    """``K x = Σ_j w_j ⊙ S_{o_j} x + Σ_{o_j ≠ 0} S_{−o_j}(w_j ⊙ x)`` ``(B, C, H, W)`` for ``weights``
    ``(B, L, H, W)`` of ``offsets`` and ``x`` ``(B, C, H, W)`` (``S_o x(y) = x(y + o)``, 0 outside);
    ``w_j(y)`` must be 0 where ``y + o_j`` is outside the image. Differentiable w.r.t. both."""
    bsz, _, height, width = x.shape
    if tuple(weights.shape) != (bsz, len(offsets), height, width):
        raise ValueError(f"weights {tuple(weights.shape)}: not a map per offset of {tuple(x.shape)}")
    oa, ob = _offsets(offsets, x.device)
    return _Apply.apply(weights, x, oa, ob)


def pairs(
    weights: torch.Tensor,
    index: Sequence[int],
    offsets: Offsets,
    scale: Sequence[float],
    power: int,
    x: torch.Tensor,
    out: torch.Tensor,
    best: torch.Tensor | None = None,
) -> None:
    """``kdeq.runtime.native.pairs`` in one launch: ``out += Σ_j u_j ⊙ S_{o_j} x + Σ_{o_j ≠ 0} S_{−o_j}(u_j ⊙
    x)`` in place, ``u_j = (scale_j · weights[:, index_j])^power``; with ``best`` ``(B, 1, H, W)``,
    ``best ← max(best, u_j, S_{−o_j} u_j)``. ``x``, ``out`` ``(B, C, H, W)`` contiguous. Not
    differentiated."""
    _writable(x, out, best)
    if not index:
        return
    device = x.device
    oa, ob = _offsets(offsets, device)
    idx, factors = _ints(tuple(index), device), _reals(tuple(scale), x.dtype, device)
    _pairs(weights.contiguous(), idx, oa, ob, factors, power, x.contiguous(), out, best)


def patch_pairs(
    weights: torch.Tensor,
    index: Sequence[int],
    offsets: Offsets,
    scale: Sequence[float],
    power: int,
    t: torch.Tensor,
    patch_radius: int,
    x: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``kdeq.runtime.native.patch_pairs`` in two launches: ``out += Σ_j S_j ⊙ S_{o_j} x + S_{−o_j}(S_j ⊙ x)``
    with the box sums ``S_j(q) = Σ_{|d|≤p} s_j(q + d)``, ``s_j(z) = (scale_j · weights[:, index_j](z))^power
    · t(z) t(z + o_j)`` (0 unless ``z`` and ``z + o_j`` are in the array). ``t`` ``(B, 1, H, W)``, ``x``,
    ``out`` ``(B, C, H, W)``. Not differentiated."""
    _writable(x, out)
    if not index:
        return
    device, count = x.device, len(index)
    bsz, _, height, width = x.shape
    oa, ob = _offsets(offsets, device)
    idx, factors = _ints(tuple(index), device), _reals(tuple(scale), x.dtype, device)
    weights, t = weights.contiguous(), t.contiguous()
    sums = x.new_empty(bsz, count, height, width)
    with _launch(device):
        _kernels().patch[_grid(bsz * count, height, width)](
            weights, idx, oa, ob, factors, t, sums, weights.shape[1], height, width, count,
            POWER=power, PR=patch_radius, BH=BLOCK_H, BW=BLOCK_W,
        )  # fmt: skip
    ones = _reals((1.0,) * count, x.dtype, device)
    _pairs(sums, _ints(tuple(range(count)), device), oa, ob, ones, 1, x.contiguous(), out, None)


def _writable(x: torch.Tensor, *tensors: torch.Tensor | None) -> None:
    """The outputs are written in place through their pointers: each must be contiguous, and none may
    share memory with the input ``x``, whose neighbours other programs read."""
    if any(t is not None and not t.is_contiguous() for t in tensors):
        raise ValueError("kdeq.maths.fused writes only contiguous outputs")
    memory = x.untyped_storage().data_ptr()
    if any(t is not None and t.untyped_storage().data_ptr() == memory for t in tensors):
        raise ValueError("kdeq.maths.fused does not write over its input")
