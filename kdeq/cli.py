"""The ``kdeq`` command line.

- ``kdeq TASK IN [IN …] -o OUT`` for every registered task (``kdeq.registry.TASKS``: denoise,
  inpaint, …), with the task's options and file inputs as flags: run a repository model on image
  files in one process, batched by size (``kdeq.serving.batchrun``), and print the solver statistics of each
  and, for several, a summary; the exit status is 3 when a solve did not converge; a task's variants
  (``kdeq.registry.choice_of``) are asked for on its host's command too (``kdeq denoise --noise poisson``);
- ``kdeq remote --url URL TASK IN [IN …] -o OUT``: the same, with the same task arguments, solved by a
  kdeq service over HTTP (``kdeq.client``; the API key from ``--api-key`` or ``KDEQ_API_KEY``);
- ``kdeq models``: list the repository;
- ``kdeq samples DIR``: write generated sample images to try the models on;
- ``kdeq init SPEC.json`` / ``kdeq init --defaults``: write kGLM-initialised checkpoints;
  ``kdeq init --prior DIR [SPEC.json]``: compose plug-and-play models (``kdeq.maths.pnp``) around the
  denoiser checkpoint ``DIR`` (without SPEC files, the shipped ones);
- ``kdeq train …``: fine-tune a checkpoint on images (``kdeq.train``); ``kdeq prune SRC --channels N``:
  cut a denoiser's guide network to its ``N`` most salient features, the start of a leaner model, and
  ``--colour-channels N`` its colour network, grown from the grey one where it has none
  (``kdeq.train.prune``);
- ``kdeq experiment init-compare …``: the paper's kGLM-vs-random initialisation experiment;
  ``kdeq experiment kerdeq …`` and ``kdeq experiment mondeq …``: the seeds' KerDEQ and monotone-DEQ
  claims on scikit-learn's digits (``kdeq.research.exp_kerdeq``, ``kdeq.research.exp_mondeq``);
- ``kdeq demo``: see below;
- commands of other installed packages, registered under the ``kdeq.commands`` entry-point
  group (``kdeq serve`` comes from the ``service`` package, which ``kdeq`` never imports).

Bad input (a file, a flag's value, a model) exits with status 2 and one line on standard error: no
traceback, no usage, no pydantic dump. ``kdeq TASK`` checks every file's header before it decodes any,
as the service does and with its words (``kdeq.images.imageio.load_image``): PNG, JPEG, WebP or TIFF, at most
``--max-pixels`` pixels, or ``--max-untiled-pixels`` for a model that does not solve in tiles (the
service's ``KDEQ_MAX_PIXELS`` and ``KDEQ_MAX_UNTILED_PIXELS``, same defaults), one frame, at least
2×2. On a terminal, work past a couple of seconds shows a progress line on standard error
(``Progress``); a denoise that finds no noise to remove says so (``UNRESOLVED_SIGMA``).

``kdeq demo`` denoises a generated test image with the closed-form kGLM-DEQ
(a stationary tapered kernel, the global mean of Appendix H, ``λ`` from the
noise level, DESIGN §2.6) using each solver, and prints PSNR and the per-sample
solver statistics. It needs no data and no checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Collection, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from types import UnionType
from typing import Literal, NoReturn, TypeVar, Union, get_args, get_origin

import numpy as np
import torch
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from kdeq.client import DEFAULT_RETRY_BUDGET, DEFAULT_TIMEOUT, Client, KdeqError, Result
from kdeq.images import scaledpng
from kdeq.images.imageio import (
    MAX_PIXELS,
    MAX_UNTILED_PIXELS,
    PIXEL_LIMITS,
    ImageRefusedError,
    check_mask_size,
    open_image,
    pixel_limit,
    write_png,
)
from kdeq.maths.families import Gaussian
from kdeq.maths.kernels import Kernel
from kdeq.maths.kglm import conv_deq
from kdeq.maths.noise import MAD_TO_STD
from kdeq.maths.priors import GaussianPrior
from kdeq.maths.solvers import SolverConfig
from kdeq.models.checkpoint import CheckpointError, ModelSpec, load_checkpoint
from kdeq.models.repository import default_models_dir, find_reference, list_models, load_predictor
from kdeq.predictors.base import SolverOverride
from kdeq.predictors.uncertainty import unsupported
from kdeq.registry import TASKS, choice_of
from kdeq.runtime import heap
from kdeq.serving import batchrun
from kdeq.serving.tiling import TILE_SIZE
from kdeq.tasks.base import Solved, Task


def test_image(size: int) -> torch.Tensor:
    """A piecewise-smooth ``(1, 1, size, size)`` image in [0, 1]: discs, a ramp and soft shading."""
    ii, jj = torch.meshgrid(
        torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32), indexing="ij"
    )
    u, v = ii / size, jj / size
    img = 0.2 + 0.5 * v + 0.1 * torch.sin(6 * math.pi * u)
    img = torch.where((u - 0.35) ** 2 + (v - 0.4) ** 2 < 0.04, 0.9, img)
    img = torch.where((u - 0.7).abs() + (v - 0.7).abs() < 0.15, 0.1, img)
    return img.clamp(0, 1)[None, None]


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB for images in [0, 1]."""
    return 10 * math.log10(1.0 / (x.clamp(0, 1) - ref).square().mean().item())


