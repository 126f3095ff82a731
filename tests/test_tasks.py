"""The task registry: every route, subcommand, admitted and key-protected set derives from ``TASKS``,
and every registered task answers through each of them."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from pydantic import ValidationError

from kdeq.cli import main as kdeq_main
from kdeq.models.checkpoint import ModelSpec
from kdeq.models.initialize import DEFAULT_SPECS
from kdeq.registry import TASKS, choice_of, register_task
from kdeq.tasks.base import Options, Task, Variant
from service.app import create_app
from service.metrics import INFERENCE_ROUTES
from service.middleware import PROTECTED_ROUTES
from service.settings import Settings
from tests.service_helpers import MODELS, encode, smooth_image, to_uint8

ROOT = Path(__file__).resolve().parents[1]

KEY = "s3cret"


def form_for(task: Task, h: int = 40, w: int = 48) -> dict[str, bytes]:
    """A valid upload for ``task``: a smooth grey image and each of its file inputs."""
    rng = np.random.default_rng(1)
    files = {"image": encode(to_uint8(smooth_image(h, w)))}
    for spec in task.files:
        if spec.kind == "mask":
            files[spec.name] = encode(((rng.random((h, w)) < 0.2) * 255).astype(np.uint8))
        else:  # a small blob: a valid kernel-like image
            r = np.arange(-2, 3)
            blob = np.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / 2.0)
            files[spec.name] = encode((blob / blob.max() * 255).astype(np.uint8))
    return files


@pytest.fixture(scope="module")
def client():
    settings = Settings(models_dir=MODELS, device=("cpu",), api_key=KEY, warmup=False)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        assert c.app.state.service.wait_loaded(120)
        yield c


def test_the_inference_routes_are_the_tasks_and_all_are_admitted_and_key_protected(client) -> None:
    paths = client.app.openapi()["paths"]
    posted = {path for path, ops in paths.items() if "post" in ops and not path.startswith("/models/")}
    assert posted == INFERENCE_ROUTES == {t.route for t in TASKS.values()}
    assert INFERENCE_ROUTES <= PROTECTED_ROUTES


@pytest.mark.parametrize("name", list(TASKS))
def test_each_task_route_needs_the_key_and_then_answers(client, name: str) -> None:
    task = TASKS[name]
    files = form_for(task)
    refused = client.post(task.route, files=files)
    assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
    if not any(s.task == name and s.ready for s in client.app.state.service.registry.slots.values()):
        pytest.skip(f"no {name} model in the repository")
    r = client.post(task.route, files=files, headers={"X-API-Key": KEY, "Accept": "application/json"})
    assert r.status_code == 200, r.text  # admitted: the admission middleware set its ticket
    body = r.json()
    for field in task.fields:
        assert body[field.name] is not None and field.header in r.headers
    image = Image.open(io.BytesIO(base64.b64decode(body["image"])))
    assert (body["width"], body["height"]) == image.size
    assert r.headers["X-KDEQ-Model"] == body["model"]


def test_tasks_endpoint_lists_every_task_with_its_options(client) -> None:
    assert client.get("/tasks").status_code == 401
    listed = {t["name"]: t for t in client.get("/tasks", headers={"X-API-Key": KEY}).json()}
    assert list(listed) == list(TASKS)
    for name, task in TASKS.items():
        assert listed[name]["route"] == task.route
        assert set(listed[name]["options"].get("properties", {})) == set(task.options.model_fields)
        assert [f["name"] for f in listed[name]["files"]] == [f.name for f in task.files]


def test_the_openapi_document_declares_each_tasks_fields(client) -> None:
    """Each route's form declares its task's options and file inputs and, on a host of variants
    (``choice_of``), the choosing field and the variants' options and file inputs too."""
    paths = client.get("/openapi.json").json()["paths"]
    for task in TASKS.values():
        form = paths[task.route]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
        ref = form["$ref"].rsplit("/", 1)[-1]
        props = client.get("/openapi.json").json()["components"]["schemas"][ref]["properties"]
        choice = choice_of(task)
        tasks = [task] if choice is None else list(choice.tasks.values())
        names = {
            "image",
            *([] if choice is None else [choice.field]),
            *(name for t in tasks for name in t.options.model_fields),
            *(f.name for t in tasks for f in t.files),
            "model",
            "max_iter",
            "tol",
            "history",
            "uncertainty",
        }
        assert set(props) == names


