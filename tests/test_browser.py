"""The web page in a real browser: Playwright drives Debian's Chromium, headless, against a real server
process. The page builds its task list and option controls from ``GET /tasks``; each task is run on a
real image through them, and the result, its statistics and a screenshot are checked."""

from __future__ import annotations

import base64
import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
import torch
from PIL import Image

from kdeq.maths.operators import Blur
from kdeq.maths.psf import gaussian_psf, parse_psf
from tests.service_helpers import encode, missing_tool, noisy, run_server, smooth_image, to_uint8

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
# a closed network: no background requests, no sync, no component updates
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


@pytest.fixture(scope="module")
def browser() -> Iterator:
    try:
        from playwright import sync_api as playwright
    except ImportError:
        missing_tool("playwright is not installed (pip install -e '.[dev]')")
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        missing_tool(f"no Chromium at {CHROMIUM} (Debian package chromium; .ci/run installs it)")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("page")) as s:
        yield s


@pytest.fixture(scope="module")
def tasks(server) -> list[dict]:
    """``GET /tasks``: what the page builds itself from."""
    return httpx.get(server.url + "/tasks", timeout=10).raise_for_status().json()


def blurred(clean: np.ndarray, psf: str) -> np.ndarray:
    """``clean`` ``(H, W, c)`` blurred by the named ``psf`` (symmetric border, as the deblurrer's model)."""
    x = torch.from_numpy(clean.transpose(2, 0, 1)[None].astype(np.float32))
    y = Blur(parse_psf(psf), "symmetric").forward(x)[0].numpy().transpose(1, 2, 0)
    return noisy(y, 2.0)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("images")
    clean = np.stack([smooth_image(96, 128, s) for s in range(3)], -1)
    shapes = np.zeros((96, 128))
    shapes[20:70, 30:90] = 1.0
    psf = gaussian_psf(1.6).numpy()
    files = {
        "denoise": encode(to_uint8(noisy(clean, 25.0))),
        "inpaint": encode(to_uint8(clean)),
        "segment": encode(to_uint8(noisy(0.2 + 0.6 * shapes, 40.0))),
        "deblur": encode(to_uint8(blurred(clean, "gaussian:1.6"))),
        "super-resolve": encode(to_uint8(clean)),
        "broken": b"this is not an image",
        "mask": encode((shapes * 255).astype(np.uint8)),
        "tiff": encode(to_uint8(noisy(smooth_image(96, 128), 20.0)), "TIFF"),
        # the deblurrer's PSF as an image (odd sides; the service normalises it to sum 1)
        "psf": encode(to_uint8(psf / psf.max())),
        "psf-even": encode(np.full((4, 6), 255, np.uint8)),
    }
    paths = {}
    for name, data in files.items():
        paths[name] = d / (f"{name}.tif" if name == "tiff" else f"{name}.png")
        paths[name].write_bytes(data)
    return paths


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.goto(url + "/")
    page.wait_for_selector("#status.ok", timeout=30_000)
    return page, errors


def run_task(page, task: str, image: Path) -> None:
    # the radios exist once the page has read GET /tasks: page.check waits for them
    page.check(f"input[name=task][value={task}]")
    page.set_input_files("#file", str(image))
    # locator waits, not wait_for_function: the page's CSP forbids the eval that polling would need
    page.locator("#run:not([disabled])").wait_for()
    if task == "deblur":  # the PSF picker composes `psf` from a kind and its parameters
        page.select_option("#deblur-psf", "gaussian")
        page.fill("#deblur-psf-gaussian-sigma", "1.6")
        assert page.inner_text("#deblur-psf-value") == "psf = gaussian:1.6"
    if task == "super-resolve":
        page.select_option("#super-resolve-scale", "2")
    if task == "inpaint":
        page.locator("#mask-canvas:not([hidden])").wait_for()  # the image is drawn and can be painted
        box = page.locator("#mask-canvas").bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.4)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.7, box["y"] + box["height"] * 0.5, steps=12)
        page.mouse.up()
    page.click("#run")


# the result's size: super-resolution at scale 2 doubles each side
SIZES = {"super-resolve": (256, 192)}


