"""The HTTP routes: one inference route per registered task (``POST /<task>``, generated from
``kdeq.registry.TASKS``) and operations (``/tasks``, ``/models``, ``/models/{name}`` with its ``load``,
``unload`` and ``ready``, ``/healthz``, ``/readyz``, ``/metrics``).

An inference request (``infer``) is decoded (``service.decode``) and made into the task's
``Request`` (``Task.prepare``) on the codec pool, queued and solved
(``service.engine`` → ``kdeq.tasks.base.solve_batch``) and encoded (``service.encode``)
on the codec pool again: worker threads, at most ``app.state.codec``'s tokens of
them at once (``service.app``), never the event loop's.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import inspect
import io
import math
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Literal, TypeVar, get_args, get_origin

import numpy as np
from anyio import to_thread
from fastapi import APIRouter, Depends, File, Form, Request, Security, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import APIKeyHeader, HTTPBearer
from PIL import Image
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic import Field as PydanticField
from pydantic.fields import FieldInfo

from kdeq.images import scaledpng
from kdeq.images.imageio import pixel_limit, to_bytes
from kdeq.images.samples import sample_images
from kdeq.predictors.base import SolverOverride
from kdeq.registry import TASKS, Choice, choice_of
from kdeq.tasks.base import FileInput, InputError, Options, ResultField, Solved, Task, counts_of
from kdeq.tasks.base import Request as TaskRequest
from service.decode import DecodedImage, decode_image, decode_mask
from service.encode import PNG, encode_png, wants_json
from service.engine import Job
from service.errors import ERROR_RESPONSES, ApiError, ErrorBody, describe_errors
from service.registry import ModelSlot
from service.state import Service
from service.tracing import record_phases

router = APIRouter()

# declared for the OpenAPI document; the ApiKey middleware enforces the key before a body is read
AUTH = [Security(HTTPBearer(auto_error=False)), Security(APIKeyHeader(name="X-API-Key", auto_error=False))]


#: what the solver's statistics mean, in the headers, the JSON body and the metrics alike
#: (docs/api.md, "Solver statistics")
ITERATIONS_MEANING = (
    "solver steps after the solve's start; 0 when the start (a learned pilot, or the exact answer "
    "of a solve by one transform) already met the tolerance; summed over the solves a task chains, "
    "the slowest tile's for an image solved in tiles"
)
RESIDUAL_MEANING = (
    "relative residual ‖f(z)−z‖/‖f(z)‖ of the returned iterate (the worst of chained solves and of tiles)"
)
CONVERGED_MEANING = (
    "whether every solve behind the image met its tolerance (else the best iterate is returned)"
)


class SolverInfo(BaseModel):
    iterations: int = PydanticField(description=ITERATIONS_MEANING)
    residual: float | None = PydanticField(description=RESIDUAL_MEANING + "; null if it is not finite")
    converged: bool = PydanticField(description=CONVERGED_MEANING)
    history: list[float | None] | None = PydanticField(
        None,
        description="with `history=true`: the relative residual at each step (null where it was not finite)",
    )


class UncertaintyInfo(BaseModel):
    """The posterior standard deviation of the output (``uncertainty=true``; ``kdeq.predictors.uncertainty``)."""  # noqa: E501

    png: str = PydanticField(
        description="a 16-bit grey PNG in base64: pixel value × `scale` is the standard deviation on "
        "the output's [0, 1] scale"
    )
    scale: float
    exact: bool = PydanticField(description="computed exactly by a transform (else estimated by probes)")
    probes: int = PydanticField(description="random probes solved (0 when exact)")
    error: float | None = PydanticField(
        description="the estimate's own estimate of its mean relative error (null when exact)"
    )


class Timings(BaseModel):
    decode_seconds: float
    queue_seconds: float
    inference_seconds: float
    encode_seconds: float
    total_seconds: float


class Result(BaseModel):
    """The JSON body of an inference response (``Accept: application/json``); each task adds its
    ``ResultField`` values (``Task.fields``) as fields of its own subclass."""

    model: str
    image: str
    media_type: str = PNG
    width: int
    height: int
    mode: str
    solver: SolverInfo
    lam: float
    batch_size: int
    timings: Timings
    uncertainty: UncertaintyInfo | None = PydanticField(
        None, description="with `uncertainty=true`: the output's posterior standard deviation"
    )


def _service(request: Request) -> Service:
    return request.app.state.service


T = TypeVar("T")


async def _on_codec_pool(request: Request, work: Callable[..., T], *args: object) -> T:
    """``work(*args)`` on a worker thread once one of the codec pool's tokens is free
    (``app.state.codec``, ``service.app``), the event loop serving other requests meanwhile."""
    return await to_thread.run_sync(work, *args, limiter=request.app.state.codec)


def only_fields(*names: str) -> Callable:
    """A dependency refusing form fields outside ``names`` and fields sent more than once."""

    async def check(request: Request) -> None:
        form = await request.form()
        keys = list(form.keys())
        unknown = sorted(set(keys) - set(names))
        if unknown:
            raise ApiError(
                400, "unknown_field", f"unknown field(s) {unknown}; this route takes {list(names)}"
            )
        repeated = sorted({k for k in keys if len(form.getlist(k)) > 1})
        if repeated:
            raise ApiError(400, "duplicate_field", f"field(s) {repeated} sent more than once")

    return Depends(check)


def _responses(result_fields: Iterable[ResultField], result: type[Result]) -> dict:
    """The OpenAPI responses of a task's route whose results carry ``result_fields``: the PNG or JSON
    result with its headers, and the errors."""
    fields = {f.header: {"description": f.description, "schema": {"type": "string"}} for f in result_fields}
    return {
        200: {
            "description": "the result as a PNG (default) or, with `Accept: application/json`, as JSON with "
            "the PNG in base64; solver statistics in the `X-KDEQ-*` headers either way",
            "model": result,  # the application/json body, as a schema component
            "content": {PNG: {"schema": {"type": "string", "format": "binary"}}},
            "headers": {
                "X-KDEQ-Model": {
                    "description": "the model that answered, NAME:VERSION",
                    "schema": {"type": "string"},
                },
                "X-KDEQ-Iterations": {"description": ITERATIONS_MEANING, "schema": {"type": "integer"}},
                "X-KDEQ-Residual": {
                    "description": RESIDUAL_MEANING + " (`inf` or `nan` if the solve diverged)",
                    "schema": {"type": "string"},
                },
                "X-KDEQ-Converged": {
                    "description": "`true` or `false`: " + CONVERGED_MEANING,
                    "schema": {"type": "string"},
                },
                "X-KDEQ-Lambda": {
                    "description": "λ, the regulariser the solve used (as `lam` in the JSON body)",
                    "schema": {"type": "string"},
                },
                **fields,
                "X-KDEQ-Batch-Size": {
                    "description": "requests solved together with this one",
                    "schema": {"type": "string"},
                },
                "Server-Timing": {
                    "description": "decode, queue, inference, encode and total milliseconds",
                    "schema": {"type": "string"},
                },
            },
        },
        **ERROR_RESPONSES,
    }


ImageField = Annotated[UploadFile, File(description="PNG, JPEG, WebP or TIFF; grey or colour")]
KEYWORD = inspect.Parameter.KEYWORD_ONLY


def _common(
    name: str, kind: object, default: object, description: str, **limits: object
) -> inspect.Parameter:
    return inspect.Parameter(
        name, KEYWORD, default=default, annotation=Annotated[kind, Form(description=description, **limits)]
    )


#: the form fields every inference route takes after its tasks' own, in the order of the OpenAPI
#: document's form (``image``, the task's choice, options and file inputs come before them)
COMMON_FIELDS: tuple[inspect.Parameter, ...] = (
    _common(
        "model",
        str | None,
        None,
        "`NAME` or `NAME:VERSION` of a loaded model (default: the task's first)",
        max_length=100,
    ),
    _common("max_iter", int | None, None, "lower the model's iteration cap for this request", ge=1),
    _common("tol", float | None, None, "solver tolerance for this request", gt=0, lt=1, allow_inf_nan=False),
    _common(
        "history",
        bool,
        False,
        "also return the relative residual at each step (JSON: `solver.history`; at most `max_iter` "
        "numbers; not for images solved in tiles)",
    ),
    _common(
        "uncertainty",
        bool,
        False,
        "also return the output's posterior standard deviation (JSON only: `uncertainty`; the Gaussian "
        "tasks' models and the segmenter, by Laplace's approximation)",
    ),
)


def _check_uncertainty(slot: ModelSlot, request: Request) -> None:
    """422 where ``uncertainty=true`` cannot be answered: the model has no posterior map, or the
    response would be a PNG (it has no room for a second image)."""
    reason = slot.uncertainty_unsupported
    if reason is not None:
        raise ApiError(422, "uncertainty_unsupported", f"no uncertainty map from {slot.id}: {reason}")
    if not wants_json(request.headers.get("accept")):
        raise ApiError(
            422, "uncertainty_needs_json", "the uncertainty map comes in JSON: send Accept: application/json"
        )


def _uncertainty(solved: Solved) -> UncertaintyInfo | None:
    found = solved.uncertainty
    if found is None:
        return None
    png, scale = scaledpng.encode(found.std)
    return UncertaintyInfo(
        png=base64.b64encode(png).decode(),
        scale=scale,
        exact=found.exact,
        probes=found.probes,
        error=found.error,
    )


def _override(
    slot: ModelSlot, max_iter: int | None, tol: float | None, history: bool
) -> SolverOverride | None:
    if max_iter is None and tol is None and not history:
        return None
    cap = slot.config.solver.max_iter
    if max_iter is not None and max_iter > cap:
        raise ApiError(
            422, "max_iter_too_large", f"`max_iter` may lower the cap of {slot.id} ({cap}), not raise it"
        )
    return SolverOverride(max_iter=max_iter, tol=tol, history=history or None)


def _read(upload: UploadFile) -> bytes:
    upload.file.seek(0)
    return upload.file.read()


def _form_parameter(name: str, info: FieldInfo) -> inspect.Parameter:
    """An option of a task's ``Options`` model as a form parameter with the same type and constraints."""
    constraints: dict = {}
    for item in info.metadata:  # annotated-types constraints and pydantic's general metadata
        constraints.update(dataclasses.asdict(item) if dataclasses.is_dataclass(item) else vars(item))
    form = Form(description=info.description, **constraints)
    default = inspect.Parameter.empty if info.is_required() else info.default
    kind = info.annotation
    if get_origin(kind) is Literal and all(type(v) is int for v in get_args(kind)):
        # a form value is text, and a Literal of ints takes no "2"; parsed as an int here, the
        # options model then checks it is one of them
        kind = int
    return inspect.Parameter(name, KEYWORD, default=default, annotation=Annotated[kind, form])


