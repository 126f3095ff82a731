"""The ``kdeq`` command line.

- ``kdeq TASK IN [IN …] -o OUT`` for every registered task (``kdeq.tasks.TASKS``: denoise,
  inpaint, …), with the task's options and file inputs as flags: run a repository model on image
  files in one process, batched by size (``kdeq.batchrun``), and print the solver statistics of each
  and, for several, a summary; the exit status is 3 when a solve did not converge; a task's variants
  (``kdeq.tasks.choice_of``) are asked for on its host's command too (``kdeq denoise --noise poisson``);
- ``kdeq remote --url URL TASK IN [IN …] -o OUT``: the same, with the same task arguments, solved by a
  kdeq service over HTTP (``kdeq.client``; the API key from ``--api-key`` or ``KDEQ_API_KEY``);
- ``kdeq models``: list the repository;
- ``kdeq samples DIR``: write generated sample images to try the models on;
- ``kdeq init SPEC.json`` / ``kdeq init --defaults``: write kGLM-initialised checkpoints;
  ``kdeq init --prior DIR [SPEC.json]``: compose plug-and-play models (``kdeq.pnp``) around the
  denoiser checkpoint ``DIR`` (without SPEC files, the shipped ones);
- ``kdeq train …``: fine-tune a checkpoint on images (``kdeq.train``); ``kdeq prune SRC --channels N``:
  cut a denoiser's guide network to its ``N`` most salient features, the start of a leaner model, and
  ``--colour-channels N`` its colour network, grown from the grey one where it has none
  (``kdeq.train.prune``);
- ``kdeq experiment init-compare …``: the paper's kGLM-vs-random initialisation experiment;
  ``kdeq experiment kerdeq …`` and ``kdeq experiment mondeq …``: the seeds' KerDEQ and monotone-DEQ
  claims on scikit-learn's digits (``kdeq.train.exp_kerdeq``, ``kdeq.train.exp_mondeq``);
- ``kdeq demo``: see below;
- commands of other installed packages, registered under the ``kdeq.commands`` entry-point
  group (``kdeq serve`` comes from the ``service`` package, which ``kdeq`` never imports).

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
import time
from collections.abc import Collection
from importlib.metadata import entry_points
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin

import numpy as np
import torch
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from kdeq import batchrun, heap, scaledpng
from kdeq.checkpoint import CheckpointError, ModelSpec, load_checkpoint
from kdeq.client import DEFAULT_RETRY_BUDGET, DEFAULT_TIMEOUT, Client, KdeqError, Result
from kdeq.families import Gaussian
from kdeq.imageio import write_png
from kdeq.kernels import Kernel
from kdeq.kglm import conv_deq
from kdeq.predictor import SolverOverride
from kdeq.priors import GaussianPrior
from kdeq.repository import default_models_dir, find_reference, list_models, load_predictor
from kdeq.solvers import SolverConfig
from kdeq.tasks import TASKS, Solved, Task, choice_of
from kdeq.tiling import TILE_SIZE
from kdeq.uncertainty import POSTERIORS, unsupported


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
    if task.name in POSTERIORS:
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
        f"residual {result.residual:.2e}, converged {result.converged}, lambda {result.lam:.4g}"
        f"{extra}, {timing}"
    )


def _run_model(args: argparse.Namespace) -> int:
    task = chosen_task(TASKS[args.command], args)
    root = Path(args.models_dir)
    predictor = load_predictor(find_reference(root, args.model or f"{task.name}-kglm"), args.device)
    if predictor.task != task.name:
        raise ValueError(f"model {predictor.name} is a {predictor.task} model")
    given = {n: getattr(args, n) for n in task.options.model_fields if getattr(args, n) is not None}
    options = task.options(**given)
    files = {spec.name: Path(getattr(args, spec.name)) for spec in task.files if getattr(args, spec.name)}
    override = SolverOverride(tol=args.tol, max_iter=args.max_iter)
    inputs = [Path(p) for p in args.input]
    stds = _uncertainty_outputs(args, inputs)
    if stds is not None:
        why = unsupported(predictor)
        if why is not None:
            raise ValueError(f"no --uncertainty: {why}")
    start = time.perf_counter()
    jobs = batchrun.plan(task, inputs, Path(args.out), options, files, override, stds is not None)
    several = len(jobs) > 1
    if several:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    sizes = [batchrun.units(task, predictor, job, args.tile) for job in jobs]
    tiled = sum(sizes) > len(jobs)
    progress = Progress(sum(sizes), "tiles" if tiled else "images") if (several or tiled) else None
    converged = count = batch_count = 0
    update = None if progress is None else progress.advance
    for batch, solved, seconds in batchrun.run(task, predictor, jobs, args.batch_size, args.tile, update):
        batch_count += 1
        if progress is not None:
            progress.clear()
        for job, result in zip(batch, solved, strict=True):
            write_png(job.out, torch.from_numpy(result.output), job.bits)
            if stds is not None:
                scaledpng.write(stds[job.source], result.uncertainty.std)
            where = f"{seconds / len(batch) * 1e3:.0f} ms"
            print(_solve_line(job.source if several else None, predictor.name, result, where), flush=True)
            converged += result.converged
            count += 1
        if progress is not None:
            progress.advance(0)
    if progress is not None:
        progress.close()
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
    (``batchrun.plan``: the options, each image decoded, a mask's size, …) before anything is sent;
    then each input sent to the service in turn, its output written where and as ``kdeq TASK`` writes
    it (``batchrun.outputs``; 8-bit, without alpha: ``_write_local``) and a line of statistics
    printed per image; 3 when a solve did not converge, as locally."""
    task = chosen_task(TASKS[args.task], args)
    inputs = [Path(p) for p in args.input]
    options = {n: getattr(args, n) for n in task.options.model_fields if getattr(args, n) is not None}
    named = {f.name: Path(getattr(args, f.name)) for f in task.files if getattr(args, f.name)}
    several = len(inputs) > 1
    stds = _uncertainty_outputs(args, inputs)
    start, converged = time.perf_counter(), 0
    # the client first, so that a missing httpx2 is reported before every input is read
    with Client(args.url, args.api_key, args.timeout, args.retry_budget) as client:
        # the solver limits are the service's to check (it refuses raising the model's cap, or tol ≥ 1)
        jobs = batchrun.plan(task, inputs, Path(args.out), task.options(**options), named, None)
        if several:
            Path(args.out).mkdir(parents=True, exist_ok=True)
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
            _write_local(job.out, result.image)
            if stds is not None:
                scaledpng.write(stds[job.source], result.uncertainty.std)
            where = f"{result.timings.get('total', 0.0) * 1e3:.0f} ms on the service"
            print(_solve_line(job.source if several else None, result.model, result, where), flush=True)
            converged += result.converged
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
        print(f"kdeq remote {args.task}: error: {err}", file=sys.stderr)
        return 2 if err.status is not None and err.status < 500 else 1
    except ImportError as err:
        print(f"kdeq remote {args.task}: error: {err}", file=sys.stderr)
        return 1
    except (ValueError, OSError, ValidationError) as err:
        print(f"kdeq remote {args.task}: error: {err}", file=sys.stderr)
        return 2


