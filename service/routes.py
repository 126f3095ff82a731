"""The HTTP routes: inference (``/denoise``, ``/inpaint``, ``/segment``) and operations
(``/models``, ``/healthz``, ``/readyz``, ``/metrics``).

An inference request is decoded (``service.decode``, in a worker thread),
queued and solved (``service.engine`` → ``service.tasks``) and encoded
(``service.encode``, in a worker thread).
"""

from __future__ import annotations

import base64
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, File, Form, Request, Security, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import APIKeyHeader, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from kdeq.predictor import SolverOverride
from service.decode import DecodedImage, decode_image, decode_mask
from service.encode import PNG, encode_png, wants_json
from service.engine import Job
from service.errors import ERROR_RESPONSES, ApiError
from service.registry import ModelSlot
from service.state import Service
from service.tasks import Solved, TaskInput

router = APIRouter()

# declared for the OpenAPI document; the ApiKey middleware enforces the key before a body is read
AUTH = [Security(HTTPBearer(auto_error=False)), Security(APIKeyHeader(name="X-API-Key", auto_error=False))]


class SolverInfo(BaseModel):
    iterations: int
    residual: float | None
    converged: bool


class Timings(BaseModel):
    decode_seconds: float
    queue_seconds: float
    inference_seconds: float
    encode_seconds: float
    total_seconds: float


class Result(BaseModel):
    """The JSON body of an inference response (``Accept: application/json``)."""

    model: str
    image: str
    media_type: str = PNG
    width: int
    height: int
    mode: str
    solver: SolverInfo
    lam: float
    sigma: float | None
    threshold: float | None
    batch_size: int
    timings: Timings


def _service(request: Request) -> Service:
    return request.app.state.service


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