def _decode_inputs(
    task: Task, image: UploadFile, files: dict[str, UploadFile], limit: int
) -> tuple[DecodedImage, dict[str, np.ndarray]]:
    """The decoded ``image`` and the task's file inputs that were sent (``FileInput.kind``)."""
    decoded = decode_image(_read(image), "image", limit)
    arrays = {}
    for spec in task.files:
        upload = files.get(spec.name)
        if upload is None:
            continue
        if spec.kind == "mask":
            arrays[spec.name] = decode_mask(_read(upload), spec.name, decoded.size, limit)
        else:
            arrays[spec.name] = decode_image(_read(upload), spec.name, limit).pixels
    return decoded, arrays


@dataclasses.dataclass(frozen=True)
class TaskRoute:
    """``POST host.route``: the tasks it answers, ``host`` and, where other tasks are variants of it
    (``choice_of``), those too, picked by ``choice.field``; their options, file inputs and result fields
    (each by name, the first task's where two share one); and ``result``, the JSON body's model."""

    host: Task
    choice: Choice | None
    options: dict[str, FieldInfo]
    files: dict[str, FileInput]
    fields: dict[str, ResultField]
    result: type[Result]

    @classmethod
    def of(cls, host: Task) -> TaskRoute:
        choice = choice_of(host)
        tasks = [host] if choice is None else list(choice.tasks.values())
        fields = {f.name: f for t in tasks for f in t.fields}
        result = create_model(
            f"{host.name.title().replace('-', '')}Result",
            __base__=Result,
            **{
                f.name: (float | None, PydanticField(None, description=f.description))
                for f in fields.values()
            },
        )
        return cls(
            host=host,
            choice=choice,
            options={name: info for t in tasks for name, info in t.options.model_fields.items()},
            files={spec.name: spec for t in tasks for spec in t.files},
            fields=fields,
            result=result,
        )

    def form(self) -> list[inspect.Parameter]:
        """The route's form fields, in the OpenAPI document's order: ``image``, the choice's field, the
        options, the file inputs, then ``COMMON_FIELDS``."""
        chosen = []
        if self.choice is not None:
            kind = Literal[tuple(self.choice.tasks)]
            described = Form(description=self.choice.description)
            chosen.append(
                inspect.Parameter(
                    self.choice.field,
                    KEYWORD,
                    default=self.choice.default,
                    annotation=Annotated[kind, described],
                )
            )
        files = [
            inspect.Parameter(
                spec.name,
                KEYWORD,
                default=None,
                annotation=Annotated[UploadFile | None, File(description=spec.description)],
            )
            for spec in self.files.values()
        ]
        return [
            inspect.Parameter("image", KEYWORD, annotation=ImageField),
            *chosen,
            *(_form_parameter(name, info) for name, info in self.options.items()),
            *files,
            *COMMON_FIELDS,
        ]

    def pick(self, sent: set[str], value: object) -> Task:
        """The task the choice's field ``value`` picks (``host`` without a choice); 422
        ``misplaced_option`` where ``sent`` names another task's options or file inputs."""
        if self.choice is None:
            return self.host
        task = self.choice.pick(value)
        misplaced = self.choice.misplaced(task, sent)
        if misplaced:
            raise ApiError(
                422,
                "misplaced_option",
                f"{misplaced} are not fields of {self.choice.field}={self.choice.value_of(task)} "
                f"({task.route})",
            )
        return task

    def description(self) -> str:
        """The host's help, then each variant's after the field value that asks for it."""
        text = " ".join((self.host.__doc__ or self.host.summary).split())
        if self.choice is not None:
            text += "".join(
                f" With `{self.choice.field}={value}` (as `{t.route}`): "
                f"{' '.join((t.__doc__ or t.summary).split())}"
                for value, t in self.choice.tasks.items()
                if t is not self.host
            )
        return text