def demo(size: int, sigma: float, seed: int) -> None:
    clean = test_image(size)
    gen = torch.Generator().manual_seed(seed)
    noisy = clean + (sigma / 255.0) * torch.randn(clean.shape, generator=gen)
    kern = Kernel(profile="se", lengthscale=1.5, radius=5)
    bank = kern.filter()[None, None]
    # a non-negative filter's symbol peaks at ω = 0, so ‖K‖ is at most the sum of its taps
    kernel_norm = bank.sum().item()
    # GP reading of λ (DESIGN §2.6): λ = σ_noise²/s² for prior amplitude s², here s = 0.25
    lam = (sigma / 255.0) ** 2 / 0.25**2 * kernel_norm
    layer = conv_deq(Gaussian(), GaussianPrior(), bank, lam)
    mean = noisy.mean().expand_as(noisy)
    ratio = kernel_norm / lam
    print(f"image {size}×{size}, noise σ={sigma:g}/255 (seed {seed}), kernel {kern!r}")
    print(f"λ={lam:.4g}, ‖K/λ‖ ≤ {ratio:.3g} (plain iteration needs < 1)")
    print(f"noisy input: PSNR {psnr(noisy, clean):.2f} dB")
    for method in ("fixed_point", "anderson", "cg"):
        cfg = SolverConfig(method=method, tol=1e-4, max_iter=500)
        start = time.perf_counter()
        with torch.inference_mode():
            out = layer(noisy, mean=mean, mean_out=mean, solver=cfg)
        elapsed = time.perf_counter() - start
        s = out.stats
        print(
            f"{method:>11}: PSNR {psnr(out.eta, clean):.2f} dB, iterations {s.iterations.item()}, "
            f"residual {s.residual.item():.2e}, converged {bool(s.converged.item())}, {elapsed * 1e3:.0f} ms"
        )


def _option_type(info: FieldInfo) -> dict:
    """``argparse`` keywords (``type``, ``choices``) for an ``Options`` field."""
    kind = info.annotation
    if get_origin(kind) in (Union, UnionType):  # X | None: the flag is absent for None
        kind = next(a for a in get_args(kind) if a is not type(None))
    if get_origin(kind) is Literal:
        choices = get_args(kind)
        return {"type": type(choices[0]), "choices": choices}
    return {"type": kind}


def add_task_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, task: Task, skip: Collection[str] = ()
) -> None:
    """``--OPTION`` for each of ``task``'s options and ``--FILE`` for each of its file inputs, but
    those named in ``skip`` (already there)."""
    for name, info in task.options.model_fields.items():
        if name in skip:
            continue
        default = "" if info.is_required() or info.default is None else f" (default {info.default})"
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            required=info.is_required(),
            help=f"{info.description}{default}",
            **_option_type(info),
        )
    for spec in task.files:
        if spec.name in skip:
            continue
        parser.add_argument(
            "--" + spec.name.replace("_", "-"), dest=spec.name, metavar="FILE", help=spec.description
        )


def add_task_command_arguments(
    parser: argparse.ArgumentParser, task: Task, inputs_help: str, model_help: str
) -> None:
    """What ``kdeq TASK`` and ``kdeq remote TASK`` both take: the input files, ``-o``, the model, the
    solver overrides and ``task``'s own arguments (``add_task_arguments``)."""
    parser.add_argument("input", nargs="+", help=inputs_help)
    parser.add_argument(
        "-o", "--out", required=True, help="output PNG; with several inputs, a folder of <stem>.png"
    )
    parser.add_argument("--model", help=model_help)
    parser.add_argument("--tol", type=float, help="solver tolerance override")
    parser.add_argument("--max-iter", type=int, help="solver iteration cap override")
    if task.predictor.has_posterior:
        parser.add_argument(
            "--uncertainty",
            metavar="OUT",
            help="also write the output's posterior standard deviation as a 16-bit grey PNG (pixel × "
            "its kdeq:scale text chunk = std on the output's [0, 1] scale); with several inputs, a "
            "folder of <stem>.png",
        )
    add_task_arguments(parser, task)
    choice = choice_of(task)
    if choice is not None:
        parser.add_argument("--" + choice.field, choices=list(choice.tasks), help=choice.description)
        present = set(task.options.model_fields) | {f.name for f in task.files}
        for value, variant in choice.tasks.items():
            own = (set(variant.options.model_fields) | {f.name for f in variant.files}) - present
            if variant is not task and own:
                group = parser.add_argument_group(f"with --{choice.field} {value} ({variant.name})")
                add_task_arguments(group, variant, skip=present)
                present |= own


