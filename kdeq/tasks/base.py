"""What a task is: a kind of request, from its options to its outputs, independent of HTTP.

A ``Task`` owns everything that differs between the kinds of request a model answers (denoise,
inpaint, …): its name, its predictor, its strict options model and extra image inputs, how a batch
of its requests is solved in one ``predict`` call, the fields its results carry, how its images are
cut into tiles, the warm-up request that exercises it, and its posterior map's refusals. The rules
its checkpoints obey are its predictor's (``Predictor.check_spec``: family, architectures, network),
and how its models train is the trainer's (``kdeq.train.tasks``). The service's routes, the command
line, the trainer and the generated docs are built from these declarations
(``kdeq.registry.TASKS``); nothing else branches on a task's name.

A ``Request`` holds ``(c, H, W)`` float32 numpy images in [0, 1], so that a
caller that is not torch-aware (the service's decoder threads) can build it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from kdeq.predictors.base import Prediction, Predictor, SolverOverride, pad_images
from kdeq.predictors.spec import ModelSpecBase
from kdeq.predictors.uncertainty import posterior
from kdeq.runtime import threads


class InputError(ValueError):
    """A request its task refuses: ``code`` names the error for a client, ``absent`` says that a
    required input is missing altogether (rather than present and invalid)."""

    def __init__(self, code: str, detail: str, absent: bool = False) -> None:
        super().__init__(detail)
        self.code, self.detail, self.absent = code, detail, absent


class Options(BaseModel):
    """Base of the tasks' option models: scalar request options, frozen, unknown keys refused.
    Each field's ``description`` is its help in the API, the command line and the docs."""

    model_config = ConfigDict(frozen=True, extra="forbid")


#: the option ``sigma`` of the tasks whose noise level is given or estimated
NoiseLevel = Annotated[
    float | None,
    Field(
        ge=0, le=255, allow_inf_nan=False, description="noise level on the 0–255 scale (default: estimated)"
    ),
]


@dataclass(frozen=True)
class FileInput:
    """An image input besides the main ``image``.

    Attributes:
        name: the form field (HTTP) and ``--name`` option (command line), ``_`` written ``-`` there.
        description: its help.
        kind: ``mask``: the image's size, read as True where any channel is non-zero;
            ``image``: any image within the pixel limit, read as ``(c, h, w)`` float32 in [0, 1]
            (its task's ``prepare`` checks the rest).
    """

    name: str
    description: str
    kind: Literal["mask", "image"]


@dataclass(frozen=True)
class ResultField:
    """A per-request value a task reports: JSON field ``name``, header ``X-KDEQ-<Name>``."""

    name: str
    description: str
    format: str = ".4g"

    @property
    def header(self) -> str:
        return "X-KDEQ-" + "-".join(part.capitalize() for part in self.name.split("_"))


@dataclass(frozen=True)
class Variant:
    """How a task is also asked for on another task's route and command: ``POST /<host>`` and
    ``kdeq <host>`` with ``<field>=<value>`` run it, and ``<field>=<default>`` (the field's default)
    runs the host itself (``/denoise`` with ``noise=poisson``; ``kdeq.registry.Choice``).

    Attributes:
        host: the task whose route and command take the field.
        field: the form field and ``--field`` option.
        value: the field's value that picks this task.
        default: the field's value that picks the host (the same for every variant of a host).
        description: what ``value`` means, for the field's help.
    """

    host: str
    field: str
    value: str
    default: str
    description: str


@dataclass(frozen=True)
class Request:
    """One request to a task.

    Attributes:
        image: ``(c, H, W)`` float32 in [0, 1].
        options: the task's ``Options``.
        inputs: the task's other inputs, as its ``prepare`` made them (e.g. the inpainter's
            ``missing`` ``(1, H, W)`` bool, the deblurrer's PSF ``(k, k)``).
        solver: per-request solver limits.
        uncertainty: whether to return the posterior standard deviation beside the image
            (``Solved.uncertainty``; the tasks with a posterior, ``kdeq.predictors.uncertainty``).
    """

    image: np.ndarray
    options: Options
    inputs: Mapping[str, Any] = field(default_factory=dict)
    solver: SolverOverride | None = None
    uncertainty: bool = False


