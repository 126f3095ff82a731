"""What the HTTP service answers, in its own words, for every request shape a client may send, and
what one request's statistics read in its headers, its JSON body and the metrics (in process,
FastAPI's TestClient, the real default models)."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kdeq.registry import TASKS
from service.app import create_app
from service.metrics import Metrics, task_routes
from service.routes import STATIC
from service.settings import Settings
from tests.service_helpers import MODELS, assert_error, encode, missing_tool, smooth_image, to_uint8

# what pydantic and FastAPI write, which a client of this service should never have to read
FOREIGN = ("Input should", "Field required", "UploadFile", "<class", "Value error", "Missing boundary")


@pytest.fixture(scope="module")
def client():
    settings = Settings(models_dir=MODELS, device=("cpu",))
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        assert c.app.state.service.wait_loaded(120)
        yield c


@pytest.fixture(scope="module")
def png() -> bytes:
    return encode(to_uint8(smooth_image(32, 40)))


def assert_own_words(body: dict) -> str:
    detail = body["detail"]
    assert "\n" not in detail and not any(marker in detail for marker in FOREIGN), detail
    return detail


# --- the request's shape -----------------------------------------------------------------------

SHAPES = {
    "raw image body": lambda png: {"content": png, "headers": {"Content-Type": "image/png"}},
    "url-encoded form": lambda png: {"data": {"image": "photo.png", "sigma": "3"}},
    "empty url-encoded form": lambda png: {
        "content": b"",
        "headers": {"Content-Type": "application/x-www-form-urlencoded"},
    },
    "JSON": lambda png: {"json": {"image": "aGVsbG8="}},
    "text": lambda png: {"content": b"hello", "headers": {"Content-Type": "text/plain"}},
    "no Content-Type": lambda png: {"content": png},
    "no body at all": lambda png: {},
    "multipart without its boundary": lambda png: {
        "content": png,
        "headers": {"Content-Type": "multipart/form-data"},
    },
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_body_that_is_no_multipart_form_is_a_415_showing_the_curl_form(client, png, shape) -> None:
    body = assert_error(client.post("/denoise", **SHAPES[shape](png)), 415, "multipart_expected")
    detail = assert_own_words(body)
    assert "multipart/form-data" in detail and "curl -F image=@" in detail and "/denoise" in detail


@pytest.mark.parametrize("route", sorted({t.route for t in TASKS.values()}))
def test_every_inference_route_names_its_form_and_its_own_url(client, png, route) -> None:
    body = assert_error(client.post(route, **SHAPES["raw image body"](png)), 415, "multipart_expected")
    assert f"curl -F image=@photo.png http://testserver{route}" in assert_own_words(body)


def test_a_multipart_form_with_a_boundary_is_not_refused_for_its_content_type(client, png) -> None:
    # the boundary's parameter in any case and with quotes: a parser's business, not a refusal
    head = b'--XyZ\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'
    content = head + png + b"\r\n--XyZ--\r\n"
    for kind in ('multipart/form-data; BOUNDARY="XyZ"', "Multipart/Form-Data;boundary=XyZ"):
        r = client.post("/denoise", content=content, headers={"Content-Type": kind})
        assert r.status_code == 200, (kind, r.text)


# every route's file fields: `image`, and each task's own (an inpainting `mask`, a deblurring `psf_image`)
FILE_FIELDS = sorted(
    {(t.route, "image") for t in TASKS.values()}
    | {(t.route, s.name) for t in TASKS.values() for s in t.files}
)


@pytest.mark.parametrize(("route", "field"), FILE_FIELDS)
def test_a_text_value_for_a_file_field_names_the_field(client, png, route, field) -> None:
    files = [("image", ("a.png", png, "image/png"))] if field != "image" else []
    files.append((field, (None, "photo.png")))  # a form field without a file name: text
    body = assert_error(client.post(route, files=files), 400, "bad_request")
    detail = assert_own_words(body)
    assert f"`{field}` must be a file upload" in detail and f"-F {field}=@" in detail


def test_a_multipart_form_without_the_image_says_which_field_is_missing(client) -> None:
    body = assert_error(client.post("/denoise", files=[("sigma", (None, "3"))]), 400, "bad_request")
    assert "no `image` file in the form" in assert_own_words(body)


@pytest.mark.parametrize(
    ("route", "data", "status", "words"),
    [
        ("/denoise", {"sigma": "loud"}, 400, "`sigma` must be a number, got 'loud'"),
        ("/denoise", {"max_iter": "1.5"}, 400, "`max_iter` must be a whole number"),
        ("/denoise", {"history": "maybe"}, 400, "`history` must be true or false"),
        ("/denoise", {"noise": "laser"}, 422, "`noise` must be 'gaussian', 'poisson' or 'impulse'"),
        ("/denoise", {"tol": "2"}, 422, "`tol` must be < 1"),
        ("/denoise", {"sigma": "nan"}, 422, "`sigma` must be a finite number"),
        ("/denoise", {"model": "m" * 101}, 422, "`model` must be at most 100 characters"),
        ("/segment", {"threshold": "2"}, 422, "`threshold` must be ≤ 1"),
        ("/super-resolve", {"scale": "7"}, 422, "`scale` must be 2, 3 or 4, got 7"),  # the options model
    ],
)
def test_a_value_the_form_cannot_take_is_named_with_what_it_must_be(
    client, png, route, data, status, words
) -> None:
    body = assert_error(client.post(route, files={"image": png}, data=data), status)
    assert words in assert_own_words(body)


def test_the_model_routes_json_body_errors_are_in_the_services_words() -> None:
    # model control on, so that a valid body would reach the load: the errors are the body's own
    settings = Settings(models_dir=MODELS, device=("cpu",), model_control=True, warmup=False)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        route = "/models/denoise-kglm/load"
        cases = [
            ({"content": b"{oops", "headers": {"Content-Type": "application/json"}}, 400, "not valid JSON"),
            ({"json": [1]}, 400, "must be a JSON object"),
            ({"json": {"versio": 1}}, 422, "unknown field `versio`"),
            ({"json": {"version": 0}}, 422, "`version` must be ≥ 1"),
        ]
        for kwargs, status, words in cases:
            assert words in assert_own_words(assert_error(c.post(route, **kwargs), status))


# --- one request, one endpoint label -------------------------------------------------------------


def samples(text: str) -> list[tuple[str, dict, float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def grown(before: str, after: str) -> dict[tuple[str, tuple], float]:
    """The samples that changed between two scrapes: ``{(name, sorted labels): increase}``."""
    old = {(n, tuple(sorted(labels.items()))): v for n, labels, v in samples(before)}
    out = {}
    for name, labels, value in samples(after):
        key = (name, tuple(sorted(labels.items())))
        if value != old.get(key, 0.0):
            out[key] = value - old.get(key, 0.0)
    return out


def test_a_variant_asked_on_its_hosts_route_is_that_route_in_every_family(client, png) -> None:
    before = client.get("/metrics").text
    r = client.post("/denoise", files={"image": png}, data={"noise": "poisson", "peak": "30"})
    after = client.get("/metrics").text
    assert r.status_code == 200, r.text
    model = r.headers["x-kdeq-model"]
    assert model.startswith("denoise-poisson")
    endpoints = {dict(labels).get("endpoint") for _, labels in grown(before, after)}
    assert endpoints - {None, "/metrics"} == {"/denoise"}  # the first scrape counts in the second
    changed = {name for name, _ in grown(before, after)}
    for family in (
        "kdeq_http_requests_total",
        "kdeq_solver_iterations_count",
        "kdeq_queue_wait_seconds_count",
    ):
        assert family in changed, family
    key = ("kdeq_solver_iterations_count", tuple(sorted({"endpoint": "/denoise", "model": model}.items())))
    assert grown(before, after)[key] == 1


def test_a_models_zero_series_cover_every_route_its_task_is_asked_on() -> None:
    metrics = Metrics([100], ["cpu"])
    metrics.start_solver_series("denoise-poisson", "denoise-poisson-kglm:3")
    assert set(task_routes("denoise-poisson")) == {"/denoise-poisson", "/denoise"}
    assert task_routes("denoise") == ("/denoise",)
    series = {
        labels["endpoint"]
        for name, labels, value in samples(metrics.render().decode())
        if name == "kdeq_solver_nonconverged_total" and value == 0
    }
    assert series == set(task_routes("denoise-poisson"))


# --- iterations, residual and converged mean the same everywhere -----------------------------------

# a tolerance no solve meets in two steps, so that both values of `converged` are exercised
STRICT = {"tol": "1e-9", "max_iter": "2"}


def _request(client, task: str, extra: dict) -> tuple:
    route = TASKS[task].route
    image = client.get(f"/samples/{task}").content
    data = {"psf": "gaussian:1.6", **extra} if task == "deblur" else extra  # the sample's blur
    before = client.get("/metrics").text
    r = client.post(route, files={"image": image}, data=data, headers={"Accept": "application/json"})
    after = client.get("/metrics").text
    assert r.status_code == 200, (task, r.text)
    return r, before, after


@pytest.mark.parametrize("extra", [{}, STRICT], ids=["model's solver", "strict tolerance"])
@pytest.mark.parametrize("task", sorted(TASKS))
def test_the_headers_the_json_body_and_the_metrics_report_one_solve_alike(client, task, extra) -> None:
    r, before, after = _request(client, task, extra)
    solver = r.json()["solver"]
    labels = tuple(sorted({"endpoint": TASKS[task].route, "model": r.headers["x-kdeq-model"]}.items()))
    changed = grown(before, after)
    iterations = int(r.headers["x-kdeq-iterations"])
    assert iterations == solver["iterations"] >= 0
    assert changed.get(("kdeq_solver_iterations_count", labels)) == 1
    assert changed.get(("kdeq_solver_iterations_sum", labels), 0.0) == iterations
    # the header has four significant digits: within half a unit of the fourth
    residual = solver["residual"]
    assert math.isclose(float(r.headers["x-kdeq-residual"]), residual, rel_tol=5e-4), (task, r.headers)
    # the histogram's sum grew by the residual, to the rounding of one addition to the running sum
    total = next(
        v
        for n, lab, v in samples(after)
        if n == "kdeq_solver_relative_residual_sum" and tuple(sorted(lab.items())) == labels
    )
    ulp = 2 * math.ulp(total)
    assert abs(changed[("kdeq_solver_relative_residual_sum", labels)] - residual) <= ulp
    converged = r.headers["x-kdeq-converged"] == "true"
    assert converged == solver["converged"]
    assert changed.get(("kdeq_solver_nonconverged_total", labels), 0.0) == (0 if converged else 1)


def _model_tolerance(client, model: str) -> float:
    return next(m["solver"]["tol"] for m in client.get("/models").json() if m["id"] == model)


@pytest.mark.parametrize(
    ("task", "extra"),
    [
        pytest.param(t, extra, id=f"{t}-{name}")
        for t in sorted(TASKS)
        for name, extra in (("model's solver", {}), ("strict tolerance", STRICT))
    ],
)
def test_converged_is_the_residual_within_the_tolerance_the_request_ran_with(client, task, extra) -> None:
    r, _, _ = _request(client, task, extra)
    solver = r.json()["solver"]
    tol = float(extra.get("tol", _model_tolerance(client, r.headers["x-kdeq-model"])))
    assert solver["converged"] == (solver["residual"] <= tol), (task, solver, tol)
    if "max_iter" in extra and not solver["converged"]:
        # the budget is each solve's: a plug-and-play deblur runs a data step and a prior solve per step
        model = r.headers["x-kdeq-model"].partition(":")
        config = json.loads((MODELS / model[0] / model[2] / "config.json").read_text())
        solves = 2 * config["architecture"]["steps"] if config["architecture"]["kind"] == "pnp" else 1
        assert solver["iterations"] <= solves * int(extra["max_iter"]), (task, solver)


# --- the page's numbers --------------------------------------------------------------------------


def format_bytes(values: list[int]) -> list[str]:
    """``formatBytes`` of the page (service/static/format.js) for each value, run by node."""
    node = shutil.which("node")
    if node is None:
        missing_tool("node is not installed (Debian package nodejs)")
    script = (
        f"const {{ formatBytes }} = require({json.dumps(str(STATIC / 'format.js'))});"
        f"console.log(JSON.stringify({json.dumps(values)}.map(formatBytes)));"
    )
    done = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)


def test_the_page_writes_small_files_in_bytes_and_larger_ones_rounded_in_kb_and_mb() -> None:
    assert format_bytes([0, 28, 999]) == ["0 B", "28 B", "999 B"]
    values = sorted({round(10 ** (3 + k / 50)) for k in range(0, 351)} | {9_949, 9_950, 999_499, 999_500})
    scale = {"kB": 1e3, "MB": 1e6, "GB": 1e9}
    for n, text in zip(values, format_bytes(values), strict=True):
        match = re.fullmatch(r"(\d+(?:\.\d)?) (kB|MB|GB)", text)
        assert match, (n, text)
        shown, unit = float(match[1]), match[2]
        # one decimal below 10, whole numbers from 10; never "1000 kB" where "1.0 MB" is meant
        assert ("." in match[1]) == (shown < 10) and 1 <= shown < 1000, (n, text)
        step = 0.1 if shown < 10 else 1
        assert abs(n / scale[unit] - shown) <= step / 2 + 1e-9, (n, text)