def chosen_task(host: Task, args: argparse.Namespace) -> Task:
    """The task that ``kdeq <host>``'s arguments ask for: ``host``, or the variant its choice's option
    picks (``choice_of``); ``ValueError`` naming another task's options where they were given."""
    choice = choice_of(host)
    if choice is None:
        return host
    task = choice.pick(getattr(args, choice.field))
    given = {name for name, value in vars(args).items() if value is not None}
    misplaced = choice.misplaced(task, given)
    if misplaced:
        options = ", ".join("--" + name.replace("_", "-") for name in misplaced)
        raise ValueError(f"{options}: not for --{choice.field} {choice.value_of(task)}")
    return task


def _solve_line(source: Path | None, model: str, result: Solved | Result, timing: str) -> str:
    """The line ``kdeq TASK`` and ``kdeq remote TASK`` print per image: its source (with several),
    the model, the solver's statistics, λ, the task's result fields, and ``timing``."""
    extra = "".join(f", {k} {v:.4g}" for k, v in result.fields.items() if v is not None)
    found = result.uncertainty
    if found is not None:
        how = "exact" if found.exact else f"{found.probes} probes, ~{100 * (found.error or 0.0):.1f} % error"
        extra += f", std max {float(found.std.max()):.4g} ({how})"
    return (
        f"{f'{source}: ' if source is not None else ''}{model}: iterations {result.iterations}, "
        f"residual {result.residual:.3e}, converged {result.converged}, lambda {result.lam:.4g}"
        f"{extra}, {timing}"
    )


M = TypeVar("M", bound=BaseModel)

#: the least noise level (0–255) the estimator resolves on 8-bit pixels: half a grey level, the
#: smallest non-zero finest diagonal Haar coefficient ``|d|`` of integer pixels, over ``Φ⁻¹(3/4)``
#: (``kdeq.maths.noise``): ≈ 0.74. A grey image's estimate under it is exactly 0 (most of its flattest
#: coefficients are 0); a colour image's (the patch estimate, continuous) reads there noise too weak
#: to tell from the rounding's own (1/√12 ≈ 0.29 grey levels): 0.40 at σ = 0.25, 0.58 at σ = 0.5
UNRESOLVED_SIGMA = 0.5 / MAD_TO_STD
#: the tasks whose only work is taking noise of level σ away, so that an estimate under
#: ``UNRESOLVED_SIGMA`` leaves them nothing to do (the output is the input to within a grey level);
#: deblur still sharpens and the impulse denoiser still removes impulses at σ = 0
NOISE_ONLY_TASKS = ("denoise",)


def _allowed(info: FieldInfo | None) -> str:
    """A numeric field's range from its bounds (``ge``, ``gt``, ``le``, ``lt``), as ``[0, 255]`` or
    ``(0, ∞)``; ``""`` where it has none."""
    low, high = ("(", "−∞"), ("∞", ")")
    for item in info.metadata if info is not None else ():
        for key, lower, bracket in (
            ("ge", True, "["),
            ("gt", True, "("),
            ("le", False, "]"),
            ("lt", False, ")"),
        ):
            bound = getattr(item, key, None)
            if bound is not None:
                low, high = ((bracket, f"{bound:g}"), high) if lower else (low, (f"{bound:g}", bracket))
    if low[1] == "−∞" and high[0] == "∞":
        return ""
    return f"{low[0]}{low[1]}, {high[0]}{high[1]}"


def _validation_line(err: ValidationError, model: type[BaseModel] | None = None) -> str:
    """``err`` on one line, each error's place, then its message. With ``model`` (the options or
    the solver override a command's flags fill) the place is the flag and its value, and the message
    ends with the field's allowed range; without, the dotted place (a spec file's field)."""
    parts = []
    for e in err.errors(include_url=False):
        loc = [str(p) for p in e["loc"]]
        if model is None or not loc:
            parts.append(f"{'.'.join(loc)}: {e['msg']}" if loc else e["msg"])
            continue
        allowed = _allowed(model.model_fields.get(loc[0]))
        value = e["input"] if isinstance(e["input"], (int, float, str)) else None
        place = "--" + loc[0].replace("_", "-") + ("" if value is None else f" {value}")
        parts.append(f"{place}: {e['msg']}" + (f" (allowed: {allowed})" if allowed else ""))
    return "; ".join(parts)


def _validated(model: type[M], values: Mapping[str, object]) -> M:
    """``model(**values)`` from a command's flags; ``ValueError`` of one line naming each bad flag, its
    value and its allowed range (``_validation_line``)."""
    try:
        return model(**values)
    except ValidationError as err:
        raise ValueError(_validation_line(err, model)) from None


def _one_line(err: BaseException) -> str:
    """``err``'s message on one line (a pydantic error's by ``_validation_line``; any other's lines
    joined by "; "), so that a refusal is one line of standard error."""
    if isinstance(err, ValidationError):
        return _validation_line(err)
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def _limit_hint(args: argparse.Namespace, predictor_name: str, model_tiles: bool) -> str:
    """What raises the pixel limit that applies (``kdeq.images.imageio.pixel_limit``) to a model that solves
    in tiles (``model_tiles``) or not."""
    if (model_tiles and args.tile) or args.max_pixels <= args.max_untiled_pixels:
        return "--max-pixels raises the limit"
    why = f"{predictor_name} does not solve in tiles" if not model_tiles else "--tile 0 solves images whole"
    return f"{why}: --max-untiled-pixels raises the limit"