@dataclasses.dataclass(frozen=True)
class Asked:
    """An inference request's form, read and checked before any image is decoded: the task it picks,
    the model slot answering it, the task's options, the file inputs sent, the solver override, whether
    the uncertainty map is asked for, whether the model solves in tiles, and the pixel limit."""

    task: Task
    slot: ModelSlot
    options: Options
    uploads: dict[str, UploadFile]
    override: SolverOverride | None
    uncertainty: bool
    tiles: bool
    limit: int


async def read_form(request: Request, route: TaskRoute, form: Mapping[str, object]) -> Asked:
    """``form`` (the route's fields, as FastAPI parsed them) checked in this order: the task (422), the
    model (400/404), the solver override (422), the uncertainty map (422), the options (422)."""
    svc = _service(request)
    sent = set((await request.form()).keys())
    task = route.pick(sent, form.get(route.choice.field) if route.choice else None)
    slot = svc.registry.resolve(task.name, form["model"])
    override = _override(slot, form["max_iter"], form["tol"], bool(form["history"]))
    uncertainty = bool(form["uncertainty"])
    if uncertainty:
        _check_uncertainty(slot, request)
    try:
        options = task.options(**{name: form[name] for name in task.options.model_fields})
    except ValidationError as err:
        raise ApiError(422, "invalid_option", describe_errors(err.errors(include_url=False))) from None
    uploads = {f.name: form[f.name] for f in task.files if form[f.name] is not None}
    # a model that solves in tiles keeps a tile's memory at any size; the others, the image's
    settings = svc.settings
    tiles = slot.tiles and settings.tile_size > 0
    limit = pixel_limit(tiles, settings.max_pixels, settings.max_untiled_pixels)
    return Asked(task, slot, options, uploads, override, uncertainty, tiles, limit)