def _tile_side(text: str) -> int:
    """``--tile``: 0 or an even side of at least 8 pixels (``kdeq.tiling.spans``)."""
    try:
        side = int(text)
    except ValueError:
        side = -1
    if side < 0 or (side and (side < 8 or side % 2)):
        raise argparse.ArgumentTypeError(f"a tile side is 0 or an even number of pixels ≥ 8, not {text!r}")
    return side


class Progress:
    """A one-line progress bar of images or tiles on standard error, drawn on a terminal only
    (``kdeq TASK`` with several inputs or a tiled one)."""

    WIDTH = 30

    def __init__(self, total: int, unit: str) -> None:
        self.total, self.unit, self.done = total, unit, 0
        self.shown = sys.stderr.isatty()
        self.advance(0)

    def advance(self, done: int) -> None:
        """Count ``done`` more units and redraw."""
        self.done += done
        if not self.shown:
            return
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        print(f"\r[{bar}] {self.done}/{self.total} {self.unit}", end="", file=sys.stderr, flush=True)

    def clear(self) -> None:
        """Erase the bar, so that the lines printed next start on a clean line."""
        if self.shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.shown:
            print(file=sys.stderr, flush=True)


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
    from kdeq.initialize import (
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
            raise ValueError(f"invalid spec: {err}") from None
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
        "kdeq.train.init_compare",
        "main",
        "kGLM vs random initialisation (paper §4, Table 1)",
    ),
    ("experiment", "kerdeq"): (
        "kdeq.train.exp_kerdeq",
        "main",
        "KerDEQ against OptEq on scikit-learn's digits (the seeds' claims)",
    ),
    ("experiment", "mondeq"): (
        "kdeq.train.exp_mondeq",
        "main",
        "the monotone DEQ on scikit-learn's digits: NTK loss decay and stability",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kdeq", description="kernel-GLM deep equilibrium models")
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
    p_samples = sub.add_parser("samples", help="write sample images (photo, noisy, holes, scan) to try")
    p_samples.add_argument("directory", nargs="?", default=".")
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
    argv = sys.argv[1:] if argv is None else argv
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
        from kdeq.samples import write_samples

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
        print(f"kdeq {args.command}: error: {err}", file=sys.stderr)
        return 2