def _check_headers(task: Task, inputs: list[Path], files: Mapping[str, Path], limit: int, hint: str) -> None:
    """Every input and its file inputs (``batchrun.matched_file``) opened and their headers checked
    (``kdeq.images.imageio.open_image``: format, at most ``limit`` pixels, at least 2×2, one frame; a mask
    of its image's size, either way round) before any is decoded; ``ValueError`` or
    ``ImageRefusedError`` naming the first refused file, with ``hint`` after a refusal for its pixel
    count."""
    masks = {spec.name for spec in task.files if spec.kind == "mask"}
    sizes: dict[Path, tuple[int, int]] = {}
    for source in inputs:
        for name, path in (
            ("image", source),
            *((n, batchrun.matched_file(g, source)) for n, g in files.items()),
        ):
            if path not in sizes:
                try:
                    with open_image(path, str(path), limit) as im:
                        sizes[path] = im.size[::-1]
                except FileNotFoundError:
                    raise ValueError(f"{path}: no such file") from None
                except ImageRefusedError as err:
                    if err.code == "too_many_pixels":
                        raise ValueError(f"{err.detail}; {hint}") from None
                    raise
            if name in masks:
                # the headers' sizes: where EXIF orientation turns one file and not the other, only the
                # decoded sizes tell (batchrun.plan)
                check_mask_size(sizes[path], sizes[source], f"{path} (the mask of {source})", turned=True)


def _check_writable(args: argparse.Namespace, several: bool) -> None:
    """``ValueError`` where an output file's folder does not exist (with several inputs ``-o`` and
    ``--uncertainty`` are folders, made as needed): refused before the solve, not after it."""
    for flag, given in (("-o", args.out), ("--uncertainty", getattr(args, "uncertainty", None))):
        if given is not None and not several and not Path(given).resolve().parent.is_dir():
            raise ValueError(f"{flag} {given}: no folder {Path(given).parent}")


def _warn_noiseless(
    command: str, task: Task, options: BaseModel | Mapping, source: Path, fields: Mapping[str, float | None]
) -> None:
    """One line on standard error where ``task`` removes noise only, its ``σ`` was not given in
    ``options`` but estimated, and the estimate (the result's ``fields``) is under
    ``UNRESOLVED_SIGMA``: there was nothing to remove."""
    given = options.get("sigma") if isinstance(options, Mapping) else getattr(options, "sigma", None)
    found = fields.get("sigma")
    if task.name not in NOISE_ONLY_TASKS or given is not None or found is None or found >= UNRESOLVED_SIGMA:
        return
    print(
        f"kdeq {command}: warning: {source}: noise estimated at σ = {found:.2f}, under the "
        f"{UNRESOLVED_SIGMA:.2f} the estimator resolves on 8-bit pixels: nothing to remove, the output "
        "is the input to within a grey level (--sigma N denoises at level N)",
        file=sys.stderr,
        flush=True,
    )


def _run_model(args: argparse.Namespace) -> int:
    task = chosen_task(TASKS[args.command], args)
    # the flags first: a bad value is refused before a model is loaded or a file read
    given = {n: getattr(args, n) for n in task.options.model_fields if getattr(args, n) is not None}
    options = _validated(task.options, given)
    override = _validated(SolverOverride, {"tol": args.tol, "max_iter": args.max_iter})
    files = {spec.name: Path(getattr(args, spec.name)) for spec in task.files if getattr(args, spec.name)}
    inputs = [Path(p) for p in args.input]
    several = len(inputs) > 1
    _check_writable(args, several)
    root = Path(args.models_dir)
    predictor = load_predictor(find_reference(root, args.model or f"{task.name}-kglm"), args.device)
    if predictor.task != task.name:
        raise ValueError(f"model {predictor.name} is a {predictor.task} model")
    stds = _uncertainty_outputs(args, inputs)
    if stds is not None:
        why = unsupported(predictor)
        if why is not None:
            raise ValueError(f"no --uncertainty: {why}")
    # the service's limits (kdeq.images.imageio.pixel_limit): a model that solves in tiles keeps a tile's
    # memory at any size, the others the image's
    model_tiles = task.tile_halo(predictor) is not None
    if model_tiles and args.tile**2 > args.max_untiled_pixels:
        # a tile is solved whole (as KDEQ_TILE_SIZE must fit KDEQ_MAX_UNTILED_PIXELS)
        raise ValueError(
            f"--tile {args.tile}: a tile of {args.tile}² pixels exceeds --max-untiled-pixels "
            f"{args.max_untiled_pixels}, the most pixels solved whole; give a smaller --tile"
        )
    limit = pixel_limit(model_tiles and bool(args.tile), args.max_pixels, args.max_untiled_pixels)
    hint = _limit_hint(args, predictor.name, model_tiles)
    _check_headers(task, inputs, files, limit, hint)
    start = time.perf_counter()
    with Progress(None, f"reading {len(inputs)} image{'s' if several else ''}"):
        jobs = batchrun.plan(task, inputs, Path(args.out), options, files, override, stds is not None)
    for job in jobs:
        h, w = task.output_size(job.request)
        if h * w > limit:
            raise ValueError(f"{job.source}: the output would be {w}×{h}, more than {limit} pixels; {hint}")
    if several:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    sizes = [batchrun.units(task, predictor, job, args.tile) for job in jobs]
    converged = count = batch_count = 0
    with Progress(sum(sizes), "tiles" if sum(sizes) > len(jobs) else "images") as progress:
        for batch, solved, seconds in batchrun.run(
            task, predictor, jobs, args.batch_size, args.tile, progress.advance
        ):
            batch_count += 1
            progress.clear()
            for job, result in zip(batch, solved, strict=True):
                write_png(job.out, torch.from_numpy(result.output), job.bits)
                if stds is not None:
                    scaledpng.write(stds[job.source], result.uncertainty.std)
                where = f"{seconds / len(batch) * 1e3:.0f} ms"
                print(_solve_line(job.source if several else None, predictor.name, result, where), flush=True)
                _warn_noiseless(args.command, task, job.request.options, job.source, result.fields)
                converged += result.converged
                count += 1
            progress.advance(0)
    if several:
        elapsed = time.perf_counter() - start
        print(
            f"{count} images in {batch_count} batches: {converged}/{count} converged, {elapsed:.2f} s "
            f"({elapsed / count * 1e3:.0f} ms per image, reading and writing included), written to {args.out}"
        )
    return 0 if converged == count else 3