def prepare(asked: Asked, image: UploadFile) -> tuple[TaskRequest, DecodedImage]:
    """The task's ``Request`` for ``image`` and the asked inputs, and the decoded image (run on the codec
    pool): 400/422 for the task's refusals, 413 ``too_many_pixels`` for an output over the limit."""
    task = asked.task
    decoded, arrays = _decode_inputs(task, image, asked.uploads, asked.limit)
    try:
        pixels = counts_of(decoded.pixels, decoded.full_scale) if task.counts else decoded.pixels
        job_input = task.prepare(pixels, decoded.alpha, asked.options, arrays, asked.override)
        job_input = dataclasses.replace(job_input, uncertainty=asked.uncertainty)
        if asked.uncertainty:
            task.check_uncertainty(job_input)
    except InputError as err:
        raise ApiError(400 if err.absent else 422, err.code, err.detail) from None
    h, w = task.output_size(job_input)
    if h * w > asked.limit:
        raise ApiError(413, "too_many_pixels", f"the output would be {w}×{h}, more than {asked.limit} pixels")
    return job_input, decoded


def make_job(route: TaskRoute, asked: Asked, job_input: TaskRequest, deadline: float, tile_size: int) -> Job:
    """The engine's job for ``job_input``: batched with requests to the same model slot whose inputs
    have the same shape (a model that pads exactly: within a factor of two,
    ``kdeq.predictors.base.pad_images``) and the same task batch key and uncertainty; an image solved in
    tiles alone (its tiles are batched: batched with others, each would wait for all the others' tiles)."""
    task, slot = asked.task, asked.slot
    h, w = task.output_size(job_input)
    c = job_input.image.shape[0]
    ih, iw = job_input.image.shape[-2:]
    shape = (c, ih.bit_length(), iw.bit_length()) if slot.pads_exactly else job_input.image.shape
    alone = object() if asked.tiles and ih * iw > tile_size**2 else None
    return Job(
        # the route requested, as the HTTP metrics label it: one request, one label, whichever of the
        # route's tasks answers it (the model label names that)
        endpoint=route.host.route,
        model=slot.id,
        batch_key=(slot, shape, task.batch_key(job_input), alone, asked.uncertainty),
        payload=job_input,
        pixels=h * w,
        deadline=deadline,
        target=slot,
    )