@pytest.mark.parametrize("name", list(TASKS))
def test_each_task_has_a_subcommand_with_its_options(name: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        kdeq_main([name, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for option in TASKS[name].options.model_fields:
        assert "--" + option.replace("_", "-") in text
    for spec in TASKS[name].files:
        assert "--" + spec.name.replace("_", "-") in text


@pytest.mark.parametrize("name", list(TASKS))
def test_options_refuse_unknown_keys(name: str) -> None:
    with pytest.raises(ValidationError):
        TASKS[name].options(no_such_option=1)


def test_a_spec_of_an_unregistered_task_is_refused() -> None:
    raw = DEFAULT_SPECS[1].model_dump() | {"task": "sharpen"}
    with pytest.raises(ValidationError, match="unknown task 'sharpen'"):
        ModelSpec.model_validate(raw)


def test_a_new_task_module_is_a_route_a_command_and_a_client_method_with_no_other_edit(tmp_path) -> None:
    """A task is one module in ``kdeq.tasks``: one more there (here from a folder added to the package's
    path, an image inverter on the denoiser's predictor) is registered beside the shipped tasks, and is
    a route with its options in the OpenAPI document, a subcommand and a client method."""
    (tmp_path / "invert.py").write_text(
        textwrap.dedent(
            """
            from pydantic import Field

            from kdeq.predictors.denoise import Denoiser
            from kdeq.tasks.base import Options, Task


            class InvertOptions(Options):
                gain: float = Field(1.0, gt=0, description="how far to invert")


            class Invert(Task):
                name = "invert"
                summary = "Invert an image"
                predictor = Denoiser
                options = InvertOptions
            """
        )
    )
    script = textwrap.dedent(
        f"""
        import contextlib, io, json
        import kdeq.tasks
        kdeq.tasks.__path__.append({str(tmp_path)!r})
        from kdeq.registry import TASKS
        from kdeq.cli import main
        from kdeq.client import Client
        from service.app import create_app
        from service.settings import Settings
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(["invert", "--help"])
        app = create_app(Settings(models_dir={str(MODELS)!r}, device=("cpu",), warmup=False))
        schemas = app.openapi()["components"]["schemas"]
        form = schemas["Body_invert_invert_post"]["properties"]
        print(json.dumps([list(TASKS), hasattr(Client, "invert"), "--gain" in out.getvalue(), form]))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    names, method, option, form = json.loads(done.stdout.splitlines()[-1])
    # after the shipped tasks without a variant, before the variants
    assert [n for n in names if n != "invert"] == list(TASKS) and "invert" in names
    assert all(TASKS[n].variant is None for n in names[: names.index("invert")])
    assert method and option
    assert {"image", "gain", "model"} <= set(form)


def test_a_task_name_registers_once() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        register_task(type("Again", (Task,), {"name": "denoise"}))


@pytest.mark.parametrize(
    ("variant", "why"),
    [
        (Variant("sharpen", "noise", "speckle", "gaussian", ""), "not a registered task"),
        (Variant("denoise-poisson", "noise", "speckle", "gaussian", ""), "not a registered task without"),
        (Variant("denoise", "noise", "poisson", "gaussian", ""), "taken"),
        (Variant("denoise", "noise", "gaussian", "gaussian", ""), "taken"),
        (Variant("denoise", "model", "speckle", "gaussian", ""), "chosen by noise='gaussian' already"),
        (Variant("denoise", "noise", "speckle", "none", ""), "chosen by noise='gaussian' already"),
    ],
)
def test_a_variant_that_its_host_route_could_not_take_is_refused(variant: Variant, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        register_task(type("Speckle", (Task,), {"name": "denoise-speckle", "variant": variant}))
    assert "denoise-speckle" not in TASKS


class ClashingOptions(Options):
    sigma: float = 3.0  # the host's option name, read differently


def test_a_variant_whose_fields_would_mean_two_things_is_refused() -> None:
    """An option named like the host's (``sigma``) but read differently cannot share the host's route;
    the same field can (the impulse denoiser shares ``denoise``'s ``sigma``)."""
    assert choice_of(TASKS["denoise"]).pick("impulse").options is TASKS["denoise"].options
    clash = ClashingOptions
    variant = Variant("denoise", "noise", "speckle", "gaussian", "")
    with pytest.raises(ValueError, match=r"the fields \['sigma'\] of /denoise"):
        register_task(
            type("Speckle", (Task,), {"name": "denoise-speckle", "variant": variant, "options": clash})
        )
    assert "denoise-speckle" not in TASKS


def test_a_variant_answers_on_its_hosts_route_as_on_its_own(client) -> None:
    """``POST /denoise`` with ``noise=poisson`` is answered by the photon-count denoiser exactly as
    ``POST /denoise-poisson``; another task's field, or an unknown value, is refused before any solve."""
    key = {"X-API-Key": KEY}
    counts = np.random.default_rng(2).poisson(8.0 * smooth_image(40, 48)).astype(np.uint8)
    files = {"image": encode(counts)}
    own = client.post("/denoise-poisson", files=files, data={"peak": "8"}, headers=key)
    via = client.post("/denoise", files=files, data={"noise": "poisson", "peak": "8"}, headers=key)
    assert own.status_code == via.status_code == 200, via.text
    assert via.content == own.content
    assert via.headers["X-KDEQ-Model"].startswith("denoise-poisson-kglm:")
    assert via.headers["X-KDEQ-Peak"] == own.headers["X-KDEQ-Peak"]
    hit = np.random.default_rng(4).random((40, 48)) < 0.1
    salt = encode(np.where(hit, 255, to_uint8(smooth_image(40, 48))).astype(np.uint8))
    own = client.post("/denoise-impulse", files={"image": salt}, data={"sigma": "5"}, headers=key)
    via = client.post("/denoise", files={"image": salt}, data={"noise": "impulse", "sigma": "5"}, headers=key)
    assert own.status_code == via.status_code == 200 and via.content == own.content, via.text
    assert via.headers["X-KDEQ-Model"].startswith("denoise-impulse-kglm:")
    gaussian = client.post("/denoise", files=files, data={"noise": "gaussian", "sigma": "20"}, headers=key)
    assert gaussian.status_code == 200 and gaussian.headers["X-KDEQ-Model"].startswith("denoise-kglm:")
    for data in ({"peak": "8"}, {"noise": "poisson", "sigma": "20"}):
        r = client.post("/denoise", files=files, data=data, headers=key)
        assert r.status_code == 422 and r.json()["error"] == "misplaced_option", r.text
    assert client.post("/denoise", files=files, data={"noise": "speckle"}, headers=key).status_code == 422
    listed = {t["name"]: t for t in client.get("/tasks", headers=key).json()}
    assert listed["denoise-poisson"]["also"] == {"route": "/denoise", "field": "noise", "value": "poisson"}
    assert listed["denoise"]["also"] is None


def test_a_variant_answers_on_its_hosts_command_as_on_its_own(tmp_path, capsys) -> None:
    """``kdeq denoise IN -o OUT --noise poisson --peak P`` writes what ``kdeq denoise-poisson`` writes;
    another task's option is an error (exit 2) naming it."""
    source = tmp_path / "counts.png"
    Image.fromarray(np.random.default_rng(3).poisson(8.0 * smooth_image(40, 48)).astype(np.uint8)).save(
        source
    )
    own, via = tmp_path / "own.png", tmp_path / "via.png"
    assert kdeq_main(["denoise-poisson", str(source), "-o", str(own), "--peak", "8"]) == 0
    assert kdeq_main(["denoise", str(source), "-o", str(via), "--noise", "poisson", "--peak", "8"]) == 0
    assert via.read_bytes() == own.read_bytes()
    capsys.readouterr()
    assert kdeq_main(["denoise", str(source), "-o", str(via), "--peak", "8"]) == 2
    assert "--peak: not for --noise gaussian" in capsys.readouterr().err
    argv = ["denoise", str(source), "-o", str(via), "--noise", "poisson", "--sigma", "9"]
    assert kdeq_main(argv) == 2
    assert "--sigma: not for --noise poisson" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(TASKS))
def test_each_task_has_a_default_model_and_warm_up_request(name: str) -> None:
    task = TASKS[name]
    assert any(s.task == name for s in DEFAULT_SPECS), f"no default checkpoint for {name}"
    request = task.warmup(24)
    # the warm-up size is the solve's (the output's: a super-resolver's input is smaller)
    assert task.output_size(request) == (24, 24) and isinstance(request.options, task.options)