PNG_AND_JSON = {
    200: {
        "description": "the result as a PNG (default) or, with `Accept: application/json`, as JSON with "
        "the PNG in base64; solver statistics in the `X-KDEQ-*` headers either way",
        "model": Result,  # the application/json body, as a schema component
        "content": {PNG: {"schema": {"type": "string", "format": "binary"}}},
        "headers": {
            "X-KDEQ-Model": {
                "description": "the model that answered, NAME:VERSION",
                "schema": {"type": "string"},
            },
            "X-KDEQ-Iterations": {"description": "solver iterations", "schema": {"type": "integer"}},
            "X-KDEQ-Residual": {
                "description": "relative residual ‖f(z)−z‖/‖f(z)‖ (`inf` or `nan` if the solve diverged)",
                "schema": {"type": "string"},
            },
            "X-KDEQ-Converged": {
                "description": "`true` or `false` (the best iterate is returned)",
                "schema": {"type": "string"},
            },
            "X-KDEQ-Sigma": {
                "description": "noise level used, 0–255 (denoise)",
                "schema": {"type": "string"},
            },
            "X-KDEQ-Threshold": {"description": "threshold used (segment)", "schema": {"type": "string"}},
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
ModelField = Annotated[
    str | None,
    Form(
        description="`NAME` or `NAME:VERSION` of a loaded model (default: the task's first)", max_length=100
    ),
]
MaxIterField = Annotated[
    int | None, Form(ge=1, description="lower the model's iteration cap for this request")
]
TolField = Annotated[
    float | None, Form(gt=0, lt=1, allow_inf_nan=False, description="solver tolerance for this request")
]


def _override(slot: ModelSlot, max_iter: int | None, tol: float | None) -> SolverOverride | None:
    if max_iter is None and tol is None:
        return None
    cap = slot.config.solver.max_iter
    if max_iter is not None and max_iter > cap:
        raise ApiError(
            422, "max_iter_too_large", f"`max_iter` may lower the cap of {slot.id} ({cap}), not raise it"
        )
    return SolverOverride(max_iter=max_iter, tol=tol)


async def _infer(
    request: Request,
    endpoint: str,
    slot: ModelSlot,
    make_input: Callable[[], tuple[TaskInput, DecodedImage]],
    output_mode: Callable[[DecodedImage], tuple[str, object]],
) -> Response:
    svc = _service(request)
    start = time.monotonic()
    ticket = request.state.kdeq_ticket  # admitted by the Admission middleware
    try:
        task_input, decoded = await run_in_threadpool(make_input)
    except ApiError as err:
        if err.error == "too_many_pixels":
            svc.metrics.rejected.labels("too_many_pixels").inc()
        raise
    decoded_at = time.monotonic()
    h, w = task_input.image.shape[-2:]
    job = Job(
        endpoint=endpoint,
        model=slot.id,
        batch_key=task_input.batch_key(slot.id, slot.pads_exactly),
        payload=task_input,
        pixels=h * w,
        deadline=start + svc.settings.request_timeout_seconds,
    )
    solved: Solved = await svc.engine.infer(job, ticket)
    done_at = time.monotonic()
    mode, alpha = output_mode(decoded)
    png = await run_in_threadpool(encode_png, solved.output, mode, alpha)
    end = time.monotonic()
    timings = Timings(
        decode_seconds=decoded_at - start,
        queue_seconds=job.started_at - job.enqueued_at,
        inference_seconds=done_at - job.started_at,
        encode_seconds=end - done_at,
        total_seconds=end - start,
    )
    headers = {
        "Vary": "Accept",
        "X-KDEQ-Model": slot.id,
        "X-KDEQ-Iterations": str(solved.iterations),
        "X-KDEQ-Residual": f"{solved.residual:.3e}",
        "X-KDEQ-Converged": "true" if solved.converged else "false",
        "X-KDEQ-Batch-Size": str(job.batch_size),
        "Server-Timing": ", ".join(
            f"{k.removesuffix('_seconds')};dur={v * 1e3:.1f}" for k, v in timings.model_dump().items()
        ),
    }
    if solved.sigma is not None:
        headers["X-KDEQ-Sigma"] = f"{solved.sigma:.3f}"
    if solved.threshold is not None:
        headers["X-KDEQ-Threshold"] = f"{solved.threshold:.4f}"
    if not wants_json(request.headers.get("accept")):
        return Response(png, media_type=PNG, headers=headers)
    # JSON has no infinity: a diverged solve's residual is reported as null (the header says "inf")
    residual = solved.residual if math.isfinite(solved.residual) else None
    body = Result(
        model=slot.id,
        image=base64.b64encode(png).decode(),
        width=w,
        height=h,
        mode=mode,
        solver=SolverInfo(iterations=solved.iterations, residual=residual, converged=solved.converged),
        lam=solved.lam,
        sigma=solved.sigma,
        threshold=solved.threshold,
        batch_size=job.batch_size,
        timings=timings,
    )
    return JSONResponse(body.model_dump(), headers=headers)


def _admit(
    request: Request, task: str, model: str | None, max_iter: int | None, tol: float | None
) -> tuple[ModelSlot, SolverOverride | None, int]:
    """Before decoding: the model (400/404), the solver override (422) and the pixel limit. (The
    ``Admission`` middleware has refused already when the engine could not take the request.)"""
    svc = _service(request)
    slot = svc.registry.resolve(task, model)
    return slot, _override(slot, max_iter, tol), svc.settings.max_pixels


def _read(upload: UploadFile) -> bytes:
    upload.file.seek(0)
    return upload.file.read()


def _same_mode(decoded: DecodedImage) -> tuple[str, object]:
    return decoded.mode, decoded.alpha


@router.post(
    "/denoise",
    summary="Remove noise from an image",
    responses=PNG_AND_JSON,
    response_class=Response,
    dependencies=[*AUTH, only_fields("image", "sigma", "model", "max_iter", "tol")],
)
async def denoise(
    request: Request,
    image: ImageField,
    sigma: Annotated[
        float | None,
        Form(
            ge=0,
            le=255,
            allow_inf_nan=False,
            description="noise level on the 0–255 scale (default: estimated)",
        ),
    ] = None,
    model: ModelField = None,
    max_iter: MaxIterField = None,
    tol: TolField = None,
) -> Response:
    """Denoise `image` with a Gaussian kGLM-DEQ; `sigma` is estimated per image when absent."""
    slot, override, limit = _admit(request, "denoise", model, max_iter, tol)

    def make() -> tuple[TaskInput, DecodedImage]:
        decoded = decode_image(_read(image), "image", limit)
        return TaskInput(decoded.pixels, sigma=sigma, solver=override), decoded

    return await _infer(request, "/denoise", slot, make, _same_mode)


@router.post(
    "/inpaint",
    summary="Fill missing pixels",
    responses=PNG_AND_JSON,
    response_class=Response,
    dependencies=[*AUTH, only_fields("image", "mask", "model", "max_iter", "tol")],
)
async def inpaint(
    request: Request,
    image: ImageField,
    mask: Annotated[
        UploadFile | None,
        File(
            description="same size as `image`, non-zero = missing; "
            "when absent, the image's alpha channel is 0 where missing"
        ),
    ] = None,
    model: ModelField = None,
    max_iter: MaxIterField = None,
    tol: TolField = None,
) -> Response:
    """Fill the missing pixels of `image` (given by `mask`, or by a zero alpha channel)."""
    slot, override, limit = _admit(request, "inpaint", model, max_iter, tol)

    def make() -> tuple[TaskInput, DecodedImage]:
        decoded = decode_image(_read(image), "image", limit)
        if mask is not None:
            missing = decode_mask(_read(mask), "mask", decoded.size, limit)
        elif decoded.alpha is not None:
            missing = decoded.alpha == 0
        else:
            raise ApiError(
                400, "missing_mask", "send a `mask`, or an image with an alpha channel 0 where missing"
            )
        if bool(missing.all()):
            raise ApiError(422, "nothing_observed", "every pixel is marked missing; nothing to inpaint from")
        if not bool(missing.any()):
            raise ApiError(
                422,
                "nothing_missing",
                "no pixel is marked missing (mask: non-zero = missing); nothing to fill",
            )
        return TaskInput(decoded.pixels, missing=missing, solver=override), decoded

    def mode(decoded: DecodedImage) -> tuple[str, object]:
        if mask is not None or decoded.alpha is None:
            return decoded.mode, decoded.alpha
        # holes given by the alpha channel are filled, so they become opaque; the rest keeps its alpha
        return decoded.mode, np.where(decoded.alpha == 0, np.float32(1), decoded.alpha)

    return await _infer(request, "/inpaint", slot, make, mode)


@router.post(
    "/segment",
    summary="Binary foreground mask",
    responses=PNG_AND_JSON,
    response_class=Response,
    dependencies=[*AUTH, only_fields("image", "threshold", "output", "model", "max_iter", "tol")],
)
async def segment(
    request: Request,
    image: ImageField,
    threshold: Annotated[
        float | None,
        Form(
            ge=0, le=1, allow_inf_nan=False, description="binarisation threshold in [0, 1] (default: Otsu's)"
        ),
    ] = None,
    output: Annotated[
        Literal["mask", "probability"],
        Form(description="`mask`: 0/255 grey PNG; `probability`: foreground probability × 255"),
    ] = "mask",
    model: ModelField = None,
    max_iter: MaxIterField = None,
    tol: TolField = None,
) -> Response:
    """Segment `image` into foreground and background with kernel logistic regression."""
    slot, override, limit = _admit(request, "segment", model, max_iter, tol)

    def make() -> tuple[TaskInput, DecodedImage]:
        decoded = decode_image(_read(image), "image", limit)
        return TaskInput(decoded.pixels, threshold=threshold, output=output, solver=override), decoded

    return await _infer(request, "/segment", slot, make, lambda decoded: ("L", None))


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


@router.get(
    "/models",
    summary="Configured models, their state and errors",
    dependencies=AUTH,
    responses={401: ERROR_RESPONSES[401]},
)
async def models(request: Request) -> list[ModelInfo]:
    registry = _service(request).registry
    defaults = {
        t: s.id for t in ("denoise", "inpaint", "segment") for s in [registry.default(t)] if s is not None
    }
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


@router.get("/metrics", summary="Prometheus metrics (text format)", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(_service(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