@dataclass(frozen=True)
class UncertaintyMap:
    """A request's posterior standard deviation (``kdeq.predictors.uncertainty``).

    Attributes:
        std: ``sqrt(diag Σ)`` ``(H', W')`` float32 on the output's [0, 1] scale (the same for every
            channel: one kernel and one operator act on each alike).
        exact: whether a transform gave it exactly (else the coloured-probe estimate).
        probes: the probes solved (0 when exact).
        error: the estimate's own estimate of its mean relative error, or ``None`` when exact.
    """

    std: np.ndarray
    exact: bool
    probes: int
    error: float | None = None


@dataclass(frozen=True)
class Solved:
    """One request's result.

    Attributes:
        output: ``(c, H', W')`` float32 array: the restored image (``H' × W'`` the task's output size),
            or a segmenter's mask / probability ``(1, H, W)``.
        iterations, residual, converged: the solver's statistics for this image.
        lam: ``λ`` used.
        fields: the task's ``ResultField`` values (``None`` where not applicable).
        finite: whether the model's continuous output (``Prediction.output``) is finite everywhere.
        history: the relative residual at each step, when the request asked for it and its solver
            records one (``SolverStats.history``); else ``None``.
        uncertainty: the posterior standard deviation, when the request asked for it; else ``None``.
    """

    output: np.ndarray
    iterations: int
    residual: float
    converged: bool
    lam: float
    fields: Mapping[str, float | None]
    finite: bool
    history: list[float] | None = None
    uncertainty: UncertaintyMap | None = None


