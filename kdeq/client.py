"""A Python client for the kdeq HTTP service: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Each has one method per registered task (``kdeq.registry.TASKS``), named after it with ``-`` written
``_``: ``client.denoise(image, sigma=25)``, ``client.inpaint(image, mask=missing)``,
``client.super_resolve(image, scale=2)``. Its keyword arguments are the task's options and file
inputs (as in ``kdeq TASK`` and docs/api.md), sent only when given, plus ``model``, ``max_iter``,
``tol``, ``uncertainty`` (also return the output's posterior standard deviation: ``Result.uncertainty``)
and ``request_id``; it returns a ``Result``. ``client.run(task, image, **kwargs)`` is the
same call by the task's name. Images go in as numpy arrays, PIL images, paths or encoded file bytes
and come back as numpy arrays, with the PNG the service sent. ``model``, ``load_model`` and
``unload_model`` read and change which version of a model the service serves (``ModelState``).

Every call sends an ``X-Request-ID``: the caller's ``request_id`` (1 to 128 printable ASCII characters,
no spaces, as the service accepts; ``ValueError`` otherwise) or a new random one (32 hex digits), the
same on every attempt, and on every ``Result`` and ``KdeqError``.

A request the service refuses raises a ``KdeqError`` subclass carrying its error code, detail, HTTP
status and request ID. A 503 (queue full, not ready, out of memory, …) is sent again after the whole
seconds its ``Retry-After`` names (at least 0.05 s) as long as that wait ends within ``retry_budget``
seconds of wall time from the first attempt, the attempts' own time included; a 503 without
``Retry-After``, or with an HTTP-date one, is raised at once, and so is every other refusal, which
would be repeated. ``timeout`` bounds each of connecting, reading and writing (httpx's semantics), not
the whole call.

The client speaks HTTP only (``kdeq`` never imports ``service``). It needs ``httpx2``, the ``client``
extra (``pip install 'kdeq[client]'``), imported when a client is made, so that ``kdeq`` and its
command line work without it.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import io
import mimetypes
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from PIL import Image

from kdeq.images import scaledpng
from kdeq.registry import TASKS, get_task
from kdeq.tasks.base import Task, UncertaintyMap

if TYPE_CHECKING:
    import httpx2 as httpx

#: an image input: a numpy array, a PIL image, a path, or an encoded image file's bytes
ImageInput = np.ndarray | Image.Image | str | os.PathLike | bytes

#: seconds each of connecting, reading and writing may take (the service's own deadline is 60 s by
#: default, from its upload read)
DEFAULT_TIMEOUT = 120.0
#: seconds of wall time from a call's first attempt within which a 503'd request may be sent again
DEFAULT_RETRY_BUDGET = 30.0
#: the shortest wait before sending again, so that ``Retry-After: 0`` does not spin
RETRY_FLOOR = 0.05

# the modes Pillow writes as PNG; any other (``I``, ``F``, ``CMYK``, …) is refused rather than converted
# behind the caller's back
PNG_MODES = frozenset({"1", "L", "LA", "I;16", "I;16B", "P", "RGB", "RGBA"})
# an X-Request-ID the service keeps (service.middleware.CLIENT_REQUEST_ID); it replaces any other
REQUEST_ID = re.compile(r"[!-~]{1,128}")

T = TypeVar("T")


def _httpx() -> ModuleType:
    """The ``httpx2`` module; ``ImportError`` saying how to install it when it is missing."""
    try:
        import httpx2
    except ImportError as err:
        raise ImportError("kdeq.client needs httpx2: pip install 'kdeq[client]'") from err
    return httpx2


# --------------------------------------------------------------------------------------------- errors


class KdeqError(Exception):
    """A request the service refused or could not answer.

    Attributes:
        code: the service's error code (``invalid_option``, ``queue_full``, …; docs/api.md), or the
            client's own where no answer came: ``client_timeout``, ``connection_failed``.
        detail: what was wrong, in words.
        status: the HTTP status; ``None`` where no answer came.
        request_id: the request's ID (the answer's ``X-Request-ID``, else its body's ``request_id``,
            else the one the client sent).
    """

    def __init__(self, code: str, detail: str, status: int | None, request_id: str):
        super().__init__(code, detail, status, request_id)
        self.code, self.detail, self.status, self.request_id = code, detail, status, request_id

    def __str__(self) -> str:
        where = "no answer" if self.status is None else f"HTTP {self.status}"
        rid = "" if self.request_id is None else f", request {self.request_id}"
        return f"{self.code} ({where}{rid}): {self.detail}"


class InvalidRequestError(KdeqError):
    """4xx but 401 and 413: a missing, malformed or out-of-range input, an unknown model (404), an
    undecodable image (415)."""


class UnauthorizedError(KdeqError):
    """401: the API key is missing or wrong."""


class TooLargeError(KdeqError):
    """413: the upload is over the byte limit (``payload_too_large``) or the image, or the output, over
    the pixel limit (``too_many_pixels``)."""


class UnavailableError(KdeqError):
    """503 once the retry budget would be overrun (or without a ``Retry-After`` in seconds): not ready,
    draining, queue full, out of memory, a device failed. ``retry_after`` is the last answer's
    ``Retry-After`` in seconds (``None`` without one, or for an HTTP-date one)."""

    def __init__(self, code: str, detail: str, status: int, request_id: str, retry_after: float | None):
        super().__init__(code, detail, status, request_id)
        self.retry_after = retry_after


class RequestTimeoutError(KdeqError):
    """504: no result within the service's request timeout; or, with ``code`` ``client_timeout`` and
    no status, no answer within the client's ``timeout``."""


