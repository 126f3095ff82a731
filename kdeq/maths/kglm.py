"""The kGLM → DEQ mapping (Theorem 3, Corollary 11): weights from a kernel and ``λ``.

    W1 = W3 = −K/λ,   W2 = K/λ,   V1 = −k(X̃, X)/λ,   V2 = k(X̃, X)/λ

in dense form (Gram matrices over arbitrary coordinates) or convolutional form
(a filter bank over the pixel grid, where ``K`` acts as a convolution). The
masked form for a per-request observed set is the same layer called with a
``mask`` (``kdeq.maths.deq``).
"""

from __future__ import annotations

import torch

from kdeq.maths.conv import Padding
from kdeq.maths.deq import KGLMDEQ, ConvMap, DenseMap
from kdeq.maths.families import Family
from kdeq.maths.implicit import Backward
from kdeq.maths.priors import Prior
from kdeq.maths.solvers import SolverConfig


def _check_lambda(lam: float) -> None:
    if not lam > 0:
        raise ValueError(f"λ must be positive, got {lam}")


def dense_deq(
    family: Family,
    prior: Prior,
    gram: torch.Tensor,
    lam: float,
    cross: torch.Tensor | None = None,
    solver: SolverConfig | None = None,
    backward: Backward = "implicit",
) -> KGLMDEQ:
    """The fully connected kGLM-DEQ for ``K = k(X, X)`` ``(n, n)`` and ``k(X̃, X)`` ``(ñ, n)``.

    ``cross`` defaults to ``K`` (``X̃ = X``, where ``η̃ = σ⁻¹(z)``). Inputs are ``(B, n)``.
    """
    _check_lambda(lam)
    same = cross is None
    cross = gram if cross is None else cross
    if gram.shape[0] != gram.shape[1] or cross.shape[1] != gram.shape[0]:
        raise ValueError(f"incompatible Gram {tuple(gram.shape)} and cross {tuple(cross.shape)}")
    w3 = None if prior.flat else DenseMap(-gram / lam)
    return KGLMDEQ(
        family,
        prior,
        DenseMap(-gram / lam),
        DenseMap(gram / lam),
        w3,
        DenseMap(-cross / lam),
        DenseMap(cross / lam),
        solver,
        backward,
        same_coordinates=same,
    )


def conv_deq(
    family: Family,
    prior: Prior,
    bank: torch.Tensor,
    lam: float,
    padding: Padding = "zeros",
    solver: SolverConfig | None = None,
    backward: Backward = "implicit",
) -> KGLMDEQ:
    """The convolutional kGLM-DEQ (Corollary 11) for a kernel filter bank ``(c, c, k, k)``.

    Inputs are ``(B, c, H, W)``; ``X̃ = X`` is the pixel grid, so ``V1 = W1`` and
    ``V2 = W2`` as filters. With ``padding="zeros"`` the operator is exactly the
    kernel's Gram matrix over in-image pixels.
    """
    _check_lambda(lam)
    if bank.shape[0] != bank.shape[1]:
        raise ValueError(f"a kernel filter bank is square in channels, got {tuple(bank.shape)}")
    w3 = None if prior.flat else ConvMap(-bank / lam, padding)
    return KGLMDEQ(
        family,
        prior,
        ConvMap(-bank / lam, padding),
        ConvMap(bank / lam, padding),
        w3,
        ConvMap(-bank / lam, padding),
        ConvMap(bank / lam, padding),
        solver,
        backward,
    )