@pytest.mark.parametrize("task", ["denoise", "inpaint", "segment", "deblur", "super-resolve"])
def test_each_task_shows_its_result_and_statistics(
    browser, server, images, tasks, task: str, tmp_path
) -> None:
    page, errors = open_page(browser, server.url)
    # the page lists the models when its /models request returns: wait for them, then count
    page.locator("#model option").nth(1).wait_for(state="attached", timeout=30_000)
    assert page.locator("#model option").count() >= 2  # default + the task's models
    run_task(page, task, images[task])
    page.wait_for_selector("#stats:not([hidden])", timeout=60_000)
    assert page.locator("#error").is_hidden()
    # 0 iterations are a result too: a Gaussian PSF with the symmetric border is one DCT solve
    # (kdeq.maths.operators.Sandwich), and the guided denoiser's mean may already meet the tolerance
    assert int(page.inner_text("#stat-iterations")) >= (0 if task in ("deblur", "denoise") else 1)
    assert float(page.inner_text("#stat-residual")) < 1e-2
    assert page.inner_text("#stat-converged") == "yes"
    assert page.inner_text("#stat-model").startswith(task)
    assert "ms in the browser" in page.inner_text("#stat-time")
    result = page.locator("#result-img")
    assert result.get_attribute("src").startswith("data:image/png;base64,")
    width, height = SIZES.get(task, (128, 96))
    assert page.evaluate("document.getElementById('result-img').naturalWidth") == width
    assert page.evaluate("document.getElementById('result-img').naturalHeight") == height
    assert page.inner_text("#stat-size").startswith(f"{width} × {height} px")
    assert page.inner_text("#result-size") == f"({width} × {height})"
    # the task's result fields (σ used, threshold used), from GET /tasks, are shown as numbers
    (info,) = [t for t in tasks if t["name"] == task]
    for field in info["fields"]:
        assert float(page.inner_text(f"#stat-{field['name']}")) >= 0
    if task == "super-resolve":  # the larger result can be shown pixel for pixel, scrolling
        page.check("#actual-size")
        assert result.bounding_box()["width"] == pytest.approx(width, abs=1)
    link = page.locator("#download")
    assert link.is_visible() and link.get_attribute("download").startswith(f"kdeq-{task}-")
    page.locator("#compare-slider").fill("20")
    clip = page.evaluate("document.getElementById('compare-after-clip').style.width")
    assert clip == "20%"
    shot = tmp_path / f"{task}.png"  # the test's own output folder
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert not errors, errors
    page.close()


def test_api_errors_are_shown_as_readable_messages(browser, server, images) -> None:
    page, errors = open_page(browser, server.url)
    run_task(page, "denoise", images["broken"])
    page.wait_for_selector("#error:not([hidden])", timeout=30_000)
    message = page.inner_text("#error")
    assert message.startswith("415 unsupported_media_type:") and "PNG, JPEG, WebP or TIFF" in message
    assert page.locator("#stats").is_hidden()
    assert not errors, errors
    page.close()


def test_a_files_size_is_written_in_bytes_below_a_kilobyte(browser, server) -> None:
    page, errors = open_page(browser, server.url)
    # the size is the file's, whatever it holds: 28 bytes, then 1.5 kB (1 kB = 1000 bytes)
    for size, shown in ((28, "28 B"), (1500, "1.5 kB")):
        page.set_input_files(
            "#file", files=[{"name": "x.png", "mimeType": "image/png", "buffer": bytes(size)}]
        )
        assert page.inner_text("#filename") == f"x.png ({shown})"
    assert not errors, errors
    page.close()


def test_the_page_asks_for_the_key_when_one_is_configured(browser, images, tmp_path) -> None:
    with run_server(tmp_path, api_key="page-key-123") as keyed:
        page, errors = open_page(browser, keyed.url)
        page.wait_for_selector("#key-box:not([hidden])", timeout=30_000)
        assert "API key" in page.inner_text("#error")
        assert page.locator("input[name=task]").count() == 0  # GET /tasks needs the key too
        page.fill("#api-key", "page-key-123")
        page.dispatch_event("#api-key", "change")
        page.locator("#model option").nth(1).wait_for(state="attached", timeout=30_000)
        run_task(page, "denoise", images["denoise"])
        page.wait_for_selector("#stats:not([hidden])", timeout=60_000)
        assert page.inner_text("#stat-converged") == "yes"
        assert not errors, errors
        page.close()