class ServerError(KdeqError):
    """500, any other status the API does not define, or an answer that is not a kdeq result."""


class ConnectionFailedError(KdeqError):
    """No answer: the service could not be reached or the connection broke (``connection_failed``)."""


# the classes of the statuses that are not simply "the request is wrong" (4xx) or "the server is" (5xx)
_BY_STATUS: dict[int, type[KdeqError]] = {
    401: UnauthorizedError,
    413: TooLargeError,
    503: UnavailableError,
    504: RequestTimeoutError,
}


def _retry_after(response: httpx.Response) -> float | None:
    """The answer's ``Retry-After`` in whole seconds (what the service sends); ``None`` without one or
    for any other form (an HTTP-date, garbage), which is then not retried."""
    value = response.headers.get("retry-after", "").strip()
    # not str.isdigit, which takes other scripts' digits and superscripts that float() refuses
    return float(value) if re.fullmatch(r"[0-9]+", value) else None


def _error(response: httpx.Response, sent_id: str) -> KdeqError:
    """The exception for a refused request: the class by status, the code and detail from the JSON error
    body ``{"error", "detail", "request_id"}`` (from the status and text where the body is not one, as a
    proxy's might not be)."""
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    body = body if isinstance(body, dict) else {}
    code = body.get("error") if isinstance(body.get("error"), str) else f"http_{status}"
    detail = body.get("detail") if isinstance(body.get("detail"), str) else response.text.strip()[:500]
    body_id = body.get("request_id") if isinstance(body.get("request_id"), str) else None
    rid = response.headers.get("x-request-id") or body_id or sent_id
    cls = _BY_STATUS.get(status, InvalidRequestError if 400 <= status < 500 else ServerError)
    if cls is UnavailableError:
        return UnavailableError(code, detail or response.reason_phrase, status, rid, _retry_after(response))
    return cls(code, detail or response.reason_phrase, status, rid)


def _delay(response: httpx.Response, now: float, deadline: float) -> float | None:
    """Seconds to wait before sending the request again: a 503's ``Retry-After`` (at least
    ``RETRY_FLOOR``) where the wait ends by ``deadline`` (``time.monotonic`` seconds, as ``now``);
    ``None``: answer with ``response`` as it is."""
    if response.status_code != 503:
        return None
    after = _retry_after(response)
    if after is None:
        return None
    wait = max(after, RETRY_FLOOR)
    return None if now + wait > deadline else wait


