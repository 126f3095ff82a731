"""Convolution operators on image batches with an explicit border rule.

``zeros`` is the kernel restricted to in-image pixels (Corollary 11: the
operator equals the dense Gram matrix over the grid); ``circular`` wraps the
image onto a torus (diagonalised by the 2-D DFT); ``symmetric`` mirrors the
border with the edge pixel repeated (diagonalised by the 2-D DCT-II for
filters even in each axis, ``kdeq.maths.transforms``); ``reflect`` mirrors it
without repeating the edge pixel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kdeq.runtime.backends import conv_zeros

Padding = Literal["zeros", "symmetric", "reflect", "circular"]


@dataclass(frozen=True)
class Stationary:
    """A map ``x ↦ s_b · (h * x)`` applied to each channel alike, as ``kdeq.maths.linear`` solves it.

    Attributes:
        taps: ``(k, k)`` centred filter ``h``.
        scale: per-sample factor ``(B, 1, 1, 1)``, or a scalar tensor.
        padding: the border rule of the convolution.
    """

    taps: torch.Tensor
    scale: torch.Tensor
    padding: Padding


def conv(x: torch.Tensor, bank: torch.Tensor, padding: Padding = "zeros") -> torch.Tensor:
    """``(C * x)`` for ``x`` ``(B, c_in, H, W)`` and ``bank`` ``(c_out, c_in, kh, kw)`` with odd sides.

    Returns ``(B, c_out, H, W)``. The filter is applied as a correlation, which
    equals convolution for the symmetric filters that kernels produce. A zero border goes through
    ``kdeq.runtime.backends`` (the implementation measured fastest for the shapes).
    """
    kh, kw = bank.shape[-2:]
    if kh % 2 == 0 or kw % 2 == 0:
        raise ValueError(f"filter sides must be odd, got ({kh}, {kw})")
    ph, pw = kh // 2, kw // 2
    if padding == "zeros":
        return conv_zeros(x, bank)
    if padding == "reflect" and (ph >= x.shape[-2] or pw >= x.shape[-1]):
        raise ValueError(f"reflect padding needs the image larger than the filter radius ({ph}, {pw})")
    if padding == "symmetric":
        return F.conv2d(symmetric_pad(x, ph, pw), bank)
    return F.conv2d(F.pad(x, (pw, pw, ph, ph), mode=padding), bank)


def symmetric_pad(x: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
    """``x`` ``(…, H, W)`` extended by ``ph`` rows and ``pw`` columns on each side as its mirror image
    with the edge repeated (``x[−1] = x[0]``); needs ``ph ≤ H`` and ``pw ≤ W``."""
    if ph > x.shape[-2] or pw > x.shape[-1]:
        raise ValueError(
            f"symmetric padding needs the image at least as large as the filter radius ({ph}, {pw})"
        )
    if pw:
        x = torch.cat([x[..., :pw].flip(-1), x, x[..., -pw:].flip(-1)], dim=-1)
    if ph:
        x = torch.cat([x[..., :ph, :].flip(-2), x, x[..., -ph:, :].flip(-2)], dim=-2)
    return x


class ScaledConv(torch.nn.Module):
    """``x ↦ s_b · (C * x)`` for a bank ``C`` and a per-sample scale ``s`` ``(B,)`` (e.g. ``±1/λ_b``).

    A bank with one input and one output channel is applied to every channel of
    ``x`` alike (the coregionalisation ``I ⊗ k``); otherwise ``x`` has ``c_in`` channels.
    """

    def __init__(self, bank: torch.Tensor, scale: torch.Tensor, padding: Padding = "zeros") -> None:
        super().__init__()
        self.bank = bank
        self.scale = scale.reshape(-1, 1, 1, 1)
        self.padding: Padding = padding

    def stationary(self) -> Stationary | None:
        """The map as one filter applied to every channel (``kdeq.maths.linear``), if it is one."""
        if self.bank.shape[:2] != (1, 1):
            return None
        return Stationary(self.bank[0, 0], self.scale, self.padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bank.shape[:2] == (1, 1) and x.shape[1] != 1:
            b, c, h, w = x.shape
            y = conv(x.reshape(b * c, 1, h, w), self.bank, self.padding).reshape(b, c, h, w)
        else:
            y = conv(x, self.bank, self.padding)
        return self.scale * y
