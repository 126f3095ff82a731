"""Convolution operators on image batches with an explicit border rule.

``zeros`` is the kernel restricted to in-image pixels (Corollary 11: the
operator equals the dense Gram matrix over the grid); ``circular`` wraps the
image onto a torus (diagonalised by the 2-D DFT); ``reflect`` mirrors the
border without repeating the edge pixel.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Padding = Literal["zeros", "reflect", "circular"]


def conv(x: torch.Tensor, bank: torch.Tensor, padding: Padding = "zeros") -> torch.Tensor:
    """``(C * x)`` for ``x`` ``(B, c_in, H, W)`` and ``bank`` ``(c_out, c_in, kh, kw)`` with odd sides.

    Returns ``(B, c_out, H, W)``. The filter is applied as a correlation, which
    equals convolution for the symmetric filters that kernels produce.
    """
    kh, kw = bank.shape[-2:]
    if kh % 2 == 0 or kw % 2 == 0:
        raise ValueError(f"filter sides must be odd, got ({kh}, {kw})")
    ph, pw = kh // 2, kw // 2
    if padding == "zeros":
        return F.conv2d(x, bank, padding=(ph, pw))
    if padding == "reflect" and (ph >= x.shape[-2] or pw >= x.shape[-1]):
        raise ValueError(f"reflect padding needs the image larger than the filter radius ({ph}, {pw})")
    return F.conv2d(F.pad(x, (pw, pw, ph, ph), mode=padding), bank)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bank.shape[:2] == (1, 1) and x.shape[1] != 1:
            b, c, h, w = x.shape
            y = conv(x.reshape(b * c, 1, h, w), self.bank, self.padding).reshape(b, c, h, w)
        else:
            y = conv(x, self.bank, self.padding)
        return self.scale * y
