"""Test data and operators built independently of the library."""

import math

import torch


def binary_shapes(count: int, size: int, seed: int) -> torch.Tensor:
    """``count`` binary images ``(count, 1, size, size)`` of random discs and rectangles, float64."""
    gen = torch.Generator().manual_seed(seed)
    ii, jj = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    out = torch.zeros(count, 1, size, size, dtype=torch.float64)
    for b in range(count):
        for _ in range(3):
            ci, cj = torch.randint(2, size - 2, (2,), generator=gen).tolist()
            r = torch.randint(2, size // 3, (1,), generator=gen).item()
            if torch.rand(1, generator=gen).item() < 0.5:
                shape = (ii - ci) ** 2 + (jj - cj) ** 2 <= r * r
            else:
                shape = ((ii - ci).abs() <= r) & ((jj - cj).abs() <= r // 2 + 1)
            out[b, 0][shape] = 1.0
    return out


def flip(images: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """Flip a ``fraction`` of the pixels of binary ``images``, chosen independently."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.rand(images.shape, generator=gen, dtype=images.dtype) < fraction
    return torch.where(noise, 1.0 - images, images)


def dense_operator(op, shape: tuple[int, ...]) -> torch.Tensor:
    """The matrix of a linear operator on ``shape``, built column by column from basis vectors."""
    n = math.prod(shape)
    basis = torch.eye(n, dtype=torch.float64).reshape(n, *shape)
    return op(basis).reshape(n, -1).T