def _uncertainty_outputs(args: argparse.Namespace, inputs: list[Path]) -> dict[Path, Path] | None:
    """Where ``--uncertainty`` writes each input's map (``batchrun.outputs``), ``None`` without it;
    ``ValueError`` where a map would overwrite an output."""
    given = getattr(args, "uncertainty", None)
    if given is None:
        return None
    found = dict(zip(inputs, batchrun.outputs(inputs, Path(given)), strict=True))
    clash = set(map(Path.resolve, found.values())) & set(
        map(Path.resolve, batchrun.outputs(inputs, Path(args.out)))
    )
    if clash:
        raise ValueError(f"--uncertainty would overwrite the output {sorted(clash)[0]}")
    if len(inputs) > 1:
        Path(given).mkdir(parents=True, exist_ok=True)
    return found


def _run_remote(args: argparse.Namespace) -> int:
    """``kdeq remote TASK``: every input and file input read and checked as ``kdeq TASK`` does
    (the options, every header against the most pixels any service admits, then ``batchrun.plan``:
    each image decoded, a mask's size, …) before anything is sent;
    then each input sent to the service in turn, its output written where and as ``kdeq TASK`` writes
    it (``batchrun.outputs``; 8-bit, without alpha: ``_write_local``) and a line of statistics
    printed per image; 3 when a solve did not converge, as locally."""
    task = chosen_task(TASKS[args.task], args)
    inputs = [Path(p) for p in args.input]
    options = {n: getattr(args, n) for n in task.options.model_fields if getattr(args, n) is not None}
    checked = _validated(task.options, options)
    named = {f.name: Path(getattr(args, f.name)) for f in task.files if getattr(args, f.name)}
    several = len(inputs) > 1
    _check_writable(args, several)
    stds = _uncertainty_outputs(args, inputs)
    start, converged = time.perf_counter(), 0
    # the client first, so that a missing httpx2 is reported before every input is read
    with Client(args.url, args.api_key, args.timeout, args.retry_budget) as client:
        # the solver limits are the service's to check (it refuses raising the model's cap, or tol ≥ 1),
        # and so is its pixel limit: here every header is checked against the most any service admits,
        # so that no file is decoded that no service would take
        _check_headers(task, inputs, named, PIXEL_LIMITS[1], "no service admits more")
        jobs = batchrun.plan(task, inputs, Path(args.out), checked, named, None)
        if several:
            Path(args.out).mkdir(parents=True, exist_ok=True)
        with Progress(len(jobs), "images") as progress:
            for job in jobs:
                files = {name: batchrun.matched_file(path, job.source) for name, path in named.items()}
                result = client.run(
                    task.name,
                    job.source,
                    model=args.model,
                    max_iter=args.max_iter,
                    tol=args.tol,
                    uncertainty=stds is not None,
                    **options,
                    **files,
                )
                progress.clear()
                _write_local(job.out, result.image)
                if stds is not None:
                    scaledpng.write(stds[job.source], result.uncertainty.std)
                where = f"{result.timings.get('total', 0.0) * 1e3:.0f} ms on the service"
                print(_solve_line(job.source if several else None, result.model, result, where), flush=True)
                _warn_noiseless(f"remote {args.task}", task, options, job.source, result.fields)
                converged += result.converged
                progress.advance(1)
    if several:
        elapsed = time.perf_counter() - start
        print(
            f"{len(inputs)} images: {converged}/{len(inputs)} converged, {elapsed:.2f} s, "
            f"written to {args.out}"
        )
    return 0 if converged == len(inputs) else 3


