"""A task over many image files in one process (``kdeq TASK IN [IN …] -o OUT``).

Every input is read and prepared before anything is solved, so a bad file or a missing mask stops the
run before it has written anything. The requests are then grouped by image shape and
``Task.batch_key`` (what one ``predict`` call may share: a PSF, a scale, a given or estimated ``σ``),
cut into batches of a given size or of the size ``run`` measures to be faster, and each batch is
solved by ``solve_batch`` and its outputs written at once. A batch of equal shapes solves, per
image, the system that image solves alone (``kdeq.predictors.base``), so batching changes the time, not
the results. An image larger than the tile size (``--tile``) of a task that solves in tiles is solved
a tile at a time (``kdeq.serving.tiling``), and its tiles are the unit of batching and of progress.

With one input ``OUT`` is the output file; with several it is a folder, each output named after its
input (``OUT/<stem>.png``; two inputs with one stem are refused rather than one overwriting the
other). A file input (the inpainter's ``mask``, the deblurrer's ``psf_image``) given as a file is
shared by every input; given as a folder, each input takes the file of its own stem there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from kdeq.images.imageio import read_counts, read_image, read_mask
from kdeq.predictors.base import Predictor, SolverOverride
from kdeq.serving import tiling
from kdeq.tasks.base import InputError, Options, Request, Solved, Task, solve_batch

T = TypeVar("T")

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".tif", ".tiff")


@dataclass(frozen=True)
class Job:
    """One input file, where its output goes, its prepared request, and the bit depth its output is
    written in (its input's for a task of photon counts, else 8)."""

    source: Path
    out: Path
    request: Request
    bits: int = 8


def outputs(inputs: Sequence[Path], out: Path) -> list[Path]:
    """Where each input's output goes: ``out`` itself for one input, ``out/<stem>.png`` for several
    (``ValueError`` when two inputs share a stem or ``out`` is an existing file)."""
    if len(inputs) == 1:
        return [out]
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; with several inputs -o names a folder")
    stems: dict[str, Path] = {}
    for path in inputs:
        if path.stem in stems:
            raise ValueError(f"{stems[path.stem]} and {path} would both be written to {out / path.stem}.png")
        stems[path.stem] = path
    return [out / f"{path.stem}.png" for path in inputs]


def matched_file(given: Path, source: Path) -> Path:
    """The file input for ``source``: ``given`` itself, or for a folder its one image of
    ``source``'s stem (``ValueError`` when there is none or more than one)."""
    if not given.is_dir():
        return given
    found = sorted(p for p in given.iterdir() if p.stem == source.stem and p.suffix.lower() in IMAGE_SUFFIXES)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise ValueError(f"{given} has {what} image named {source.stem}.* for {source}")
    return found[0]


def plan(
    task: Task,
    inputs: Sequence[Path],
    out: Path,
    options: Options,
    files: Mapping[str, Path],
    override: SolverOverride | None,
    uncertainty: bool = False,
) -> list[Job]:
    """Read and prepare every input (``ValueError`` naming the file at the first that fails), each
    request asking for its posterior standard deviation where ``uncertainty``."""
    jobs = []
    for source, target in zip(inputs, outputs(inputs, out), strict=True):
        given = {}
        for spec in task.files:
            if spec.name in files:
                path = matched_file(files[spec.name], source)
                reader = read_mask if spec.kind == "mask" else read_image
                given[spec.name] = _read(reader, path)
        bits = 8
        if task.counts:  # the values as stored: nothing is lost at low light
            found, full_scale = _opened(read_counts, source)
            image, bits = found[0].numpy(), 16 if full_scale > 255 else 8
        else:
            image = _read(read_image, source)
        try:
            request = replace(task.prepare(image, None, options, given, override), uncertainty=uncertainty)
            if uncertainty:
                task.check_uncertainty(request)
        except InputError as err:
            raise ValueError(f"{source}: {err.detail}") from None
        jobs.append(Job(source, target, request, bits))
    return jobs


def _read(reader: Callable[[Path], torch.Tensor], path: Path) -> np.ndarray:
    """``reader(path)``'s ``(c, H, W)`` array; ``ValueError`` naming the file when it is not an image."""
    return _opened(reader, path)[0].numpy()


def _opened(reader: Callable[[Path], T], path: Path) -> T:
    """``reader(path)``; ``ValueError`` naming the file when it is not an image."""
    try:
        return reader(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as err:  # PIL's UnidentifiedImageError is an OSError
        raise ValueError(f"{path}: not a readable image ({err})") from None


def groups(task: Task, jobs: Sequence[Job]) -> list[list[Job]]:
    """``jobs`` grouped by image shape and ``task.batch_key`` (what one ``predict`` call may share), in
    order of first appearance."""
    found: dict[Hashable, list[Job]] = {}
    for job in jobs:
        found.setdefault((job.request.image.shape, task.batch_key(job.request)), []).append(job)
    return list(found.values())


def batches(task: Task, jobs: Sequence[Job], size: int) -> list[list[Job]]:
    """``groups`` cut into batches of at most ``size``."""
    if size < 1:
        raise ValueError(f"the batch size is at least 1, got {size}")
    return [group[i : i + size] for group in groups(task, jobs) for i in range(0, len(group), size)]


#: the largest batch ``run`` tries when it measures
MEASURED_BATCH = 8


def units(task: Task, predictor: Predictor, job: Job, tile: int | None) -> int:
    """The progress units of ``job``: its tiles when ``tile`` (``kdeq.serving.tiling``) cuts it, else 1."""
    if not tiling.tiled(task, predictor, job.request, tile or 0):
        return 1
    height, width = job.request.image.shape[-2:]
    return len(tiling.tiles(height, width, tile, 0))


def run(
    task: Task,
    predictor: Predictor,
    jobs: Sequence[Job],
    size: int | None,
    tile: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Iterator[tuple[list[Job], list[Solved], float]]:
    """Solve ``jobs`` batch by batch: each batch, its results and its seconds, as it is done;
    ``progress(n)`` after every ``n`` units (``units``) done.

    An image larger than ``tile × tile`` pixels, of a task that solves in tiles, is solved alone a
    tile at a time (``kdeq.serving.tiling.solve_tiled``), its tiles batched by ``size`` (default 1), after the
    other images.

    ``size`` fixes the batches (``batches``). ``None`` measures, per group, whether batching pays: its
    first image is solved alone (a warm-up), its second alone and timed, then batches of 2, 4, … up
    to ``MEASURED_BATCH``, each timed, for as long as each is faster per image than the best before
    it; the rest goes in batches of the fastest size. Every measured solve is one of the run's own, so
    measuring costs only what the slower trials lose, and where batching does not pay it stops at a
    batch of two. (On this project's CPU the default guided denoiser runs ~1.5× slower per image in
    a batch of 8, its weight maps outgrowing the caches, and a stationary one ~7× faster.)"""
    whole = [job for job in jobs if not tiling.tiled(task, predictor, job.request, tile or 0)]
    cut = [job for job in jobs if tiling.tiled(task, predictor, job.request, tile or 0)]

    def solve(batch: list[Job]) -> tuple[list[Job], list[Solved], float]:
        start = time.perf_counter()
        solved = solve_batch(task, predictor, [job.request for job in batch])
        if progress is not None:
            progress(len(batch))
        return batch, solved, time.perf_counter() - start

    if size is not None:
        yield from (solve(batch) for batch in batches(task, whole, size))
    else:
        for group in groups(task, whole):
            yield solve(group[:1])  # a warm-up (lazy set-up, cold caches): not a measurement
            done, trial, best, chosen = 1, 1, math.inf, 1
            while trial <= MEASURED_BATCH and done < len(group):
                batch = group[done : done + trial]
                result = solve(batch)
                yield result
                done += len(batch)
                per_image = result[2] / len(batch)
                if per_image >= best:
                    break
                best, chosen, trial = per_image, len(batch), 2 * trial
            rest = group[done:]
            yield from (solve(rest[i : i + chosen]) for i in range(0, len(rest), chosen))
    for job in cut:
        start = time.perf_counter()
        solved = tiling.solve_tiled(task, predictor, job.request, tile, batch=size or 1, progress=progress)
        yield [job], [solved], time.perf_counter() - start