def test_an_uploaded_mask_and_a_tiff_the_browser_cannot_show(browser, server, images) -> None:
    page, errors = open_page(browser, server.url)
    # inpainting with a mask file instead of painting
    page.check("input[name=task][value=inpaint]")
    page.set_input_files("#file", str(images["inpaint"]))
    page.locator("#run:not([disabled])").wait_for()
    page.set_input_files("#inpaint-mask", str(images["mask"]))
    page.click("#run")
    page.wait_for_selector("#stats:not([hidden])", timeout=60_000)
    assert page.inner_text("#stat-model").startswith("inpaint")
    # a TIFF: the service reads it, the browser cannot draw it; painting is offered no more
    page.set_input_files("#file", str(images["tiff"]))
    page.locator("#paint-note:not([hidden])").wait_for(timeout=10_000)
    assert page.locator("#stats").is_hidden()  # the previous result went with the previous input
    page.check("input[name=task][value=denoise]")
    page.click("#run")
    page.wait_for_selector("#stats:not([hidden])", timeout=60_000)
    assert page.inner_text("#stat-converged") == "yes" and page.locator("#compare").is_hidden()
    assert not errors, errors
    page.close()


def test_the_task_list_is_the_servers(browser, server, tasks) -> None:
    """The radios and each task's controls come from GET /tasks, so a newly registered task appears on
    the page without editing it."""
    page, errors = open_page(browser, server.url)
    radios = page.locator("input[name=task]")
    radios.first.wait_for(state="attached", timeout=30_000)
    assert radios.evaluate_all("els => els.map(e => e.value)") == [t["name"] for t in tasks]
    labels = page.locator("#tasks label")
    assert labels.evaluate_all("els => els.map(e => e.title)") == [t["summary"] for t in tasks]
    assert radios.first.is_checked()
    for t in tasks:
        page.check(f"input[name=task][value={t['name']}]")
        block = page.locator(f"fieldset.options[data-task={t['name']}]")
        assert block.is_visible() and page.locator("fieldset.options:visible").count() == 1
        assert page.inner_text("#task-summary") == t["summary"] + "."
        # a control for every option and every file input
        for name in [*t["options"].get("properties", {}), *(f["name"] for f in t["files"])]:
            assert block.locator(f"[data-inputs~={name}]").count() == 1, (t["name"], name)
        # the model list follows the task
        page.locator("#model option").nth(len(t["models"])).wait_for(state="attached", timeout=30_000)
        ids = page.locator("#model option").evaluate_all("els => els.map(e => e.value)")
        assert set(ids) == {"", *t["models"]}
    assert not errors, errors
    page.close()


def test_deblur_with_an_uploaded_psf_image(browser, server, images) -> None:
    page, errors = open_page(browser, server.url)
    page.check("input[name=task][value=deblur]")
    page.set_input_files("#file", str(images["deblur"]))
    page.locator("#run:not([disabled])").wait_for()
    page.select_option("#deblur-psf", "upload")
    assert page.locator("#deblur-psf-gaussian-sigma").is_hidden()
    # no PSF file yet: the browser's form validation keeps the request from being sent
    page.click("#run")
    assert page.locator("#deblur-psf_image:invalid").count() == 1
    assert page.locator("#stats").is_hidden() and page.locator("#error").is_hidden()
    # a PSF with even sides: the service's refusal is shown
    page.set_input_files("#deblur-psf_image", str(images["psf-even"]))
    page.click("#run")
    page.wait_for_selector("#error:not([hidden])", timeout=30_000)
    assert page.inner_text("#error").startswith("422 invalid_psf:")
    # the PSF the image was blurred with, as an image: only `psf_image` is sent (not `psf` as well,
    # which the service would refuse)
    page.set_input_files("#deblur-psf_image", str(images["psf"]))
    page.click("#run")
    page.wait_for_selector("#stats:not([hidden])", timeout=60_000)
    assert page.locator("#error").is_hidden()
    assert page.inner_text("#stat-model").startswith("deblur")
    assert page.inner_text("#stat-converged") == "yes"
    assert float(page.inner_text("#stat-sigma")) >= 0
    assert page.evaluate("document.getElementById('result-img').naturalWidth") == 128
    assert not errors, errors
    page.close()