def _write_local(path: Path, image: np.ndarray) -> None:
    """Write the service's output ``image`` (``Result.image``) with ``kdeq TASK``'s writer
    (``imageio.write_png``): an 8-bit PNG, grey or RGB, its alpha dropped, 16-bit grey rounded to 8 bits."""
    peak = 65535.0 if image.dtype == np.uint16 else 255.0
    planes = torch.from_numpy(image.astype(np.float32) / np.float32(peak))
    planes = planes[None] if planes.ndim == 2 else planes.permute(2, 0, 1)
    write_png(path, planes[:-1] if planes.shape[0] in (2, 4) else planes)


def _remote(args: argparse.Namespace) -> int:
    """``_run_remote``; on an error its code, detail and request ID on standard error and the exit status
    2 where the arguments, a local file or the request is at fault (a 4xx included), 1 where no answer
    could be had: a 5xx, a timeout, a failed connection, or httpx2 (the ``client`` extra) missing."""
    try:
        return _run_remote(args)
    except KdeqError as err:
        print(f"kdeq remote {args.task}: error: {_one_line(err)}", file=sys.stderr)
        return 2 if err.status is not None and err.status < 500 else 1
    except ImportError as err:
        print(f"kdeq remote {args.task}: error: {_one_line(err)}", file=sys.stderr)
        return 1
    except (ValueError, OSError, ValidationError) as err:
        print(f"kdeq remote {args.task}: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _tile_side(text: str) -> int:
    """``--tile``: 0 or an even side of at least 8 pixels (``kdeq.serving.tiling.spans``)."""
    try:
        side = int(text)
    except ValueError:
        side = -1
    if side < 0 or (side and (side < 8 or side % 2)):
        raise argparse.ArgumentTypeError(f"a tile side is 0 or an even number of pixels ≥ 8, not {text!r}")
    return side


def _pixel_count(text: str) -> int:
    """``--max-pixels`` and ``--max-untiled-pixels``: a count of pixels in ``PIXEL_LIMITS``, the
    service's range for ``KDEQ_MAX_PIXELS`` and ``KDEQ_MAX_UNTILED_PIXELS``."""
    low, high = PIXEL_LIMITS
    try:
        count = int(text)
    except ValueError:
        count = -1
    if not low <= count <= high:
        raise argparse.ArgumentTypeError(f"a pixel count in [{low}, {high}], not {text!r}")
    return count


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose refusals are one line of standard error, exit status 2: the error
    and where the usage is, not the usage itself (a task command's runs to dozens of lines)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(ValueError(message))} (see {self.prog} --help)\n")


def _samples_help() -> str:
    """``kdeq samples --help``'s list of the files it writes, each with what it holds: the list
    ``kdeq.images.samples.write_samples`` writes (``SAMPLE_FILES``)."""
    from kdeq.images.samples import SAMPLE_FILES

    width = max(map(len, SAMPLE_FILES))
    lines = [f"  {name:<{width}}  {meaning}" for name, meaning in SAMPLE_FILES.items()]
    return "\n".join(["Writes into DIRECTORY (made if needed):", *lines])


class Progress:
    """A one-line progress report on standard error: the images or tiles done of ``total`` with a
    bar, the seconds so far and, once some are done, an estimate of the seconds left (without a
    ``total``, the ``unit`` and the seconds so far: ``reading 3 images, 4 s``).

    Drawn on a terminal only: redirected, standard error gets no carriage-return redraws (the line
    per image on standard output says what is done). Drawn from ``DELAY`` seconds after the start,
    so that a quick run shows none, and redrawn every ``EVERY`` seconds by a thread of its own, so
    that a single long solve, which reports nothing until it is done, still shows time passing.
    ``clear`` erases it until the next ``advance``, for lines printed meanwhile; ``close`` for good."""

    WIDTH = 30
    DELAY = 2.0
    EVERY = 1.0

    def __init__(self, total: int | None, unit: str) -> None:
        self.total, self.unit, self.done = total, unit, 0
        self.start = time.monotonic()
        self.shown = sys.stderr.isatty()
        self._lock = threading.Lock()
        self._held = self._drawn = False
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="kdeq-progress", daemon=True)
        if self.shown:
            self._ticker.start()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tick(self) -> None:
        wait = self.DELAY
        while not self._stop.wait(wait):
            with self._lock:
                if not self._held:
                    self._draw()
            wait = self.EVERY

    def _draw(self) -> None:
        """Redraw the line (the caller holds the lock), from ``DELAY`` seconds on."""
        elapsed = time.monotonic() - self.start
        if elapsed < self.DELAY:
            return
        if self.total is None:
            text = f"{self.unit}, {elapsed:.0f} s"
        else:
            filled = self.WIDTH * self.done // max(self.total, 1)
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            text = f"[{bar}] {self.done}/{self.total} {self.unit}, {elapsed:.0f} s"
            if 0 < self.done < self.total:
                text += f", ~{elapsed / self.done * (self.total - self.done):.0f} s left"
        print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)
        self._drawn = True

    def advance(self, done: int) -> None:
        """Count ``done`` more units and redraw."""
        with self._lock:
            self.done += done
            self._held = False
            if self.shown:
                self._draw()

    def clear(self) -> None:
        """Erase the line until the next ``advance``, so that the lines printed meanwhile start on a
        clean line."""
        with self._lock:
            self._held = True
            if self._drawn:
                print("\r\033[K", end="", file=sys.stderr, flush=True)
                self._drawn = False

    def close(self) -> None:
        """Stop redrawing and erase the line: what is done is on standard output."""
        self._stop.set()
        if self._ticker.is_alive():
            self._ticker.join()
        self.clear()