# ---------------------------------------------------------------------------------------------- results


@dataclass(frozen=True, eq=False)
class Result:
    """One task's answer.

    Attributes:
        task: the task's name.
        image: the output as its PNG decodes: ``(H, W)`` grey or ``(H, W, c)`` with ``c`` 2 (grey and
            alpha), 3 (RGB) or 4 (RGBA); uint8, or uint16 for a 16-bit grey input. The input's colour
            mode and alpha are kept, except that a segmenter's output is grey; ``H × W`` is the task's
            output size (``scale`` times the input's for super-resolve).
        png: the PNG the service sent (``save`` writes it as it is).
        model: the model that answered, ``NAME:VERSION``.
        iterations, residual, converged: the fixed-point solve's statistics (the relative residual is
            ``inf`` or ``nan`` where the solve diverged; the best iterate is returned all the same).
        lam: ``λ``, the regulariser the solve used.
        fields: the task's result values by name (``Task.fields``: denoise's and deblur's ``sigma``,
            segment's ``threshold``), ``None`` where the service sent none.
        batch_size: the requests solved together with this one.
        timings: seconds per phase from ``Server-Timing``: ``decode``, ``queue``, ``inference``,
            ``encode`` and ``total``.
        request_id: the answer's ``X-Request-ID``, else the one the client sent.
        uncertainty: with ``uncertainty=True``, the output's posterior standard deviation (``std``
            ``(H, W)`` float32 on the output's [0, 1] scale, to the 16-bit PNG's resolution; whether it
            is exact, the probes, the estimate's own error estimate); else ``None``.
    """

    task: str
    image: np.ndarray
    png: bytes
    model: str
    iterations: int
    residual: float
    converged: bool
    lam: float
    fields: Mapping[str, float | None]
    batch_size: int
    timings: Mapping[str, float]
    request_id: str
    uncertainty: UncertaintyMap | None = None

    def save(self, path: str | os.PathLike) -> None:
        """Write the PNG the service sent to ``path``."""
        Path(path).write_bytes(self.png)


