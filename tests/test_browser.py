"""The web page in a real browser: Playwright drives Debian's Chromium, headless, against a real server
process. Each task is run on a real image; the result, its statistics and a screenshot are checked."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

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
def images(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("images")
    clean = np.stack([smooth_image(96, 128, s) for s in range(3)], -1)
    shapes = np.zeros((96, 128))
    shapes[20:70, 30:90] = 1.0
    files = {
        "denoise": encode(to_uint8(noisy(clean, 25.0))),
        "inpaint": encode(to_uint8(clean)),
        "segment": encode(to_uint8(noisy(0.2 + 0.6 * shapes, 40.0))),
        "broken": b"this is not an image",
        "mask": encode((shapes * 255).astype(np.uint8)),
        "tiff": encode(to_uint8(noisy(smooth_image(96, 128), 20.0)), "TIFF"),
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
    page.check(f"input[name=task][value={task}]")
    page.set_input_files("#file", str(image))
    # locator waits, not wait_for_function: the page's CSP forbids the eval that polling would need
    page.locator("#run:not([disabled])").wait_for()
    if task == "inpaint":
        page.locator("#mask-canvas:not([hidden])").wait_for()  # the image is drawn and can be painted
        box = page.locator("#mask-canvas").bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.4)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.7, box["y"] + box["height"] * 0.5, steps=12)
        page.mouse.up()
    page.click("#run")


@pytest.mark.parametrize("task", ["denoise", "inpaint", "segment"])
def test_each_task_shows_its_result_and_statistics(browser, server, images, task: str, tmp_path) -> None:
    page, errors = open_page(browser, server.url)
    # the page lists the models when its /models request returns: wait for them, then count
    page.locator("#model option").nth(1).wait_for(state="attached", timeout=30_000)
    assert page.locator("#model option").count() >= 2  # default + the task's models
    run_task(page, task, images[task])
    page.wait_for_selector("#stats:not([hidden])", timeout=60_000)
    assert page.locator("#error").is_hidden()
    assert int(page.inner_text("#stat-iterations")) >= 1
    assert float(page.inner_text("#stat-residual")) < 1e-2
    assert page.inner_text("#stat-converged") == "yes"
    assert page.inner_text("#stat-model").startswith(task)
    assert "ms in the browser" in page.inner_text("#stat-time")
    result = page.locator("#result-img")
    assert result.get_attribute("src").startswith("data:image/png;base64,")
    assert page.evaluate("document.getElementById('result-img').naturalWidth") == 128
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


def test_the_page_asks_for_the_key_when_one_is_configured(browser, images, tmp_path) -> None:
    with run_server(tmp_path, api_key="page-key-123") as keyed:
        page, errors = open_page(browser, keyed.url)
        page.wait_for_selector("#key-box:not([hidden])", timeout=30_000)
        assert "API key" in page.inner_text("#error")
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
    page.set_input_files("#mask-file", str(images["mask"]))
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