def _models(args: argparse.Namespace) -> int:
    entries = list_models(Path(args.models_dir))
    if not entries:
        print(f"no models in {args.models_dir}")
    for e in entries:
        if e.config is None:
            print(f"{e.name}:{e.version}  ERROR {e.error}")
        else:
            c = e.config
            kind, init = c.architecture.kind, c.provenance.init
            print(f"{e.name}:{e.version}  {c.task:<8} {kind:<7} {init:<6} {c.description}")
    return 0


def _init(args: argparse.Namespace) -> int:
    from kdeq.models.initialize import (
        DEFAULT_SPECS,
        PLUG_AND_PLAY_SPECS,
        RETASKED,
        compose_checkpoint,
        init_checkpoint,
        retask_checkpoint,
    )

    root = Path(args.models_dir)
    if args.defaults:
        specs = list(DEFAULT_SPECS)
    elif args.spec:
        try:
            specs = [ModelSpec.model_validate(json.loads(Path(p).read_text())) for p in args.spec]
        except (ValidationError, json.JSONDecodeError) as err:
            raise ValueError(f"invalid spec: {_one_line(err)}") from None
    else:
        specs = list(PLUG_AND_PLAY_SPECS)
    prior = None if args.prior is None else load_checkpoint(args.prior)
    builds = [
        functools.partial(init_checkpoint, spec, root)
        if prior is None
        else functools.partial(compose_checkpoint, spec, prior, root)
        for spec in specs
    ]
    if prior is not None and not args.spec:
        builds += [functools.partial(retask_checkpoint, *model, prior, root) for model in RETASKED]
    for build in builds:
        start = time.perf_counter()
        directory, config = build()
        elapsed = time.perf_counter() - start
        print(f"wrote {directory} (sha256 {config.weights_sha256[:12]}…) in {elapsed * 1e3:.1f} ms")
    return 0