def result_headers(task: Task, slot: ModelSlot, solved: Solved, job: Job, timings: Timings) -> dict[str, str]:
    """The ``X-KDEQ-*`` headers of an answer (the task's result fields where they have a value),
    ``Server-Timing`` in milliseconds, and ``Vary: Accept``."""
    headers = {
        "Vary": "Accept",
        "X-KDEQ-Model": slot.id,
        "X-KDEQ-Iterations": str(solved.iterations),
        "X-KDEQ-Residual": f"{solved.residual:.3e}",
        "X-KDEQ-Converged": "true" if solved.converged else "false",
        "X-KDEQ-Lambda": f"{solved.lam:.6e}",
        "X-KDEQ-Batch-Size": str(job.batch_size),
        "Server-Timing": ", ".join(
            f"{k.removesuffix('_seconds')};dur={v * 1e3:.1f}" for k, v in timings.model_dump().items()
        ),
    }
    for f in task.fields:
        value = solved.fields[f.name]
        if value is not None:
            headers[f.header] = format(value, f.format)
    return headers


async def infer(request: Request, route: TaskRoute, form: Mapping[str, object]) -> Response:
    """One inference request to ``route``: the form read (``read_form``), the inputs decoded and made
    into the task's ``Request`` on the codec pool (``prepare``), solved by the engine (``make_job``),
    the output encoded on the codec pool; the PNG with ``result_headers``, or with
    ``Accept: application/json`` the route's ``Result`` with the PNG in base64."""
    svc = _service(request)
    start = time.monotonic()
    ticket = request.state.kdeq_ticket  # admitted by the Admission middleware
    asked = await read_form(request, route, form)
    task, slot = asked.task, asked.slot
    try:
        job_input, decoded = await _on_codec_pool(request, prepare, asked, form["image"])
    except ApiError as err:
        if err.error == "too_many_pixels":
            svc.metrics.rejected.labels("too_many_pixels").inc()
        raise
    decoded_at = time.monotonic()
    deadline = start + svc.settings.request_timeout_seconds
    job = make_job(route, asked, job_input, deadline, svc.settings.tile_size)
    solved: Solved = await svc.engine.infer(job, ticket)
    done_at = time.monotonic()
    mode = task.output_mode(decoded.mode)
    alpha = task.output_alpha(job_input, decoded.alpha, list(asked.uploads))
    png = await _on_codec_pool(request, encode_png, solved.output, mode, alpha)
    std = None if solved.uncertainty is None else await _on_codec_pool(request, _uncertainty, solved)
    end = time.monotonic()
    timings = Timings(
        decode_seconds=decoded_at - start,
        queue_seconds=job.started_at - job.enqueued_at,
        inference_seconds=done_at - job.started_at,
        encode_seconds=end - done_at,
        total_seconds=end - start,
    )
    record_phases(
        [
            ("decode", start, decoded_at),
            ("queue", job.enqueued_at, job.started_at),
            ("solve", job.started_at, done_at),
            ("encode", done_at, end),
        ],
        {
            "model": slot.id,
            "iterations": solved.iterations,
            "residual": solved.residual,
            "converged": solved.converged,
            "batch_size": job.batch_size,
        },
    )
    headers = result_headers(task, slot, solved, job, timings)
    if not wants_json(request.headers.get("accept")):
        return Response(png, media_type=PNG, headers=headers)
    h, w = task.output_size(job_input)
    # JSON has no infinity: a diverged solve's residual is reported as null (the header says "inf")
    residual = solved.residual if math.isfinite(solved.residual) else None
    body = route.result(
        model=slot.id,
        image=base64.b64encode(png).decode(),
        width=w,
        height=h,
        mode=mode,
        solver=SolverInfo(
            iterations=solved.iterations,
            residual=residual,
            converged=solved.converged,
            history=None
            if solved.history is None
            else [v if math.isfinite(v) else None for v in solved.history],
        ),
        lam=solved.lam,
        batch_size=job.batch_size,
        timings=timings,
        uncertainty=std,
        **solved.fields,
    )
    return JSONResponse(body.model_dump(), headers=headers)


