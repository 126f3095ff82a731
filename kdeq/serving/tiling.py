"""Images of any size, a tile at a time: cores that cover the image, each solved inside a halo.

An image of ``H × W`` pixels is cut into a grid of cores of about ``size × size`` (near-equal parts,
starting on even pixels); each tile reads its core and up to ``halo`` pixels around it (clipped at the
image's borders, and starting on multiples of 6, so that a guide network's 2×2 unshuffle and the
collaborative filter's grid of reference patches see the whole image's), is solved as
an image of its own, and writes back its core. Memory then grows with the tile, not the image: the
guided kernel's weight maps, its largest buffers, are a tile's.

What a tile alone would compute differently from its whole image, its task fixes first
(``Task.whole_image``: the denoiser's estimated ``σ`` and the channel means its guide network centres
on), or computes from the whole output after (``Task.whole_result``: the photon denoiser's peak).
With a halo of at least the model's ``reach``, each tile then poses its core's equations exactly as
the whole image does: the operator's rows and the prior mean there read nothing beyond the halo.
The tiled *solution* is still approximate wherever the task's solve is global: a kGLM-DEQ's
equilibrium ``z = m + K(K + λI)⁻¹(y − m)`` couples every pixel to every other through the resolvent,
whose influence decays with distance but never vanishes, and each tile's solver stops at its own
tolerance. ``docs/BENCHMARKS.md`` measures the difference against the untiled solve.

Tiles of one shape are solved in batches (``solve_batch``) and counted one by one by ``progress``. A
request's posterior standard deviation (``Request.uncertainty``) is each tile's, computed within the
tile, its cores put together like the output's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise, product

import numpy as np

from kdeq.maths.collab import STEP
from kdeq.predictors.base import Predictor
from kdeq.tasks.base import Request, Solved, Task, UncertaintyMap, solve_batch

#: the default tile side: on this project's CPU the default denoiser's 24-megapixel colour solve then
#: peaks within 2 GiB (docs/BENCHMARKS.md)
TILE_SIZE = 768

#: cores start at multiples of this (the guide networks' 2×2 pixel unshuffle)
ALIGN = 2
#: windows start at multiples of this: the unshuffle's blocks, and the reference patches of the
#: collaborative filter (``kdeq.maths.collab``, every ``STEP``-th pixel from the image's origin), are then
#: the whole image's
WINDOW_ALIGN = math.lcm(ALIGN, STEP)


@dataclass(frozen=True)
class Tile:
    """One tile: the image pixels it reads (``window``: its core and halo) and writes (``core``)."""

    window: tuple[slice, slice]
    core: tuple[slice, slice]

    @property
    def crop(self) -> tuple[slice, slice]:
        """The core within the window's own pixels."""
        return tuple(
            slice(c.start - w.start, c.stop - w.start) for c, w in zip(self.core, self.window, strict=True)
        )

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(w.stop - w.start for w in self.window)