def test_generic_controls_send_the_values_given(browser, server, images) -> None:
    """Nullable numbers (σ, threshold) are left to the server until their "use the default" box is
    unchecked; the browser checks the schema's range before anything is sent; enums are selects."""
    page, errors = open_page(browser, server.url)
    run_task(page, "denoise", images["denoise"])
    page.wait_for_selector("#stats:not([hidden])", timeout=60_000)
    estimated = float(page.inner_text("#stat-sigma"))
    assert page.locator("#denoise-sigma").is_disabled()
    page.uncheck("#denoise-sigma-auto")
    page.fill("#denoise-sigma", "300")  # above the schema's maximum: not sent
    page.click("#run")
    assert page.locator("#denoise-sigma:invalid").count() == 1
    page.fill("#denoise-sigma", "10")
    page.click("#run")
    page.locator("#stat-sigma", has_text="10.000").wait_for(timeout=60_000)
    assert estimated != 10.0
    page.check("input[name=task][value=segment]")
    page.uncheck("#segment-threshold-auto")
    page.fill("#segment-threshold", "0.3")
    page.select_option("#segment-output", "probability")
    page.click("#run")
    page.wait_for_selector("#stats:not([hidden])", timeout=60_000)
    assert page.inner_text("#stat-threshold") == "0.3000"
    assert not errors, errors
    page.close()


def test_super_resolve_at_scale_3(browser, server, images) -> None:
    # the scale select sends a value other than the default; the result grows with it
    page, errors = open_page(browser, server.url)
    run_task(page, "super-resolve", images["super-resolve"])
    page.wait_for_selector("#stats:not([hidden])", timeout=60_000)
    page.select_option("#super-resolve-scale", "3")
    page.click("#run")
    page.locator("#stat-size", has_text="384 × 288 px").wait_for(timeout=30_000)
    assert not errors, errors
    page.close()


def test_a_new_task_needs_no_page_edits(browser, server, tasks) -> None:
    """A task the page has never heard of, added to GET /tasks (through the browser's network layer),
    gets its radio, generic controls and result field, and is posted to its route."""
    sharpen = {
        "name": "sharpen",
        "route": "/sharpen",
        "summary": "Sharpen an image",
        "family": "gaussian",
        "options": {
            "type": "object",
            "properties": {
                "amount": {
                    "type": "number",
                    "minimum": 0,
                    "maximum": 2,
                    "default": 1,
                    "title": "Amount",
                    "description": "how much",
                },
                "mode": {"enum": ["luma", "rgb"], "type": "string", "default": "luma", "title": "Mode"},
            },
        },
        "files": [{"name": "guide", "description": "a guide image", "kind": "image"}],
        "fields": [{"name": "amount", "description": "amount used", "header": "X-KDEQ-Amount"}],
        "models": [],
    }
    posted: list[bytes] = []
    png = encode(np.full((96, 128), 128, np.uint8))

    def answer(route) -> None:
        posted.append(route.request.post_data_buffer)
        body = {
            "model": "sharpen-kglm:1",
            "image": base64.b64encode(png).decode(),
            "width": 128,
            "height": 96,
            "mode": "L",
            "solver": {"iterations": 3, "residual": 1e-5, "converged": True},
            "lam": 0.01,
            "batch_size": 1,
            "amount": 1.5,
            "timings": {"total_seconds": 0.01, "inference_seconds": 0.01},
        }
        route.fulfill(status=200, json=body, headers={"X-KDEQ-Amount": "1.500"})

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.route("**/tasks", lambda route: route.fulfill(status=200, json=[*tasks, sharpen]))
    page.route("**/sharpen", answer)
    page.goto(server.url + "/")
    page.check("input[name=task][value=sharpen]")
    assert page.inner_text("#task-summary") == "Sharpen an image."
    assert page.input_value("#sharpen-amount") == "1"
    assert page.get_attribute("#sharpen-amount", "max") == "2"
    page.fill("#sharpen-amount", "1.5")
    page.select_option("#sharpen-mode", "rgb")
    page.set_input_files("#sharpen-guide", {"name": "guide.png", "mimeType": "image/png", "buffer": png})
    page.set_input_files("#file", {"name": "in.png", "mimeType": "image/png", "buffer": png})
    page.click("#run")
    page.wait_for_selector("#stats:not([hidden])", timeout=30_000)
    assert page.inner_text("#stat-amount") == "1.500"  # the header, formatted by the server
    (form,) = posted
    for part in (
        b'name="amount"\r\n\r\n1.5',
        b'name="mode"\r\n\r\nrgb',
        b'name="guide"; filename="guide.png"',
    ):
        assert part in form
    assert not errors, errors
    page.close()