def add_task_route(router: APIRouter, host: Task) -> None:
    """``POST /<host>``: the form is ``TaskRoute.form`` (``image``, the task's options and file inputs,
    ``COMMON_FIELDS``); the answer is ``infer``'s. Where other tasks are variants of ``host``
    (``choice_of``), its choice's field picks the task, and the route takes their options and file inputs
    too, each only with the value that picks its task (422 ``misplaced_option`` otherwise).

    The endpoint FastAPI calls is only an adapter: its ``__signature__`` declares the route's own form
    fields, which FastAPI reads to parse the form and to write the OpenAPI document."""
    route = TaskRoute.of(host)
    form = route.form()

    async def endpoint(request: Request, **fields: object) -> Response:
        return await infer(request, route, fields)

    request = inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)
    endpoint.__signature__ = inspect.Signature([request, *form])
    endpoint.__name__ = host.name.replace("-", "_")
    router.add_api_route(
        host.route,
        endpoint,
        methods=["POST"],
        summary=host.summary,
        description=route.description(),
        responses=_responses(route.fields.values(), route.result),
        response_class=Response,
        dependencies=[*AUTH, only_fields(*(p.name for p in form))],
    )


for _task in TASKS.values():
    add_task_route(router, _task)


class TaskInfo(BaseModel):
    """A task as ``GET /tasks`` lists it: enough for a client to build its form."""

    name: str
    route: str
    summary: str
    family: str
    options: dict
    files: list[dict]
    fields: list[dict]
    models: list[str]
    also: dict | None = PydanticField(
        None,
        description="where the task is also asked for: `{route, field, value}`, e.g. `/denoise` with "
        "`noise=poisson`",
    )


