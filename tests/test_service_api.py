"""The HTTP API in process (FastAPI's TestClient), with the real default models and real images."""

from __future__ import annotations

import base64
import io
import shutil
import subprocess
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from kdeq.images import scaledpng
from kdeq.models.repository import load_predictor
from kdeq.registry import TASKS
from kdeq.serving import tiling
from kdeq.serving.tiling import solve_tiled
from kdeq.tasks.base import Request as TaskRequest
from kdeq.tasks.base import solve_batch
from service.app import create_app
from service.routes import COMMON_FIELDS
from service.settings import Settings
from tests.helpers import served, served_models
from tests.service_helpers import (
    MODELS,
    assert_error,
    decode,
    encode,
    metric,
    missing_tool,
    noisy,
    psnr,
    smooth_image,
    to_uint8,
)


def make_client(**overrides: object) -> TestClient:
    settings = Settings(models_dir=MODELS, device=("cpu",), **overrides)
    return TestClient(create_app(settings), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client():
    with make_client() as c:
        assert c.app.state.service.wait_loaded(120)
        yield c


def grey_png(h: int = 48, w: int = 64, sigma: float = 20.0) -> tuple[bytes, np.ndarray]:
    clean = smooth_image(h, w)
    return encode(to_uint8(noisy(clean, sigma))), clean


# --- operations ------------------------------------------------------------------------------


def test_health_ready_and_models(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "alive"}
    assert client.get("/readyz").status_code == 200
    models = {m["id"]: m for m in client.get("/models").json()}
    # the latest version of each model: the deblurrer plug-and-play around the trained denoiser, the
    # others trained from their kGLM start
    assert set(models) == served_models()
    assert all(m["ready"] and m["error"] is None and m["devices"] == ["cpu"] for m in models.values())
    assert models[served("denoise-kglm")]["default"]
    assert not any(models[k]["default"] for k in (served("denoise-kglm-x8"), served("denoise-kglm-collab")))
    assert not models[served("denoise-stationary-kglm")]["default"]


def test_metrics_is_a_plain_route_in_the_text_format(client: TestClient) -> None:
    r = client.get("/metrics", follow_redirects=False)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for model in (served("denoise-kglm"), served("inpaint-kglm"), served("segment-kglm")):
        assert metric(r.text, "kdeq_model_ready", model=model) == 1
    assert metric(r.text, "kdeq_build_info") == 1


def test_metrics_pass_promtool(client: TestClient) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        missing_tool("promtool not installed (Debian package prometheus; .ci/run installs it)")
    client.post("/denoise", files={"image": grey_png()[0]})
    text = client.get("/metrics").text
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done


def test_openapi_documents_every_parameter_and_error(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    # every route takes the common fields after its own
    common = {p.name for p in COMMON_FIELDS}
    expected = {
        "/denoise": {"image", "noise", "sigma", "peak", *common},
        "/inpaint": {"image", "mask", *common},
        "/segment": {"image", "threshold", "output", *common},
    }
    schemas = spec["components"]["schemas"]
    for path, fields in expected.items():
        op = spec["paths"][path]["post"]
        ref = op["requestBody"]["content"]["multipart/form-data"]["schema"]["$ref"].rsplit("/", 1)[1]
        props = schemas[ref]["properties"]
        assert set(props) == fields
        assert all(props[f].get("description") for f in fields)
        assert {"400", "401", "404", "413", "415", "422", "503", "504"} <= set(op["responses"])
        assert set(op["responses"]["200"]["content"]) == {"image/png", "application/json"}
    assert client.get("/docs").status_code == 200


# --- inference -------------------------------------------------------------------------------


def test_denoise_returns_a_cleaner_png_of_the_same_size_and_mode(client: TestClient) -> None:
    clean = smooth_image(64, 80)
    dirty = to_uint8(noisy(clean, 25.0))
    r = client.post("/denoise", files={"image": ("x.png", encode(dirty), "image/png")}, data={"sigma": "25"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    out = decode(r.content)
    assert out.mode == "L" and out.size == (80, 64)
    gain = psnr(np.asarray(out) / 255.0, clean) - psnr(dirty / 255.0, clean)
    assert gain > 5.0
    assert r.headers["x-kdeq-model"] == served("denoise-kglm")
    assert int(r.headers["x-kdeq-iterations"]) >= 1
    assert float(r.headers["x-kdeq-residual"]) <= 1e-4 and r.headers["x-kdeq-converged"] == "true"
    assert float(r.headers["x-kdeq-sigma"]) == 25.0


def test_json_response_carries_the_same_png_statistics_and_timings(client: TestClient) -> None:
    png, _ = grey_png()
    as_png = client.post("/denoise", files={"image": png}, data={"sigma": "20"})
    as_json = client.post(
        "/denoise", files={"image": png}, data={"sigma": "20"}, headers={"Accept": "application/json"}
    )
    body = as_json.json()
    assert base64.b64decode(body["image"]) == as_png.content
    assert body["solver"]["iterations"] == int(as_png.headers["x-kdeq-iterations"])
    assert body["solver"]["converged"] is True and body["sigma"] == 20.0
    assert (body["width"], body["height"], body["mode"]) == (64, 48, "L")
    t = body["timings"]
    assert 0 < t["inference_seconds"] <= t["total_seconds"]
    assert t["decode_seconds"] + t["queue_seconds"] + t["inference_seconds"] + t["encode_seconds"] <= (
        t["total_seconds"] + 1e-6
    )


def test_denoise_estimates_sigma_and_keeps_colour(client: TestClient) -> None:
    clean = np.stack([smooth_image(40, 56, s) for s in range(3)], -1)
    jpeg = encode(to_uint8(noisy(clean, 30.0)), "JPEG", quality=95)
    r = client.post("/denoise", files={"image": jpeg})
    assert r.status_code == 200
    assert decode(r.content).mode == "RGB" and decode(r.content).size == (56, 40)
    assert 20.0 < float(r.headers["x-kdeq-sigma"]) < 40.0


def test_exif_orientation_is_applied(client: TestClient) -> None:
    im = Image.fromarray(to_uint8(smooth_image(30, 50)))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    r = client.post("/denoise", files={"image": encode(im, "JPEG", exif=exif.tobytes())})
    assert r.status_code == 200 and decode(r.content).size == (30, 50)


def test_alpha_and_16_bit_grey_round_trip(client: TestClient) -> None:
    rgba = np.dstack(
        [to_uint8(np.stack([smooth_image(32, 32, s) for s in range(3)], -1)), np.full((32, 32), 77)]
    )
    r = client.post("/denoise", files={"image": encode(rgba.astype(np.uint8))}, data={"sigma": "10"})
    out = decode(r.content)
    assert out.mode == "RGBA" and (np.asarray(out)[..., 3] == 77).all()
    grey16 = (smooth_image(32, 40) * 65535).astype(np.uint16)
    r = client.post("/denoise", files={"image": encode(Image.fromarray(grey16))}, data={"sigma": "5"})
    out = decode(r.content)
    assert out.mode in {"I;16", "I"} and out.size == (40, 32)
    assert np.abs(np.asarray(out, dtype=np.float64) / 65535 - smooth_image(32, 40)).mean() < 0.02


def test_inpaint_fills_missing_pixels_and_keeps_the_rest(client: TestClient) -> None:
    clean = to_uint8(smooth_image(48, 64))
    missing = np.random.default_rng(3).random((48, 64)) < 0.4
    image = np.where(missing, 0, clean).astype(np.uint8)
    r = client.post(
        "/inpaint", files={"image": encode(image), "mask": encode((missing * 255).astype(np.uint8))}
    )
    assert r.status_code == 200, r.text
    out = np.asarray(decode(r.content)).astype(np.float64)
    assert (out[~missing] == clean[~missing]).all()
    assert np.abs(out[missing] - clean[missing]).mean() < 6.0  # 0–255 scale; the holes were 0
    assert r.headers["x-kdeq-model"] == served("inpaint-kglm")


def test_inpaint_reads_holes_from_the_alpha_channel(client: TestClient) -> None:
    rgb = to_uint8(np.stack([smooth_image(40, 40, s) for s in range(3)], -1))
    alpha = np.full((40, 40), 200, np.uint8)
    alpha[10:20, 15:30] = 0
    r = client.post("/inpaint", files={"image": encode(np.dstack([rgb, alpha]))})
    out = np.asarray(decode(r.content))
    assert r.status_code == 200 and out.shape == (40, 40, 4)
    # the holes are filled, so they become opaque; the rest keeps its alpha
    assert (out[10:20, 15:30, 3] == 255).all() and (out[..., 3][alpha > 0] == 200).all()
    err = np.abs(out[10:20, 15:30, :3].astype(float) - rgb[10:20, 15:30]).mean()
    flat = np.abs(rgb[alpha > 0].mean(0) - rgb[10:20, 15:30]).mean()  # holes filled with the mean colour
    assert err < 0.5 * flat


def test_png_transparency_chunk_is_an_alpha_channel(client: TestClient) -> None:
    grey = to_uint8(smooth_image(32, 32))
    grey[grey == grey[8, 8]] = 1
    grey[4:12, 4:12] = 0
    im = Image.fromarray(grey)
    png = encode(im, transparency=0)  # a tRNS chunk: grey 0 is transparent
    r = client.post("/inpaint", files={"image": png})
    out = np.asarray(decode(r.content))
    assert r.status_code == 200 and decode(r.content).mode == "LA"
    assert (out[4:12, 4:12, 1] == 255).all() and (out[4:12, 4:12, 0] > 0).all()


def test_segment_mask_and_probability(client: TestClient) -> None:
    truth = np.zeros((48, 48))
    truth[12:36, 10:30] = 1.0
    image = encode(to_uint8(noisy(0.2 + 0.6 * truth, 60.0)))
    r = client.post("/segment", files={"image": image})
    mask = np.asarray(decode(r.content))
    assert r.status_code == 200 and set(np.unique(mask)) <= {0, 255}
    fg = mask > 0
    assert (fg & (truth > 0)).sum() / (fg | (truth > 0)).sum() > 0.9
    prob = client.post("/segment", files={"image": image}, data={"output": "probability", "threshold": "0.5"})
    p = np.asarray(decode(prob.content)) / 255.0
    assert len(np.unique(p)) > 2 and prob.headers["x-kdeq-threshold"] == "0.5000"
    assert ((p > 0.5) == fg).mean() > 0.99


def test_named_model_and_version(client: TestClient) -> None:
    png, _ = grey_png()
    for name in ("denoise-stationary-kglm", served("denoise-stationary-kglm")):
        r = client.post("/denoise", files={"image": png}, data={"model": name, "sigma": "20"})
        assert r.status_code == 200 and r.headers["x-kdeq-model"] == served("denoise-stationary-kglm")
    # version 1 is in the repository but not loaded (only the latest is, unless KDEQ_MODELS names it)
    r = client.post("/denoise", files={"image": png}, data={"model": "denoise-stationary-kglm:1"})
    assert r.status_code == 404 and served("denoise-stationary-kglm") in r.json()["detail"]


def test_metrics_move_with_requests(client: TestClient) -> None:
    png, _ = grey_png()
    labels = {"endpoint": "/denoise", "model": served("denoise-kglm")}
    before = client.get("/metrics").text
    client.post("/denoise", files={"image": png})
    capped = client.post("/denoise", files={"image": png}, data={"max_iter": "1", "tol": "1e-9"})
    after = client.get("/metrics").text
    assert capped.status_code == 200 and capped.headers["x-kdeq-converged"] == "false"
    assert capped.headers["x-kdeq-iterations"] == "1"
    grew = metric(after, "kdeq_solver_iterations_count", **labels) - metric(
        before, "kdeq_solver_iterations_count", **labels
    )
    assert grew == 2
    missed = metric(after, "kdeq_solver_nonconverged_total", **labels) - metric(
        before, "kdeq_solver_nonconverged_total", **labels
    )
    assert missed == 1
    ok = metric(after, "kdeq_http_requests_total", endpoint="/denoise", status="200") - metric(
        before, "kdeq_http_requests_total", endpoint="/denoise", status="200"
    )
    assert ok == 2
    assert metric(after, "kdeq_upload_size_bytes_count", endpoint="/denoise") > metric(
        before, "kdeq_upload_size_bytes_count", endpoint="/denoise"
    )


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "files", "status", "error"),
    [
        ({}, {}, 415, "multipart_expected"),  # no form at all
        ({"sigma": "abc"}, None, 400, "bad_request"),
        ({"sigm": "2"}, None, 400, "unknown_field"),
        ({"sigma": "-1"}, None, 422, "unprocessable"),
        ({"sigma": "256"}, None, 422, "unprocessable"),
        ({"sigma": "nan"}, None, 422, "unprocessable"),
        ({"max_iter": "100000"}, None, 422, "max_iter_too_large"),
        ({"model": "../../etc"}, None, 400, "invalid_model"),
        ({"model": "nope"}, None, 404, "no_model"),
        ({"model": "segment-kglm"}, None, 404, "no_model"),
        ({"model": "denoise-kglm:99"}, None, 404, "no_model"),
        ({}, {"image": b""}, 400, "empty_file"),
        ({}, {"image": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4}, 415, "unsupported_media_type"),
        ({}, {"image": np.random.default_rng(0).bytes(3000)}, 415, "unsupported_media_type"),
    ],
)
def test_client_errors_are_json_4xx(
    client: TestClient, data: dict, files: dict | None, status: int, error: str
) -> None:
    if files is None:
        files = {"image": grey_png()[0]}
    assert_error(client.post("/denoise", data=data, files=files or None), status, error)


def test_formats_outside_the_allow_list_and_truncated_files(client: TestClient) -> None:
    im = Image.fromarray(to_uint8(smooth_image(20, 20)))
    for fmt in ("GIF", "BMP"):
        assert_error(client.post("/denoise", files={"image": encode(im, fmt)}), 415)
    for fmt in ("PNG", "JPEG", "WEBP", "TIFF"):
        data = encode(im, fmt)
        assert client.post("/denoise", files={"image": data}).status_code == 200, fmt
        assert_error(client.post("/denoise", files={"image": data[: len(data) // 2]}), 415)


def test_a_file_field_sent_as_text_is_malformed(client: TestClient) -> None:
    # in a multipart form (a URL-encoded one is refused whole: tests/test_service_requests.py)
    r = client.post("/denoise", files=[("image", (None, "not a file"))])
    assert "`image` must be a file upload" in assert_error(r, 400)["detail"]
    r = client.post("/inpaint", files={"image": grey_png()[0]}, data={"mask": "nope"})
    assert "`mask` must be a file upload" in assert_error(r, 400)["detail"]


def test_duplicate_fields_are_refused(client: TestClient) -> None:
    png, _ = grey_png()
    r = client.post("/denoise", files=[("image", png), ("image", png)])
    assert_error(r, 400, "duplicate_field")


def test_pixel_limit_is_checked_from_the_header() -> None:
    # a 5000×5000 PNG whose header says so; its zlib stream is a few kB
    bomb = encode(Image.new("L", (5000, 5000)))
    with make_client(max_pixels=1_000_000) as c:
        c.app.state.service.wait_loaded(120)
        assert len(bomb) < 100_000
        body = assert_error(c.post("/denoise", files={"image": bomb}), 413, "too_many_pixels")
        assert "5000×5000" in body["detail"]
        assert metric(c.get("/metrics").text, "kdeq_rejected_requests_total", reason="too_many_pixels") == 1


def test_images_larger_than_a_tile_are_denoised_in_tiles_as_in_process() -> None:
    """Tiles of 64 (``KDEQ_TILE_SIZE``): a 100×130 colour photo is cut into 6 and answered as
    ``kdeq.serving.tiling`` answers it in process, to a grey level, and so is the inpainter's, the
    segmenter's and the photon denoiser's (its peak from the whole output); the deblurrer, which
    solves whole images only, takes at most ``KDEQ_MAX_UNTILED_PIXELS``, while the others take up to
    ``KDEQ_MAX_PIXELS``."""
    clean = np.stack([smooth_image(100, 130, seed=k) for k in range(3)], axis=-1)
    image = to_uint8(noisy(clean, 20.0))
    models = (
        "denoise-kglm:3",
        "inpaint-kglm:1",
        "segment-kglm:1",
        "denoise-poisson-kglm",
        "deblur-kglm",
    )
    settings = {"tile_size": 64, "max_untiled_pixels": 64 * 64, "models": models}
    tiles: list[int] = []
    real = tiling.solve_batch
    with (
        make_client(warmup=False, **settings) as c,
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr(tiling, "solve_batch", lambda t, p, rs: tiles.append(len(rs)) or real(t, p, rs))
        assert c.app.state.service.wait_loaded(120)
        r = c.post("/denoise", files={"image": encode(image)}, data={"sigma": "20"})
        assert r.status_code == 200, r.text
        assert sum(tiles) == 6  # 2 × 3 tiles, one per call on a CPU
        served = np.asarray(decode(r.content)).astype(int)
        task = TASKS["denoise"]
        pixels = (image.astype(np.float32) / 255).transpose(2, 0, 1).copy()
        request = task.prepare(pixels, None, task.options(sigma=20), {})
        expected = solve_tiled(task, load_predictor(MODELS / "denoise-kglm" / "3"), request, 64)
        assert np.abs(served - to_uint8(expected.output.transpose(1, 2, 0)).astype(int)).max() <= 1
        holes = np.zeros((100, 130), np.uint8)
        holes[10:14, 20:24] = 255
        tiles.clear()
        r = c.post("/inpaint", files={"image": encode(image), "mask": encode(holes)})
        assert r.status_code == 200, r.text
        assert sum(tiles) == 6
        task = TASKS["inpaint"]
        request = task.prepare(pixels, None, task.options(), {"mask": holes[None] > 0})
        expected = solve_tiled(task, load_predictor(MODELS / "inpaint-kglm" / "1"), request, 64)
        served = np.asarray(decode(r.content)).astype(int)
        assert np.abs(served - to_uint8(expected.output.transpose(1, 2, 0)).astype(int)).max() <= 1
        tiles.clear()
        r = c.post("/segment", files={"image": encode(image)}, data={"output": "probability"})
        assert r.status_code == 200, r.text
        assert sum(tiles) == 6
        task = TASKS["segment"]
        request = task.prepare(pixels, None, task.options(output="probability"), {})
        expected = solve_tiled(task, load_predictor(MODELS / "segment-kglm" / "1"), request, 64)
        served = np.asarray(decode(r.content)).astype(int)
        assert np.abs(served - to_uint8(expected.output[0]).astype(int)).max() <= 1
        tiles.clear()
        r = c.post("/denoise-poisson", files={"image": encode(image)})
        assert r.status_code == 200, r.text
        assert sum(tiles) == 6
        task = TASKS["denoise-poisson"]
        request = task.prepare(image.astype(np.float32).transpose(2, 0, 1).copy(), None, task.options(), {})
        expected = solve_tiled(task, load_predictor(MODELS / "denoise-poisson-kglm" / "3"), request, 64)
        assert float(r.headers["X-KDEQ-Peak"]) == pytest.approx(expected.fields["peak"], rel=1e-5)
        served = np.asarray(decode(r.content)).astype(int)
        assert np.abs(served - to_uint8(expected.output.transpose(1, 2, 0)).astype(int)).max() <= 1
        r = c.post("/deblur", files={"image": encode(image)}, data={"psf": "gaussian:1.6"})
        assert "4096" in assert_error(r, 413, "too_many_pixels")["detail"]
        small = encode(image[:64, :64])
        assert c.post("/deblur", files={"image": small}, data={"psf": "gaussian:1.6"}).status_code == 200


def test_a_tiled_solve_past_its_deadline_stops_between_tiles() -> None:
    """A 512² image in 64 tiles of 64 with a 0.3 s timeout: the client gets 504, and the worker
    abandons the image between tiles instead of solving the rest for nobody."""
    image = to_uint8(noisy(np.stack([smooth_image(512, 512, seed=k) for k in range(3)], axis=-1), 20.0))
    tiles: list[int] = []
    real = tiling.solve_batch
    settings = {"tile_size": 64, "request_timeout_seconds": 0.3, "models": ("denoise-kglm:3",)}
    with make_client(warmup=False, **settings) as c, pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiling, "solve_batch", lambda t, p, rs: tiles.append(len(rs)) or real(t, p, rs))
        assert c.app.state.service.wait_loaded(120)
        assert_error(c.post("/denoise", files={"image": encode(image)}, data={"sigma": "20"}), 504, "timeout")
        # a small request waits behind the worker: once it is answered, the large one has stopped
        small = encode(image[:32, :32])
        deadline = time.monotonic() + 60
        while c.post("/denoise", files={"image": small}).status_code != 200:
            assert time.monotonic() < deadline
        assert 0 < sum(tiles) < 64


def test_body_limit_from_content_length() -> None:
    with make_client(max_upload_bytes=4096) as c:
        c.app.state.service.wait_loaded(120)
        big = encode(to_uint8(np.random.default_rng(0).random((100, 100))))
        assert len(big) > 4096
        assert_error(c.post("/denoise", files={"image": big}), 413, "payload_too_large")
        assert metric(c.get("/metrics").text, "kdeq_rejected_requests_total", reason="body_too_large") == 1
        assert c.post("/denoise", files={"image": grey_png(16, 16)[0]}).status_code == 200


def test_inpaint_mask_errors(client: TestClient) -> None:
    png, _ = grey_png(48, 64)
    wrong = encode(np.zeros((10, 10), np.uint8))
    body = assert_error(client.post("/inpaint", files={"image": png, "mask": wrong}), 422, "size_mismatch")
    assert "10×10" in body["detail"] and "64×48" in body["detail"]
    everything = encode(np.full((48, 64), 255, np.uint8))
    assert_error(client.post("/inpaint", files={"image": png, "mask": everything}), 422, "nothing_observed")
    assert_error(client.post("/inpaint", files={"image": png}), 400, "missing_mask")


def test_segment_errors(client: TestClient) -> None:
    png, _ = grey_png()
    assert_error(client.post("/segment", files={"image": png}, data={"output": "colour"}), 422)
    assert_error(client.post("/segment", files={"image": png}, data={"threshold": "1.5"}), 422)


def test_api_key_guards_inference_routes_and_models() -> None:
    png, _ = grey_png()
    with make_client(api_key="s3cret") as c:
        c.app.state.service.wait_loaded(120)
        assert_error(c.post("/denoise", files={"image": png}), 401, "unauthorized")
        r = c.post("/denoise", files={"image": png}, headers={"Authorization": "Bearer wrong"})
        assert_error(r, 401) and r.headers["www-authenticate"].startswith("Bearer")
        assert (
            c.post("/denoise", files={"image": png}, headers={"Authorization": "Bearer s3cret"}).status_code
            == 200
        )
        assert c.post("/segment", files={"image": png}, headers={"X-API-Key": "s3cret"}).status_code == 200
        assert_error(c.get("/models"), 401)
        assert c.get("/models", headers={"X-API-Key": "s3cret"}).status_code == 200
        for path in ("/healthz", "/readyz", "/metrics"):  # open for probes and scrapers
            assert c.get(path).status_code == 200


def test_unknown_route_and_method_are_json() -> None:
    with make_client(warmup=False) as c:
        assert_error(c.get("/nowhere"), 404)
        assert_error(c.get("/denoise"), 405)


def test_a_broken_model_is_reported_and_the_others_serve(tmp_path, caplog) -> None:
    root = tmp_path / "models"
    shutil.copytree(MODELS, root)
    weights = root / "segment-kglm" / "2" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = b"\x00" * 8
    weights.write_bytes(bytes(data))
    settings = Settings(models_dir=root, device=("cpu",), models=("denoise-kglm", "segment-kglm", "ghost"))
    with caplog.at_level("ERROR", logger="kdeq.service"), TestClient(create_app(settings)) as c:
        c.app.state.service.wait_loaded(120)
        models = {m["id"]: m for m in c.get("/models").json()}
        assert models[served("denoise-kglm")]["ready"]
        broken = models[served("segment-kglm")]
        assert not broken["ready"] and "sha256" in broken["error"]
        assert not models["ghost"]["ready"] and "no model 'ghost'" in models["ghost"]["error"]
        text = c.get("/metrics").text
        assert metric(text, "kdeq_model_ready", model=served("segment-kglm")) == 0
        assert metric(text, "kdeq_model_ready", model=served("denoise-kglm")) == 1
        assert c.get("/readyz").status_code == 200
        assert c.post("/denoise", files={"image": grey_png()[0]}).status_code == 200
        assert_error(c.post("/segment", files={"image": grey_png()[0]}), 404, "no_model")
    assert any(str(weights) in r.getMessage() for r in caplog.records)


def test_not_ready_is_503_with_retry_after(tmp_path) -> None:
    with TestClient(create_app(Settings(models_dir=tmp_path, device=("cpu",)))) as c:
        c.app.state.service.wait_loaded(60)
        assert c.get("/readyz").json() == {"status": "no_models"} and c.get("/readyz").status_code == 503
        assert c.get("/healthz").status_code == 200
    app = create_app(Settings(models_dir=MODELS, device=("cpu",)))
    c = TestClient(app, raise_server_exceptions=False)  # no lifespan: the models never load
    assert c.get("/readyz").status_code == 503 and c.get("/readyz").json() == {"status": "starting"}
    r = c.post("/denoise", files={"image": grey_png()[0]})
    assert_error(r, 503, "not_ready") and r.headers["retry-after"]


def test_png_bytes_are_valid_for_every_output_mode(client: TestClient) -> None:
    for arr in (
        to_uint8(smooth_image(20, 24)),
        to_uint8(np.stack([smooth_image(20, 24, s) for s in range(3)], -1)),
    ):
        r = client.post("/denoise", files={"image": encode(arr)}, data={"sigma": "5"})
        im = Image.open(io.BytesIO(r.content))
        assert im.format == "PNG" and im.size == (24, 20)


# --- the solve's history and the samples -------------------------------------------------------


def test_history_is_returned_on_request_one_residual_per_iteration(client: TestClient) -> None:
    png, _ = grey_png()
    for route, files in (
        ("/denoise", {"image": ("a.png", png, "image/png")}),
        ("/inpaint", {"image": ("a.png", png, "image/png"), "mask": ("m.png", png, "image/png")}),
    ):
        asked = client.post(
            route, files=files, data={"history": "true"}, headers={"Accept": "application/json"}
        )
        assert asked.status_code == 200, asked.text
        solver = asked.json()["solver"]
        assert len(solver["history"]) == solver["iterations"] >= 1, route
        assert all(v > 0 for v in solver["history"])
        # CG (the inpainter's) reports its answer's true residual, recomputed: equal to rounding
        assert min(solver["history"]) == pytest.approx(solver["residual"], rel=1e-3), route
        plain = client.post(route, files=files, headers={"Accept": "application/json"})
        assert plain.json()["solver"]["history"] is None
        assert plain.json()["solver"]["iterations"] == solver["iterations"]  # the same solve
        as_png = client.post(route, files=files, data={"history": "true"})
        assert as_png.status_code == 200 and as_png.headers["content-type"] == "image/png"


@pytest.mark.parametrize("task", sorted(TASKS))
def test_each_tasks_sample_is_a_png_its_route_solves(client: TestClient, task: str) -> None:
    r = client.get(f"/samples/{task}")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    image = Image.open(io.BytesIO(r.content))
    assert image.format == "PNG" and min(image.size) >= 64
    # the deblurrer is told the blur the sample was made with (kdeq.images.samples.sample_images)
    data = {"psf": "gaussian:1.6"} if task == "deblur" else {}
    solved = client.post(TASKS[task].route, files={"image": ("s.png", r.content, "image/png")}, data=data)
    assert solved.status_code == 200, solved.text
    assert client.get(f"/samples/{task}").content == r.content  # made once, the same each time


def test_a_sample_of_no_task_is_a_404(client: TestClient) -> None:
    body = assert_error(client.get("/samples/sharpen"), 404, "not_found")
    assert "denoise" in body["detail"]


def test_lambda_is_in_a_header_as_in_the_json_body(client: TestClient) -> None:
    png, _ = grey_png()
    as_png = client.post("/denoise", files={"image": ("a.png", png, "image/png")}, data={"sigma": "20"})
    as_json = client.post(
        "/denoise",
        files={"image": ("a.png", png, "image/png")},
        data={"sigma": "20"},
        headers={"Accept": "application/json"},
    )
    lam = float(as_png.headers["x-kdeq-lambda"])
    assert lam > 0 and lam == pytest.approx(as_json.json()["lam"], rel=1e-6)
    assert float(as_json.headers["x-kdeq-lambda"]) == lam


def test_uncertainty_comes_in_json_as_the_librarys_map_and_is_refused_where_it_cannot(
    client: TestClient,
) -> None:
    """``uncertainty=true``: the 16-bit PNG times its scale is the map ``solve_batch`` gives the
    same decoded image (itself tested against the dense posterior), the image is the one sent without
    it, and the models and response types that cannot have one are refused before any solve."""
    png, _ = grey_png(24, 32)
    data = {"sigma": "20", "model": "denoise-stationary-kglm"}
    json_accept = {"Accept": "application/json"}
    plain = client.post("/denoise", files={"image": png}, data=data, headers=json_accept).json()
    r = client.post(
        "/denoise", files={"image": png}, data={**data, "uncertainty": "true"}, headers=json_accept
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert plain["uncertainty"] is None and body["image"] == plain["image"]
    u = body["uncertainty"]
    assert not u["exact"] and u["probes"] > 0 and 0 < u["error"] < 0.05
    std = scaledpng.decode(base64.b64decode(u["png"]), u["scale"])
    assert std.shape == (24, 32)
    task = TASKS["denoise"]
    pixels = (np.asarray(decode(png), dtype=np.float32) / 255)[None]
    request = TaskRequest(pixels, task.options(sigma=20.0), uncertainty=True)
    predictor = load_predictor(MODELS / "denoise-stationary-kglm" / "2")
    want = solve_batch(task, predictor, [request])[0].uncertainty.std
    assert np.abs(std - want).max() <= u["scale"] * 0.5 + 1e-6 * want.max()
    models = {m["id"]: m["uncertainty"] for m in client.get("/models").json()}
    assert all(models[served(name)] for name in ("denoise-kglm", "inpaint-kglm", "super-resolve-kglm"))
    assert models[served("segment-kglm")]  # Laplace's approximation
    assert not models[served("deblur-kglm")]  # plug-and-play
    asked = {"psf": "gaussian:1.6", "uncertainty": "true"}
    refused = client.post("/deblur", files={"image": png}, data=asked, headers=json_accept)
    assert "plug-and-play" in assert_error(refused, 422, "uncertainty_unsupported")["detail"]
    as_png = client.post("/denoise", files={"image": png}, data={**data, "uncertainty": "true"})
    assert_error(as_png, 422, "uncertainty_needs_json")