def spans(length: int, size: int, halo: int) -> list[tuple[slice, slice]]:
    """``(window, core)`` along one axis of ``length`` pixels: ``⌈length/size⌉`` cores of near-equal
    length starting at multiples of ``ALIGN``, each window its core and ``halo`` either side, clipped
    to ``[0, length)`` and starting at a multiple of ``WINDOW_ALIGN``."""
    if size < 4 * ALIGN or size % ALIGN or halo < 0:
        raise ValueError(
            f"a tile is an even size of at least {4 * ALIGN} with a halo ≥ 0, got {size}, {halo}"
        )
    n = -(-length // size)
    bounds = [ALIGN * round(k * length / (n * ALIGN)) for k in range(n)] + [length]
    out = []
    for start, stop in pairwise(bounds):
        lo = max(0, start - halo) // WINDOW_ALIGN * WINDOW_ALIGN
        out.append((slice(lo, min(length, stop + halo)), slice(start, stop)))
    return out


def tiles(height: int, width: int, size: int, halo: int) -> list[Tile]:
    """The tiles of an ``height × width`` image, row-major: every pixel in exactly one core."""
    return [
        Tile((rw, cw), (rc, cc))
        for (rw, rc), (cw, cc) in product(spans(height, size, halo), spans(width, size, halo))
    ]


def tiled(task: Task, predictor: Predictor, request: Request, size: int) -> bool:
    """Whether ``request`` is solved in tiles of ``size`` (0: none are): its output is larger than one
    ``size × size`` tile and its task solves in tiles with ``predictor``."""
    height, width = task.output_size(request)
    return bool(size) and height * width > size * size and task.tile_halo(predictor) is not None


def solve_tiled(
    task: Task,
    predictor: Predictor,
    request: Request,
    size: int,
    halo: int | None = None,
    batch: int = 1,
    progress: Callable[[int], None] | None = None,
    batch_pixels: int | None = None,
) -> Solved:
    """``request`` solved a tile at a time (module docstring): tiles of about ``size × size`` output
    pixels with ``halo`` input pixels around them (default: the task's ``tile_halo``), each writing
    its core's output (``scale × scale`` output pixels per input pixel, a super-resolver's), up to
    ``batch`` tiles of one shape and ``batch_pixels`` pixels (at least one tile) per ``predict`` call;
    ``progress(n)`` after every ``n`` tiles done (an exception it raises abandons the solve). The
    result's output is the cores' outputs together; its iterations and residual are the largest of
    any tile's (a NaN residual wins), and it converged (is finite) where every tile did."""
    need = task.tile_halo(predictor)
    if need is None:
        raise ValueError(f"the {task.name} task solves whole images only; it has no tiled solve")
    height, width = request.image.shape[-2:]
    scale = task.output_size(request)[0] // height
    if task.output_size(request) != (scale * height, scale * width):
        raise ValueError(f"a tile's output is its input times one integer; {task.name}'s is not")
    if batch < 1:
        raise ValueError(f"the batch size is at least 1, got {batch}")
    whole = task.whole_image(predictor, request)
    # a super-resolver's memory is its output's: its tiles are ``size`` output pixels on a side
    side = max(4 * ALIGN, size // scale // ALIGN * ALIGN)
    parts = tiles(height, width, side, need if halo is None else halo)
    shapes: dict[tuple[int, int], list[Tile]] = {}
    for tile in parts:
        shapes.setdefault(tile.shape, []).append(tile)
    out: np.ndarray | None = None
    std: np.ndarray | None = None  # the posterior std's cores, when the request asked for it
    stats: list[Solved] = []  # each tile's result, its own output dropped (replaced by the whole's)
    for shape, group in shapes.items():
        step = batch if batch_pixels is None else max(1, min(batch, batch_pixels // (shape[0] * shape[1])))
        for i in range(0, len(group), step):
            chunk = group[i : i + step]
            solved = solve_batch(task, predictor, [task.cut(whole, *tile.window) for tile in chunk])
            for tile, result in zip(chunk, solved, strict=True):
                core, crop = _scaled(tile.core, scale), _scaled(tile.crop, scale)
                if out is None:
                    shape = (result.output.shape[0], scale * height, scale * width)
                    out = np.empty(shape, dtype=result.output.dtype)
                out[(slice(None), *core)] = result.output[(slice(None), *crop)]
                if result.uncertainty is not None:
                    if std is None:
                        std = np.empty((scale * height, scale * width), dtype=np.float32)
                    std[core] = result.uncertainty.std[crop]
                stats.append(replace(result, output=out))
            if progress is not None:
                progress(len(chunk))
    stitched = replace(
        stats[0],
        iterations=max(s.iterations for s in stats),
        residual=max((s.residual for s in stats), key=lambda r: math.inf if math.isnan(r) else r),
        converged=all(s.converged for s in stats),
        finite=all(s.finite for s in stats),
        history=None,  # one per tile: no single sequence is the image's
        uncertainty=None if std is None else _stitched(std, [s.uncertainty for s in stats]),
    )
    return task.whole_result(request, stitched)


def _scaled(pixels: tuple[slice, slice], scale: int) -> tuple[slice, slice]:
    """The output pixels of the input ``pixels`` of a task whose output is ``scale`` times its input."""
    return tuple(slice(scale * p.start, scale * p.stop) for p in pixels)


def _stitched(std: np.ndarray, parts: list[UncertaintyMap]) -> UncertaintyMap:
    """The whole image's map from its tiles' (``std`` their cores together): exact where every tile's
    was, the most probes and the largest estimated error of any tile."""
    errors = [p.error for p in parts if p.error is not None]
    return UncertaintyMap(
        std, all(p.exact for p in parts), max(p.probes for p in parts), max(errors) if errors else None
    )


def solve_requests(
    task: Task,
    predictor: Predictor,
    requests: Sequence[Request],
    size: int,
    batch: int = 1,
    batch_pixels: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Solved]:
    """``requests`` (one ``batch_key``) solved, in order: each larger than a ``size × size`` tile, of a
    task that solves in tiles, alone by ``solve_tiled`` (``batch``, ``batch_pixels`` and ``progress``
    passed on); the others together by ``solve_batch`` (``size`` 0: none tiled)."""
    cut = {k for k, r in enumerate(requests) if tiled(task, predictor, r, size)}
    whole = [r for k, r in enumerate(requests) if k not in cut]
    solved = iter(solve_batch(task, predictor, whole) if whole else [])
    return [
        solve_tiled(task, predictor, r, size, None, batch, progress, batch_pixels)
        if k in cut
        else next(solved)
        for k, r in enumerate(requests)
    ]