@router.get("/tasks", summary="The tasks, their options and their loaded models", dependencies=AUTH)
async def tasks(request: Request) -> list[TaskInfo]:
    registry = _service(request).registry
    return [
        TaskInfo(
            name=t.name,
            route=t.route,
            summary=t.summary,
            family=t.family,
            options=t.options.model_json_schema(),
            files=[{"name": f.name, "description": f.description, "kind": f.kind} for f in t.files],
            fields=[{"name": f.name, "description": f.description, "header": f.header} for f in t.fields],
            models=[s.id for s in registry.slots.values() if s.ready and s.task == t.name],
            also=None
            if t.variant is None
            else {"route": TASKS[t.variant.host].route, "field": t.variant.field, "value": t.variant.value},
        )
        for t in TASKS.values()
    ]


class ModelInfo(BaseModel):
    id: str
    task: str | None
    ready: bool
    error: str | None
    default: bool
    description: str | None
    family: str | None
    architecture: str | None
    init: str | None
    solver: dict | None
    devices: list[str]
    load_seconds: float | None
    uncertainty: bool = PydanticField(
        description="whether its requests may ask for the posterior standard deviation (`uncertainty=true`)"
    )


@router.get(
    "/models",
    summary="Configured models, their state and errors",
    dependencies=AUTH,
    responses={401: ERROR_RESPONSES[401]},
)
async def models(request: Request) -> list[ModelInfo]:
    registry = _service(request).registry
    defaults = {t: s.id for t in TASKS for s in [registry.default(t)] if s is not None}
    out = []
    for slot in registry.slots.values():
        c = slot.config
        out.append(
            ModelInfo(
                id=slot.id,
                task=slot.task,
                ready=slot.ready,
                error=slot.error,
                default=defaults.get(slot.task or "") == slot.id,
                description=c.description if c else None,
                family=c.family if c else None,
                architecture=c.architecture.kind if c else None,
                init=c.provenance.init if c else None,
                solver=c.solver.model_dump() if c else None,
                devices=sorted(slot.predictors),
                load_seconds=slot.load_seconds,
                uncertainty=slot.ready and slot.uncertainty_unsupported is None,
            )
        )
    return out


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    detail: str | None = None


@router.get("/healthz", summary="Liveness: the process answers (never touches a model)")
async def healthz() -> Health:
    return Health(status="alive")


@router.get(
    "/readyz",
    summary="Readiness: 200 once models are loaded and warm, 503 while starting or draining",
    responses={
        200: {"model": Readiness, "description": "ready"},
        503: {
            "model": Readiness,
            "description": "starting, draining, no model could be loaded, or a device failed "
            "(`detail` names it and the error; the process is exiting to be restarted)",
        },
    },
)
async def readyz(request: Request) -> JSONResponse:
    """`{"status": …}`: `ready` (200); `starting`, `draining`, `stopped`, `no_models`, `workers_down` or
    `device_failed` with `detail` (503)."""
    svc = _service(request)
    status = svc.readiness()
    body = {"status": status} if svc.fault is None else {"status": status, "detail": svc.fault}
    return JSONResponse(body, status_code=200 if status == "ready" else 503)


class ModelState(BaseModel):
    """``GET /models/{name}``: the version of ``name`` serving and the versions the repository has."""

    name: str
    serving: str | None = PydanticField(description="`NAME:VERSION` answering requests; null if none")
    version: int | None
    ready: bool
    error: str | None = PydanticField(description="why the configured version is not ready")
    devices: list[str]
    load_seconds: float | None
    versions: list[int] = PydanticField(description="the versions in the model repository")


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int | None = PydanticField(
        None, ge=1, description="the version to load (default: the highest in the repository)"
    )


def _model_state(svc: Service, name: str) -> ModelState:
    """``name``'s state; ``ApiError`` 404 when it is neither configured nor in the repository."""
    slots = svc.registry.named(name)
    versions = svc.registry.versions(name)
    if not slots and not versions:
        raise ApiError(404, "no_model", f"no model {name!r} is configured or in the repository")
    slot = next((s for s in slots if s.ready), slots[0] if slots else None)
    return ModelState(
        name=name,
        serving=slot.id if slot is not None and slot.ready else None,
        version=int(slot.id.partition(":")[2]) if slot is not None and slot.path is not None else None,
        ready=slot is not None and slot.ready,
        error=slot.error if slot is not None else None,
        devices=sorted(slot.predictors) if slot is not None else [],
        load_seconds=slot.load_seconds if slot is not None else None,
        versions=versions,
    )