class Task:
    """A kind of request; subclasses declare the class attributes and override the hooks.

    Attributes:
        name: the task's name (a checkpoint's ``task``, the route ``/name``, the subcommand).
        summary: one line saying what it does.
        sample: the name of the generated image (``kdeq.images.samples.sample_images``) to try it on.
        predictor: the ``Predictor`` subclass its checkpoints load as, which declares the rules they
            obey (``Predictor.check_spec``: family, architectures, network).
        options: its ``Options`` model.
        files: its other image inputs.
        fields: the values its results report besides the solver's statistics and ``λ``.
        grey_output: whether the output is one grey channel whatever the input.
        counts: whether its images are photon counts: a ``Request``'s image then holds the integer
            pixel values as stored (0–255 in an 8-bit file, 0–65535 in a 16-bit one), not [0, 1]
            (``counts_of``).
        variant: how it is also asked for on another task's route and command, ``None`` when only on
            its own.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    sample: ClassVar[str] = "photo"
    predictor: ClassVar[type[Predictor]]
    options: ClassVar[type[Options]] = Options
    files: ClassVar[tuple[FileInput, ...]] = ()
    fields: ClassVar[tuple[ResultField, ...]] = ()
    grey_output: ClassVar[bool] = False
    counts: ClassVar[bool] = False
    variant: ClassVar[Variant | None] = None

    @property
    def route(self) -> str:
        return "/" + self.name

    @property
    def family(self) -> str:
        """The exponential family of its models (``Predictor.family``)."""
        return self.predictor.family

    def check_spec(self, spec: ModelSpecBase) -> None:
        """Raise ``ValueError`` where ``spec`` is not a model this task can run (its family is checked
        by ``kdeq.models.checkpoint``): its predictor's rules (``Predictor.check_spec``), and the noise
        ``λ`` rule only where requests carry a noise level (the option ``sigma``, given or
        estimated)."""
        self.predictor.check_spec(spec)
        if spec.lam.rule == "noise" and "sigma" not in self.options.model_fields:
            raise ValueError(f"the noise λ rule needs a noise level, which {self.name} requests do not carry")

    def prepare(
        self,
        image: np.ndarray,
        alpha: np.ndarray | None,
        options: Options,
        files: Mapping[str, np.ndarray],
        solver: SolverOverride | None = None,
    ) -> Request:
        """The request for ``image`` ``(c, H, W)`` with its alpha ``(H, W)`` or ``None``, ``options``
        and the decoded ``files`` that were given; ``InputError`` for one this task refuses."""
        return Request(image, options, {}, solver)

    def check_uncertainty(self, request: Request) -> None:
        """``InputError`` where ``request``'s posterior map cannot be given though its model has one
        (this default: never)."""

    def output_size(self, request: Request) -> tuple[int, int]:
        """``(H', W')`` of ``request``'s output (the pixel limit applies to it)."""
        return tuple(request.image.shape[-2:])

    def output_alpha(
        self, request: Request, alpha: np.ndarray | None, files: Sequence[str]
    ) -> np.ndarray | None:
        """The alpha ``(H', W')`` the output keeps, from the input's; ``files`` the file inputs given."""
        return alpha

    def output_mode(self, mode: str) -> str:
        """The PNG mode (``L``, ``I;16``, ``RGB``, ``LA``, ``RGBA``) of the output of an input decoded
        in ``mode``: this default keeps it, or gives ``L`` where the output is ``grey_output``."""
        return "L" if self.grey_output else mode

    def batch_key(self, request: Request) -> Hashable:
        """Requests whose keys are equal (with equal models and sizes) are solved together."""
        return (request.options, request.solver)

    def arguments(
        self, images: torch.Tensor, requests: Sequence[Request], sizes: list[tuple[int, int]] | None
    ) -> tuple[tuple, dict[str, Any]]:
        """The positional and keyword arguments of ``predictor.forward`` for the batch ``images``
        ``(B, c, H, W)`` of ``requests`` (padded to a common size when ``sizes`` is given,
        ``kdeq.predictors.base``); the same arguments build its Gaussian posterior
        (``Predictor.gaussian_posterior``, ``kdeq.predictors.uncertainty``)."""
        raise NotImplementedError

    def run(
        self,
        predictor: Predictor,
        images: torch.Tensor,
        requests: Sequence[Request],
        sizes: list[tuple[int, int]] | None,
    ) -> Prediction:
        """``predictor``'s prediction for the batch ``images`` ``(B, c, H, W)`` of ``requests``: its
        ``predict`` on ``arguments``."""
        args, kwargs = self.arguments(images, requests, sizes)
        return predictor.predict(*args, **kwargs)

    def result(self, prediction: Prediction, index: int, request: Request) -> tuple[torch.Tensor, dict]:
        """Sample ``index``'s output ``(c, H', W')`` and ``fields`` values from the batch's
        ``prediction``."""
        return prediction.output[index], {}

    # --- tiles (kdeq.serving.tiling) -----------------------------------------------------------------------

    def tile_halo(self, predictor: Predictor) -> int | None:
        """The halo, in pixels, that a tile of this task's images needs around its core for
        ``predictor``'s solve to pose the core's equations as the whole image does; ``None`` (this
        default) where its requests are solved whole only."""
        return None

    def whole_image(self, predictor: Predictor, request: Request) -> Request:
        """``request`` with what ``predictor`` computes from the whole image, and a tile alone would
        compute differently, fixed in its options or inputs for the tiles cut from it (this default:
        nothing)."""
        return request

    def whole_result(self, request: Request, solved: Solved) -> Solved:
        """The result of ``request`` from its tiles' results put together (``solved``), where the task
        computes something from the whole image's output (this default: ``solved`` as it is)."""
        return solved

    def cut(self, request: Request, rows: slice, cols: slice) -> Request:
        """The tile ``rows × cols`` of ``request``: its image and every per-pixel input ``(·, H, W)``
        cut to it, the other inputs shared."""
        size = request.image.shape[-2:]
        inputs = {
            k: v[..., rows, cols] if isinstance(v, np.ndarray) and v.shape[-2:] == size else v
            for k, v in request.inputs.items()
        }
        image = np.ascontiguousarray(request.image[:, rows, cols])
        return replace(request, image=image, inputs=inputs)

    def warmup(self, size: int) -> Request:
        """A generated ``size``×``size`` request that exercises the whole solve."""
        rng = np.random.default_rng(0)
        return Request(rng.random((1, size, size), dtype=np.float32), self.options())