#: commands whose modules (the trainer's, the experiments') load only when the command runs or its
#: help is asked for, so that ``kdeq denoise`` imports none of them: the command's words, then its
#: module, the module's handler and the command's summary; every module has ``add_arguments(parser)``
LOADED_WHEN_RUN = {
    ("train",): ("kdeq.train.cli", "run", "fine-tune a checkpoint from the kGLM start on images"),
    ("prune",): (
        "kdeq.train.prune",
        "run",
        "cut a denoiser's guide networks to fewer features (growing a colour network), the start of a "
        "leaner model",
    ),
    ("calibrate",): (
        "kdeq.train.calibrate",
        "run",
        "choose a trained guided denoiser's bandwidth on validation",
    ),
    ("experiment", "init-compare"): (
        "kdeq.research.init_compare",
        "main",
        "kGLM vs random initialisation (paper §4, Table 1)",
    ),
    ("experiment", "kerdeq"): (
        "kdeq.research.exp_kerdeq",
        "main",
        "KerDEQ against OptEq on scikit-learn's digits (the seeds' claims)",
    ),
    ("experiment", "mondeq"): (
        "kdeq.research.exp_mondeq",
        "main",
        "the monotone DEQ on scikit-learn's digits: NTK loss decay and stability",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="kdeq", description="kernel-GLM deep equilibrium models")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="denoise a generated image with the closed-form kGLM-DEQ")
    p_demo.add_argument("--size", type=int, default=256)
    p_demo.add_argument("--sigma", type=float, default=25.0, help="noise level on the 0–255 scale")
    p_demo.add_argument("--seed", type=int, default=0)

    models_dir = str(default_models_dir())
    for task in TASKS.values():
        p = sub.add_parser(
            task.name, help=f"{task.summary[0].lower()}{task.summary[1:]}: an image file, a repository model"
        )
        add_task_command_arguments(
            p,
            task,
            "PNG, JPEG, WebP or TIFF files, solved in one process",
            f"NAME or NAME:VERSION (default {task.name}-kglm, latest version)",
        )
        p.add_argument(
            "--batch-size",
            type=int,
            help="images of one size solved together (default: batched where a measured batch is faster)",
        )
        p.add_argument(
            "--tile",
            type=_tile_side,
            default=TILE_SIZE,
            help=f"solve images of more than N×N pixels in tiles of about N×N, where the task can "
            f"(default {TILE_SIZE}; 0: never)",
        )
        p.add_argument(
            "--max-pixels",
            type=_pixel_count,
            default=MAX_PIXELS,
            metavar="N",
            help="the most pixels an input, file input or output may have, checked from each file's header "
            "before any is decoded (default %(default)s, the service's KDEQ_MAX_PIXELS)",
        )
        p.add_argument(
            "--max-untiled-pixels",
            type=_pixel_count,
            default=MAX_UNTILED_PIXELS,
            metavar="N",
            help="the same for a model that does not solve in tiles (deblur's), or with --tile 0: its "
            "solve's memory grows with the image (default %(default)s, the service's "
            "KDEQ_MAX_UNTILED_PIXELS)",
        )
        p.add_argument("--models-dir", default=models_dir)
        p.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    p_remote = sub.add_parser("remote", help="run a task on a kdeq service over HTTP (kdeq.client)")
    p_remote.add_argument("--url", required=True, help="the service's base URL, e.g. http://127.0.0.1:8000")
    p_remote.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("KDEQ_API_KEY"),
        help="the service's API key (default: $KDEQ_API_KEY, which keeps it off the process list)",
    )
    p_remote.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds to wait for each answer (default %(default)s)",
    )
    p_remote.add_argument(
        "--retry-budget",
        type=float,
        default=DEFAULT_RETRY_BUDGET,
        help="seconds a request may wait in all to be sent again after a 503's Retry-After "
        "(default %(default)s)",
    )
    p_remote.set_defaults(handler=_remote)
    remote_sub = p_remote.add_subparsers(dest="task", required=True)
    for task in TASKS.values():
        add_task_command_arguments(
            remote_sub.add_parser(
                task.name, help=f"{task.summary[0].lower()}{task.summary[1:]}: image files, a service's model"
            ),
            task,
            "PNG, JPEG, WebP or TIFF files, sent to the service one after another",
            f"NAME or NAME:VERSION of a model the service has loaded (default: its {task.name} default)",
        )
    p_models = sub.add_parser("models", help="list the model repository")
    p_models.add_argument("--models-dir", default=models_dir)
    argv = sys.argv[1:] if argv is None else argv
    p_samples = sub.add_parser(
        "samples",
        help="write generated sample images to try the models on (kdeq samples --help lists them)",
        # read for `kdeq samples` alone, so that the other commands do not import kdeq.images.samples
        epilog=_samples_help() if argv[:1] == ["samples"] else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_samples.add_argument("directory", nargs="?", default=".", metavar="DIRECTORY", help="default: here")
    p_samples.add_argument("--seed", type=int, default=0)
    p_init = sub.add_parser("init", help="write kGLM-initialised checkpoints")
    p_init.add_argument("spec", nargs="*", help="ModelSpec JSON files")
    p_init.add_argument("--defaults", action="store_true", help="rebuild the shipped default models")
    p_init.add_argument(
        "--prior",
        metavar="DIR",
        help="compose plug-and-play specs (without SPEC files: the shipped ones, and the models of "
        "other tasks that use its kernel and network as they are) around this denoiser checkpoint",
    )
    p_init.add_argument("--models-dir", default=models_dir)
    parents = {(): sub}
    for path, (module, handler, summary) in LOADED_WHEN_RUN.items():
        if path[:-1] not in parents:  # the experiments' group
            group = sub.add_parser(path[0], help="reproduce the paper's experiments")
            parents[path[:-1]] = group.add_subparsers(dest=path[0], required=True)
        p = parents[path[:-1]].add_parser(path[-1], help=summary)
        if tuple(argv[: len(path)]) == path:
            found = importlib.import_module(module)
            found.add_arguments(p)
            p.set_defaults(handler=getattr(found, handler))

    for plugin in entry_points(group="kdeq.commands"):
        try:
            plugin.load()(sub)
        except Exception as err:  # a broken plugin must not take the library's own commands down
            print(f"kdeq: command {plugin.name!r} unavailable: {err}", file=sys.stderr)

    args = parser.parse_args(argv)
    try:
        heap.configure()
    except ValueError as err:
        parser.error(str(err))
    if hasattr(args, "handler"):
        return args.handler(args)
    if args.command == "demo":
        if args.size < 16 or args.sigma <= 0:
            parser.error("--size must be at least 16 and --sigma positive")
        demo(args.size, args.sigma, args.seed)
        return 0
    if args.command == "samples":
        from kdeq.images.samples import write_samples

        for path in write_samples(args.directory, args.seed):
            print(f"wrote {path}")
        return 0
    if args.command == "init" and (
        (args.defaults and (args.spec or args.prior)) or not (args.spec or args.defaults or args.prior)
    ):
        parser.error("give SPEC files, --defaults or --prior DIR [SPEC files]")
    try:
        if args.command == "models":
            return _models(args)
        if args.command == "init":
            return _init(args)
        return _run_model(args)
    except (CheckpointError, LookupError, ValueError, OSError, ValidationError) as err:
        print(f"kdeq {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