MODEL_ERRORS = {401: ERROR_RESPONSES[401], 404: {**ERROR_RESPONSES[404], "description": "no such model"}}
CONTROL_ERRORS = {
    **MODEL_ERRORS,
    403: {"model": ErrorBody, "description": "`KDEQ_MODEL_CONTROL` is off"},
    503: {"model": ErrorBody, "description": "the service is starting or draining"},
}


@router.get(
    "/models/{name}",
    summary="One model: the version serving, its devices and readiness, the versions on disk",
    dependencies=AUTH,
    responses=MODEL_ERRORS,
)
async def model_state(request: Request, name: str) -> ModelState:
    return _model_state(_service(request), name)


@router.get(
    "/models/{name}/ready",
    summary="Per-model readiness (the Open Inference Protocol's model ready): 200 or 503",
    dependencies=AUTH,
    responses={**MODEL_ERRORS, 200: {"model": Readiness}, 503: {"model": Readiness}},
)
async def model_ready(request: Request, name: str) -> JSONResponse:
    state = _model_state(_service(request), name)
    body = {"status": "ready"} if state.ready else {"status": "not_ready", "detail": state.error}
    return JSONResponse(body, status_code=200 if state.ready else 503)


@router.post(
    "/models/{name}/load",
    summary="Load a version (default the latest), warm it on every device, then swap it in",
    description="Requests admitted before the swap finish on the version they were admitted with. A "
    "load that fails leaves the version serving untouched and answers 422 `load_failed` with the file "
    "and the reason. Needs `KDEQ_MODEL_CONTROL=true`.",
    dependencies=AUTH,
    responses={
        **CONTROL_ERRORS,
        400: {"model": ErrorBody, "description": "the body is not a JSON object"},
        422: {"model": ErrorBody, "description": "the version did not load, or the body is not valid"},
    },
)
async def load_model(request: Request, name: str, body: LoadRequest | None = None) -> ModelState:
    svc = _service(request)
    await run_in_threadpool(svc.load_model, name, body.version if body is not None else None)
    return _model_state(svc, name)


@router.post(
    "/models/{name}/unload",
    summary="Stop serving a model; requests already admitted finish",
    description="Needs `KDEQ_MODEL_CONTROL=true`.",
    dependencies=AUTH,
    responses=CONTROL_ERRORS,
)
async def unload_model(request: Request, name: str) -> ModelState:
    svc = _service(request)
    await run_in_threadpool(svc.unload_model, name)
    return _model_state(svc, name)


STATIC = Path(__file__).resolve().parent / "static"
# the page loads only its own files: no CDN, no inline script
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; "
    "script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


@router.get("/", summary="A page to try the models in a browser", response_class=FileResponse)
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)


@functools.lru_cache(maxsize=16)
def _sample_png(name: str) -> bytes:
    """The generated image ``name`` (``kdeq.images.samples.sample_images``) as PNG bytes, made once."""
    buffer = io.BytesIO()
    Image.fromarray(to_bytes(sample_images()[name])).save(buffer, format="PNG")
    return buffer.getvalue()


@router.get(
    "/samples/{task}",
    summary='A generated image to try a task on (the page\'s "Try a sample")',
    response_class=Response,
    responses={
        200: {"description": "a PNG", "content": {PNG: {"schema": {"type": "string", "format": "binary"}}}},
        404: ERROR_RESPONSES[404],
    },
)
async def sample(task: str) -> Response:
    if task not in TASKS:
        raise ApiError(404, "not_found", f"no task {task!r}; the tasks are {', '.join(TASKS)}")
    png = await run_in_threadpool(_sample_png, TASKS[task].sample)
    return Response(png, media_type=PNG, headers={"Cache-Control": "public, max-age=86400"})


@router.get("/metrics", summary="Prometheus metrics (text format)", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(_service(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