def _timings(header: str) -> dict[str, float]:
    """Seconds per phase from a ``Server-Timing`` header (``decode;dur=1.2, queue;dur=0.1, …``, in ms)."""
    out = {}
    for metric in filter(None, (m.strip() for m in header.split(","))):
        name, *params = (p.strip() for p in metric.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key == "dur":  # milliseconds to 0.1; rounded, the seconds show no binary noise
                out[name] = round(float(value) / 1e3, 7)
    return out


def _result(task: Task, response: httpx.Response, sent_id: str) -> Result:
    """The ``Result`` of a 200 answer: the PNG decoded, the ``X-KDEQ-*`` headers and ``Server-Timing``
    read; ``ServerError`` ``bad_response`` where they are not a kdeq result's."""
    headers = response.headers
    rid = headers.get("x-request-id") or sent_id
    try:
        png, uncertainty = response.content, None
        if headers.get("content-type", "").startswith("application/json"):  # asked with uncertainty
            body = response.json()
            png, uncertainty = base64.b64decode(body["image"]), _uncertainty(body["uncertainty"])
        with Image.open(io.BytesIO(png)) as im:
            image = np.array(im)
        return Result(
            task=task.name,
            image=image,
            png=png,
            model=headers["x-kdeq-model"],
            iterations=int(headers["x-kdeq-iterations"]),
            residual=float(headers["x-kdeq-residual"]),
            converged=headers["x-kdeq-converged"] == "true",
            lam=float(headers["x-kdeq-lambda"]),
            fields={f.name: float(headers[f.header]) if f.header in headers else None for f in task.fields},
            batch_size=int(headers["x-kdeq-batch-size"]),
            timings=_timings(headers.get("server-timing", "")),
            request_id=rid,
            uncertainty=uncertainty,
        )
    except (KeyError, TypeError, ValueError, OSError) as err:  # PIL's UnidentifiedImageError is an OSError
        detail = f"the answer to POST {task.route} is not a kdeq result: {err!r}"
        raise ServerError("bad_response", detail, response.status_code, rid) from None


def _uncertainty(body: Mapping[str, Any]) -> UncertaintyMap:
    """The ``uncertainty`` object of a JSON answer as an ``UncertaintyMap`` (its PNG times its scale)."""
    std = scaledpng.decode(base64.b64decode(body["png"]), float(body["scale"])).astype(np.float32)
    return UncertaintyMap(std, bool(body["exact"]), int(body["probes"]), body["error"])


# --------------------------------------------------------------------------------------------- requests


def _array_image(arr: np.ndarray, name: str) -> Image.Image:
    """The PIL image of ``arr``: ``(H, W)`` or ``(H, W, c)`` with ``c`` 1 (grey), 2 (grey and alpha), 3
    (RGB) or 4 (RGBA); uint8 as it is, uint16 (grey only) as 16 bits, bool as 0 / 255 (a mask: True
    where missing), floats in [0, 1] as ``round(255·clip(x, 0, 1))``."""
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[..., 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (2, 3, 4)):
        raise ValueError(
            f"`{name}`: an image array is (H, W) or (H, W, c) with c from 1 to 4, not {arr.shape}"
        )
    if arr.dtype == np.uint16:
        if arr.ndim != 2:
            raise ValueError(f"`{name}`: a uint16 array is grey, (H, W); colour images are 8-bit")
        return Image.fromarray(arr)
    if arr.dtype == np.bool_:
        arr = arr.astype(np.uint8) * 255
    elif arr.dtype.kind == "f":
        if not np.isfinite(arr).all():
            raise ValueError(f"`{name}` has values that are not finite")
        arr = np.rint(np.clip(arr, 0.0, 1.0) * 255.0).astype(np.uint8)
    elif arr.dtype != np.uint8:
        raise ValueError(f"`{name}`: a uint8, uint16, bool or float array, not {arr.dtype}")
    return Image.fromarray(np.ascontiguousarray(arr))


def _upload(value: ImageInput, name: str) -> tuple[str, bytes, str]:
    """``(file name, bytes, media type)`` of the image input ``name``: a path's file and an encoded
    file's bytes as they are, a numpy array or PIL image as a PNG (``_array_image``)."""
    if isinstance(value, bytes):
        return name, value, "application/octet-stream"
    if isinstance(value, str | os.PathLike):
        path = Path(value)
        return path.name, path.read_bytes(), mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    if isinstance(value, np.ndarray):
        im = _array_image(value, name)
    elif isinstance(value, Image.Image):
        im = value
    else:
        raise TypeError(f"`{name}`: a numpy array, PIL image, path or bytes, not {type(value).__name__}")
    if im.mode not in PNG_MODES:
        raise ValueError(
            f"`{name}`: Pillow writes no {im.mode} image as a PNG; convert it to L, I;16, RGB or RGBA"
        )
    out = io.BytesIO()
    # the fastest level: the PNG only carries the pixels to the service, which decodes it at once
    im.save(out, format="PNG", compress_level=1)
    return f"{name}.png", out.getvalue(), "image/png"


@dataclass(frozen=True)
class _Request:
    """One HTTP request, ready to send (and to send again, as it is, after a 503): a task's multipart
    form (``data`` and ``files``) or a model-control request's JSON body (``json``)."""

    method: str
    path: str
    headers: dict[str, str]
    request_id: str
    data: dict[str, str] | None = None
    files: dict[str, tuple[str, bytes, str]] | None = None
    json: dict | None = None

    def send_with(self, http: httpx.Client | httpx.AsyncClient) -> Any:
        """``http``'s request (an awaitable for an ``AsyncClient``)."""
        return http.request(
            self.method, self.path, data=self.data, files=self.files, json=self.json, headers=self.headers
        )


def _request_id(given: str | None) -> str:
    """``given``, checked to be an ID the service keeps (``ValueError`` otherwise), or a new random one
    in the service's own form (32 hex digits), so that even an unanswered call can be named."""
    if given is None:
        return uuid.uuid4().hex
    if not isinstance(given, str) or not REQUEST_ID.fullmatch(given):
        raise ValueError(f"request_id {given!r} is not 1 to 128 printable ASCII characters without spaces")
    return given


def _task_request(
    task: Task,
    image: ImageInput,
    inputs: Mapping[str, Any],
    model: str | None,
    max_iter: int | None,
    tol: float | None,
    request_id: str | None,
    uncertainty: bool = False,
) -> _Request:
    """The multipart form of a request to ``task``: ``image``, the task's options and file inputs in
    ``inputs`` that are not ``None`` (``TypeError`` naming the task's own for any other name), the
    model and solver limits, ``uncertainty`` (sent, with ``Accept: application/json``, when true: the
    map comes in JSON only), and the ``X-Request-ID`` (``_request_id``)."""
    rid = _request_id(request_id)
    options = list(task.options.model_fields)
    files = [f.name for f in task.files]
    unknown = sorted(set(inputs) - set(options) - set(files))
    if unknown:
        raise TypeError(
            f"{task.name} takes no {unknown}; its options are {options} and its file inputs {files}"
        )
    data = {k: str(v) for k, v in inputs.items() if k in options and v is not None}
    common = {"model": model, "max_iter": max_iter, "tol": tol}
    data.update({k: str(v) for k, v in common.items() if v is not None})
    uploads = {"image": _upload(image, "image")}
    uploads.update({k: _upload(v, k) for k, v in inputs.items() if k in files and v is not None})
    headers = {"X-Request-ID": rid}
    if uncertainty:
        data["uncertainty"] = "true"
        headers["Accept"] = "application/json"
    return _Request("POST", task.route, headers, rid, data=data, files=uploads)


@dataclass(frozen=True)
class ModelState:
    """A model as ``GET /models/{name}`` describes it.

    Attributes:
        name: the model's name.
        serving: ``NAME:VERSION`` answering its requests, ``None`` when none is.
        version: the configured version (``None`` when none is configured).
        ready: whether it answers requests.
        error: why the configured version is not ready, else ``None``.
        devices: the devices it is loaded on.
        load_seconds: how long its load and warm-up took.
        versions: the versions the service's model repository holds.
    """

    name: str
    serving: str | None
    version: int | None
    ready: bool
    error: str | None
    devices: tuple[str, ...]
    load_seconds: float | None
    versions: tuple[int, ...]


def _model_state(body: Any) -> ModelState:
    return ModelState(
        name=body["name"],
        serving=body["serving"],
        version=body["version"],
        ready=body["ready"],
        error=body["error"],
        devices=tuple(body["devices"]),
        load_seconds=body["load_seconds"],
        versions=tuple(body["versions"]),
    )


def _control_request(name: str, action: str | None, version: int | None) -> _Request:
    """The model-control request ``action`` (``load``, ``unload``, or ``None`` for the model's state) on
    model ``name``, answered in JSON, with a new request ID; ``ValueError`` for a name the service could
    never hold."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,63}", name):
        raise ValueError(f"{name!r} is not a model name")
    rid = _request_id(None)
    headers = {"Accept": "application/json", "X-Request-ID": rid}
    if action is None:
        return _Request("GET", f"/models/{name}", headers, rid)
    body = None if version is None else {"version": version}
    return _Request("POST", f"/models/{name}/{action}", headers, rid, json=body)


# ------------------------------------------------------------------------------------------------ core
# What a call does, without I/O: a generator that yields the steps a client performs, and is sent each
# step's outcome: ``_Request`` (sent: the ``httpx.Response``), ``_Sleep`` (slept: ``None``) and
# ``_Work`` (encoding or decoding images, run: its value). Its return value is the call's.


@dataclass(frozen=True)
class _Sleep:
    """Wait ``seconds`` before sending again (a 503's ``Retry-After``)."""

    seconds: float


@dataclass(frozen=True)
class _Work:
    """``function(*args)``: reading, encoding or decoding images, which the async client runs in a
    worker thread, off its event loop."""

    function: Callable[..., Any]
    args: tuple


_Step = _Request | _Sleep | _Work
_Steps = Generator[_Step, Any, T]


def _exchange(
    request: _Request, retry_budget: float, clock: Callable[[], float] = time.monotonic
) -> _Steps[httpx.Response]:
    """``request`` sent, and sent again as it is after each 503 whose wait (``_delay``) ends within
    ``retry_budget`` seconds of ``clock`` from the first attempt; the last answer."""
    deadline = clock() + retry_budget
    while True:
        response = yield request
        delay = _delay(response, clock(), deadline)
        if delay is None:
            return response
        yield _Sleep(delay)


def _run_steps(
    task: str,
    image: ImageInput,
    inputs: Mapping[str, Any],
    model: str | None,
    max_iter: int | None,
    tol: float | None,
    request_id: str | None,
    uncertainty: bool,
    retry_budget: float,
    clock: Callable[[], float] = time.monotonic,
) -> _Steps[Result]:
    """``run``: the task's request built (``_task_request``), exchanged (``_exchange``), and its answer
    read as a ``Result`` (``_result``), or raised as a ``KdeqError`` (``_error``)."""
    chosen = get_task(task)
    request = yield _Work(
        _task_request, (chosen, image, inputs, model, max_iter, tol, request_id, uncertainty)
    )
    response = yield from _exchange(request, retry_budget, clock)
    if response.status_code != 200:
        raise _error(response, request.request_id)
    return (yield _Work(_result, (chosen, response, request.request_id)))


def _control_steps(
    name: str,
    action: str | None,
    version: int | None,
    retry_budget: float,
    clock: Callable[[], float] = time.monotonic,
) -> _Steps[ModelState]:
    """``model``, ``load_model`` and ``unload_model``: the request (``_control_request``) exchanged, and its
    answer read as a ``ModelState``, or raised as a ``KdeqError``."""
    request = _control_request(name, action, version)
    response = yield from _exchange(request, retry_budget, clock)
    if response.status_code != 200:
        raise _error(response, request.request_id)
    return _model_state(response.json())


# ---------------------------------------------------------------------------------------------- clients


class _Base:
    """What both clients hold: the service's URL, the headers every request sends, the timeout and the
    retry budget."""

    def __init__(self, url: str, api_key: str | None, timeout: float, retry_budget: float) -> None:
        if timeout <= 0 or retry_budget < 0:
            raise ValueError("timeout must be positive and retry_budget at least 0")
        self.url, self.timeout, self.retry_budget = url.rstrip("/"), timeout, retry_budget
        self._httpx = _httpx()
        self._headers = {"Accept": "image/png", "User-Agent": "kdeq-client"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def _no_answer(self, err: Exception, request: _Request) -> KdeqError:
        """The exception for ``request`` getting no answer (``err`` from httpx2)."""
        if isinstance(err, self._httpx.TimeoutException):
            return RequestTimeoutError(
                "client_timeout", f"no answer within {self.timeout:g} s ({err!r})", None, request.request_id
            )
        return ConnectionFailedError(
            "connection_failed", f"{type(err).__name__}: {err}", None, request.request_id
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"  # never the key


class Client(_Base):
    """A blocking client of the kdeq service at ``url`` (e.g. ``http://127.0.0.1:8000``), with one method
    per task (module docstring). ``api_key`` is sent as ``Authorization: Bearer``; ``timeout`` bounds
    each of connecting, reading and writing, in seconds; a 503 is sent again after its ``Retry-After``
    where that wait ends within ``retry_budget`` seconds of the call's first attempt (0: never), waiting
    with ``sleep``. A context manager; ``close`` ends its connections."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry_budget: float = DEFAULT_RETRY_BUDGET,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        super().__init__(url, api_key, timeout, retry_budget)
        self._sleep = sleep
        self._http = self._httpx.Client(base_url=self.url, headers=self._headers, timeout=timeout)

    def run(
        self,
        task: str,
        image: ImageInput,
        *,
        model: str | None = None,
        max_iter: int | None = None,
        tol: float | None = None,
        request_id: str | None = None,
        uncertainty: bool = False,
        **inputs: Any,
    ) -> Result:
        """``task``'s ``Result`` for ``image`` with the task's options and file inputs ``inputs``; ``model``
        (``NAME`` or ``NAME:VERSION``, default the service's for the task), solver limits ``max_iter`` and
        ``tol``, ``uncertainty`` to have the output's posterior standard deviation too
        (``Result.uncertainty``; the models with a posterior map), and ``request_id`` sent as
        ``X-Request-ID`` (default a random one). ``KdeqError`` when refused."""
        args = (model, max_iter, tol, request_id, uncertainty, self.retry_budget)
        return self._drive(_run_steps(task, image, inputs, *args))

    def model(self, name: str) -> ModelState:
        """Model ``name``'s state: the version serving, its devices, the versions on the service."""
        return self._drive(_control_steps(name, None, None, self.retry_budget))

    def load_model(self, name: str, version: int | None = None) -> ModelState:
        """Load ``name`` at ``version`` (default the highest the service holds), warm it and swap it in
        (the service needs ``KDEQ_MODEL_CONTROL=true``); its state after. ``KdeqError`` when refused:
        ``load_failed`` (422) leaves the version serving untouched."""
        return self._drive(_control_steps(name, "load", version, self.retry_budget))

    def unload_model(self, name: str) -> ModelState:
        """Stop serving ``name`` (requests already admitted finish); its state after."""
        return self._drive(_control_steps(name, "unload", None, self.retry_budget))

    def _drive(self, steps: _Steps[T]) -> T:
        """The core's ``steps`` performed here and now, in this thread; their return value."""
        outcome = None
        while True:
            try:
                step = steps.send(outcome)
            except StopIteration as done:
                return done.value
            if isinstance(step, _Work):
                outcome = step.function(*step.args)
            elif isinstance(step, _Sleep):
                outcome = self._sleep(step.seconds)
            else:
                outcome = self._send(step)

    def _send(self, request: _Request) -> httpx.Response:
        try:
            return request.send_with(self._http)
        except self._httpx.TransportError as err:
            raise self._no_answer(err, request) from err

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """``Client`` for asyncio: the same arguments and methods, as coroutines (``sleep`` too is awaited);
    an async context manager, ``aclose`` ends its connections. Requests from concurrent tasks share its
    connection pool; reading, encoding and decoding images run in a worker thread, off the event loop."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry_budget: float = DEFAULT_RETRY_BUDGET,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        super().__init__(url, api_key, timeout, retry_budget)
        self._sleep = sleep
        self._http = self._httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=timeout)

    async def run(
        self,
        task: str,
        image: ImageInput,
        *,
        model: str | None = None,
        max_iter: int | None = None,
        tol: float | None = None,
        request_id: str | None = None,
        uncertainty: bool = False,
        **inputs: Any,
    ) -> Result:
        """``Client.run``, awaited."""
        args = (model, max_iter, tol, request_id, uncertainty, self.retry_budget)
        return await self._drive(_run_steps(task, image, inputs, *args))

    async def model(self, name: str) -> ModelState:
        """``Client.model``, awaited."""
        return await self._drive(_control_steps(name, None, None, self.retry_budget))

    async def load_model(self, name: str, version: int | None = None) -> ModelState:
        """``Client.load_model``, awaited."""
        return await self._drive(_control_steps(name, "load", version, self.retry_budget))

    async def unload_model(self, name: str) -> ModelState:
        """``Client.unload_model``, awaited."""
        return await self._drive(_control_steps(name, "unload", None, self.retry_budget))

    async def _drive(self, steps: _Steps[T]) -> T:
        """The core's ``steps`` performed on the event loop, ``_Work`` in a worker thread; their return
        value."""
        outcome = None
        while True:
            try:
                step = steps.send(outcome)
            except StopIteration as done:
                return done.value
            if isinstance(step, _Work):
                outcome = await asyncio.to_thread(step.function, *step.args)
            elif isinstance(step, _Sleep):
                outcome = await self._sleep(step.seconds)
            else:
                outcome = await self._send(step)

    async def _send(self, request: _Request) -> httpx.Response:
        try:
            return await request.send_with(self._http)
        except self._httpx.TransportError as err:
            raise self._no_answer(err, request) from err

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# ------------------------------------------------------------------------------- one method per task


def method_name(task: Task) -> str:
    """The client method of ``task``: its name with ``-`` written ``_``."""
    return task.name.replace("-", "_")


def _signature(task: Task) -> inspect.Signature:
    """``(self, image, *, <options>, <file inputs>, model, max_iter, tol, request_id, uncertainty)``:
    what ``help()`` shows for ``task``'s method (``run`` checks the names)."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("image", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="ImageInput"),
    ]
    # None: not sent, and the service applies the option's default (or refuses a required one, 422)
    params += [
        inspect.Parameter(name, keyword, default=None, annotation=info.annotation | None)
        for name, info in task.options.model_fields.items()
    ]
    params += [
        inspect.Parameter(f.name, keyword, default=None, annotation="ImageInput | None") for f in task.files
    ]
    common = {
        "model": "str | None",
        "max_iter": "int | None",
        "tol": "float | None",
        "request_id": "str | None",
    }
    params += [inspect.Parameter(n, keyword, default=None, annotation=a) for n, a in common.items()]
    params.append(inspect.Parameter("uncertainty", keyword, default=False, annotation="bool"))
    return inspect.Signature(params, return_annotation="Result")


def _docstring(task: Task) -> str:
    """The method's help: what the task does, and its options and file inputs with their descriptions."""
    lines = [
        f"{task.summary}: ``POST {task.route}`` → ``Result``.",
        "",
        " ".join((task.__doc__ or "").split()),
    ]
    lines += ["", "Options (sent only when given; the service's defaults otherwise):"]
    lines += [f"    {n}: {info.description}" for n, info in task.options.model_fields.items()]
    lines += [f"    {f.name}: an image input: {f.description}" for f in task.files]
    lines += ["    model, max_iter, tol, request_id, uncertainty: as for ``run``."]
    return "\n".join(lines)


def _method(task: Task, asynchronous: bool) -> Any:
    """``task``'s method of ``Client`` (or, ``asynchronous``, of ``AsyncClient``): ``run`` by its name."""
    if asynchronous:

        async def method(self: AsyncClient, image: ImageInput, **kwargs: Any) -> Result:
            return await self.run(task.name, image, **kwargs)

    else:

        def method(self: Client, image: ImageInput, **kwargs: Any) -> Result:
            return self.run(task.name, image, **kwargs)

    name = method_name(task)
    method.__name__ = name
    method.__qualname__ = f"{'AsyncClient' if asynchronous else 'Client'}.{name}"
    method.__signature__ = _signature(task)
    method.__doc__ = _docstring(task)
    return method


for _task in TASKS.values():
    for _cls in (Client, AsyncClient):
        if hasattr(_cls, method_name(_task)):
            raise RuntimeError(f"the task {_task.name!r} would replace {_cls.__name__}.{method_name(_task)}")
        setattr(_cls, method_name(_task), _method(_task, _cls is AsyncClient))