def test_a_server_without_tasks_says_so(browser, server) -> None:
    page = browser.new_page()
    page.route("**/tasks", lambda route: route.fulfill(status=404, json={"detail": "Not Found"}))
    page.goto(server.url + "/")
    page.wait_for_selector("#error:not([hidden])", timeout=30_000)
    assert page.inner_text("#error").startswith("GET /tasks: 404")
    assert "does not list its tasks" in page.inner_text("#task-summary")
    assert page.locator("input[name=task]").count() == 0 and page.locator("#run").is_disabled()
    page.close()


def test_the_api_docs_render_with_the_network_closed(browser, server, tasks) -> None:
    """Every request but the server's is blocked: the page still renders each route, asks nothing of
    anywhere else, and shows the service's icon."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    outside: list[str] = []
    failed: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.on("requestfailed", lambda req: failed.append(req.url))

    def only_the_server(route) -> None:
        if route.request.url.startswith(server.url):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_server)
    page.goto(server.url + "/docs")
    page.wait_for_selector(".opblock-summary-path", timeout=60_000)
    text = page.inner_text("body")
    for task in tasks:
        assert task["route"] in text, task["route"]
    assert not outside and not failed and not errors, (outside, failed, errors)
    icon = page.get_attribute("link[rel~='icon']", "href")
    r = httpx.get(server.url + icon)
    assert r.status_code == 200 and r.headers["content-type"] == "image/vnd.microsoft.icon"
    assert Image.open(io.BytesIO(r.content)).format == "ICO"
    page.close()


def test_a_sample_needs_no_upload_and_the_residual_is_plotted_per_iteration(browser, server) -> None:
    """ "Try a sample" loads the server's generated image for the chosen task; the result comes with
    a plot of the residual with one point per iteration the statistics report. Denoised by the
    stationary model, which iterates: the default's mean may meet the tolerance at once (0 steps,
    nothing to plot)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.goto(server.url + "/")
    page.wait_for_selector("#status.ok", timeout=30_000)
    page.locator("#model option").nth(1).wait_for(state="attached", timeout=30_000)
    for task in ("denoise", "segment"):
        page.check(f"input[name=task][value={task}]")
        if task == "denoise":
            page.select_option("#model", "denoise-stationary-kglm:2")
        page.click("#sample")
        page.wait_for_selector(f"#filename:has-text('sample-{task}.png')", timeout=30_000)
        page.locator("#run:not([disabled])").wait_for()
        page.click("#run")
        page.wait_for_selector("#stats:not([hidden])", timeout=60_000)
        iterations = int(page.inner_text("#stat-iterations"))
        assert page.locator("#history").is_visible(), task
        assert page.locator("#history-plot circle.step").count() == iterations >= 1, task
        assert page.locator("#history-plot polyline.residual").count() == 1, task
    assert not errors, errors
    page.close()


def test_the_uncertainty_map_is_drawn_over_the_result_with_a_toggle(browser, server, images) -> None:
    """The box is offered only for a model that can answer it (GET /models); checked, the result
    comes with a heat map laid over it, its legend in grey levels, and the toggle hides it."""
    page, errors = open_page(browser, server.url)
    page.locator("#model option").nth(1).wait_for(state="attached", timeout=30_000)
    page.check("input[name=task][value=deblur]")
    assert page.locator("#uncertainty-box").is_hidden()  # the default deblurrer is plug-and-play: none
    page.check("input[name=task][value=denoise]")
    page.locator("#uncertainty-box").wait_for()
    page.select_option("#model", "denoise-stationary-kglm:2")
    page.check("#uncertainty")
    page.set_input_files("#file", str(images["denoise"]))
    page.locator("#run:not([disabled])").wait_for()
    page.click("#run")
    page.wait_for_selector("#uncertainty-canvas[data-drawn=true]", state="attached", timeout=120_000)
    canvas = page.locator("#uncertainty-canvas")
    assert canvas.is_visible()
    width = page.evaluate("document.getElementById('uncertainty-canvas').width")
    assert width == page.evaluate("document.getElementById('result-img').naturalWidth")
    box, under = canvas.bounding_box(), page.locator("#result-img").bounding_box()
    assert box == pytest.approx(under, abs=1)  # laid exactly over the result
    legend = page.inner_text("#uncertainty-legend")
    assert "grey levels of 255" in legend and "probes" in legend
    page.uncheck("#show-uncertainty")
    assert canvas.is_hidden()
    page.check("#show-uncertainty")
    assert canvas.is_visible()
    assert not errors, errors
    page.close()