def counts_of(pixels: np.ndarray, full_scale: int | None) -> np.ndarray:
    """The photon counts ``round(pixels · full_scale)`` ``(c, H, W)`` float32 of an image decoded to
    [0, 1] from integers whose largest value is ``full_scale`` (255 or 65535);
    ``InputError`` for pixels that were not integers (``full_scale`` ``None``: a float image)."""
    if full_scale is None:
        raise InputError("not_counts", "photon counts are integer pixels: send an 8- or 16-bit image")
    return np.rint(pixels * np.float32(full_scale)).astype(np.float32)


def tile_level(requests: Sequence[Request]) -> dict[str, torch.Tensor]:
    """``{"level": (B, c)}``: the channel means ``Task.whole_image`` fixed in tiles of one image
    (``kdeq.serving.tiling``, never batched with other images), as the predictor's ``level``; ``{}`` for
    whole images."""
    if "level" not in requests[0].inputs:
        return {}
    return {"level": torch.from_numpy(np.stack([r.inputs["level"] for r in requests]))}


def noise_levels(requests: Sequence[Request]) -> list[float] | None:
    """The batch's given noise levels (the option ``sigma``, 0–255), or ``None`` where they are to be
    estimated; a batch agrees on which (its tasks' ``batch_key``)."""
    if requests[0].options.sigma is None:
        return None
    return [r.options.sigma for r in requests]


def uncertainty_map(task: Task, predictor: Predictor, request: Request) -> UncertaintyMap:
    """``request``'s posterior standard deviation (``kdeq.predictors.uncertainty.posterior`` on its own
    image, at its default probe count, from a generator seeded 0, so that a request's map is
    reproducible); ``ValueError`` for a model without a posterior map."""
    args, kwargs = task.arguments(torch.from_numpy(request.image)[None], [request], None)
    found = posterior(predictor, *args, generator=torch.Generator().manual_seed(0), **kwargs)
    h, w = task.output_size(request)
    error = None if found.error is None else float(found.error[0])
    return UncertaintyMap(found.std[0, 0, :h, :w].cpu().numpy(), found.exact, found.probes, error)


def solve_batch(task: Task, predictor: Predictor, requests: Sequence[Request]) -> list[Solved]:
    """Solve compatible ``requests`` (equal ``batch_key``) in one ``predict`` call; images of different
    sizes are padded to a common one (``kdeq.predictors.base.pad_images``) and each output cropped back.
    Each request that asks for it gets its ``uncertainty_map``, computed on its own image (the
    posterior is not batched across sizes; its probes are one batch of solves already). Torch's
    threads are sized to the free cores first (``kdeq.runtime.threads.adapt``)."""
    threads.adapt()
    uniform = len({r.image.shape for r in requests}) == 1
    images, sizes = pad_images([torch.from_numpy(r.image) for r in requests])
    prediction = task.run(predictor, images, requests, None if uniform else sizes)
    stats = prediction.stats
    iterations, residual, converged = (
        stats.iterations.tolist(),
        stats.residual.tolist(),
        stats.converged.tolist(),
    )
    lam = prediction.lam.reshape(-1).expand(len(requests)).tolist()
    history = None
    if stats.history is not None:  # each sample's steps, those after it stopped (NaN) left out
        history = [[v for v in row if not math.isnan(v)] for row in stats.history.tolist()]
    solved = []
    for b, request in enumerate(requests):
        out, values = task.result(prediction, b, request)
        h, w = task.output_size(request)
        out = out[:, :h, :w].float().cpu().numpy()
        finite = bool(torch.isfinite(prediction.output[b, :, :h, :w]).all())
        solved.append(
            Solved(
                out,
                int(iterations[b]),
                float(residual[b]),
                bool(converged[b]),
                lam[b],
                {f.name: values.get(f.name) for f in task.fields},
                finite,
                None if history is None else history[b],
                uncertainty_map(task, predictor, request) if request.uncertainty else None,
            )
        )
    return solved
