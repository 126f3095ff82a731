"""The deblur task (DESIGN §2 fact 8, ``A = H``): the shipped ``deblur-kglm`` model against kernel ridge
regression with explicit dense matrices, its noise estimate, its quality, its route and its subcommand.

The operators themselves (``Blur`` against dense convolutions, its adjoint, ``solve_observed`` against
sklearn) are tested in ``tests/test_operators.py``; here the model and the task around them are."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from scipy import ndimage

from kdeq.cli import main as kdeq_main
from kdeq.maths.adaptive import guided_gram
from kdeq.maths.noise import haar_sigma
from kdeq.maths.operators import Blur
from kdeq.maths.psf import MAX_PSF_SIDE, parse_psf
from kdeq.models.repository import find_model, load_predictor
from kdeq.predictors.base import SolverOverride
from kdeq.predictors.deblur import Deblurrer
from kdeq.registry import TASKS
from kdeq.tasks.base import Request, solve_batch
from service.app import create_app
from service.settings import Settings
from tests.helpers import symmetric_correlation_matrix
from tests.service_helpers import MODELS, ROOT, assert_error, decode, encode, psnr, smooth_image, to_uint8

BSD68 = ROOT.parent / "shared" / "data" / "BSD68"
TASK = TASKS["deblur"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return find_model(MODELS, "deblur-kglm")


@pytest.fixture(scope="module")
def deblurrer(model_dir: Path) -> Deblurrer:
    predictor = load_predictor(model_dir)
    assert isinstance(predictor, Deblurrer)
    return predictor


@pytest.fixture(scope="module")
def stationary_dir() -> Path:
    """``deblur-kglm:1``, the stationary model (the default, version 3, is the plug-and-play one)."""
    return find_model(MODELS, "deblur-kglm", 1)


@pytest.fixture(scope="module")
def guided_dir() -> Path:
    """``deblur-kglm:2``, the adaptive kernel in closed form."""
    return find_model(MODELS, "deblur-kglm", 2)


@pytest.fixture(scope="module")
def guided(guided_dir: Path) -> Deblurrer:
    predictor = load_predictor(guided_dir)
    assert isinstance(predictor, Deblurrer) and predictor.guided
    return predictor


@pytest.fixture(scope="module")
def stationary(stationary_dir: Path) -> Deblurrer:
    predictor = load_predictor(stationary_dir)
    assert isinstance(predictor, Deblurrer) and not predictor.guided
    return predictor


def blurred(clean: np.ndarray, psf: np.ndarray, sigma: float, seed: int) -> np.ndarray:
    """``clean`` ``(H, W)`` convolved with ``psf`` under a symmetric border (scipy's ``reflect``), plus
    Gaussian noise of ``sigma`` on the 0–255 scale; float64."""
    rng = np.random.default_rng(seed)
    out = ndimage.convolve(clean, psf.astype(np.float64), mode="reflect")
    return out + sigma / 255.0 * rng.standard_normal(clean.shape)


def lopsided_psf() -> torch.Tensor:
    """A 5×7 PSF that no flip or transpose maps onto itself: a spot with a tail right, up and down-left."""
    psf = torch.zeros(5, 7)
    psf[2, 3], psf[2, 4:7], psf[0:2, 3], psf[4, 1] = 8.0, 3.0, 2.0, 1.0
    return psf / psf.sum()


# ---------------------------------------------------------------------------- the model is kernel ridge


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize(
    ("psf_name", "size", "transform"),
    [
        # an axis-even PSF, symmetric borders and an image at least as large as h*k*h's radius: the DCT
        ("gaussian:1.6", (22, 24), True),
        # an oblique motion is not axis-even: CG (and a 12×13 image, the smallest the 25-tap kernel takes)
        ("motion:7,30", (12, 13), False),
        # nor one that is not point-symmetric (nor square), where H's orientation shows
        ("lopsided", (12, 13), False),
        # an image narrower than the kernel's radius: its border mirrors periodically (period 2N)
        ("gaussian:1.6", (5, 7), False),
    ],
    ids=["gaussian-dct", "motion-cg", "lopsided-cg", "narrow-cg"],
)
def test_deblurrer_is_kernel_ridge_regression_through_the_blur(
    stationary: Deblurrer,
    stationary_dir: Path,
    psf_name: str,
    size: tuple[int, int],
    transform: bool,
    channels: int,
) -> None:
    h, w = size
    n = h * w
    config = json.loads((stationary_dir / "config.json").read_text())
    assert config["architecture"]["padding"] == "symmetric" and config["mean"] == "global"
    w1 = stationary.tensors["w1"][0, 0].double().numpy()
    K = symmetric_correlation_matrix(w1, h, w)
    # a kernel: symmetric, positive definite
    np.testing.assert_allclose(K, K.T, atol=1e-12)
    assert np.linalg.eigvalsh(K).min() > 0
    psf = lopsided_psf() if psf_name == "lopsided" else parse_psf(psf_name)
    H = Blur(psf.double(), "symmetric").dense(h, w).numpy()
    sigma = 5.0
    lam = (sigma / 255.0) ** 2 / config["lam"]["signal_variance"]
    # smooth images (a different one per channel), blurred by the dense H, plus noise of sigma
    y = np.stack([H @ smooth_image(h, w, seed=k).reshape(-1) for k in range(channels)])
    y = y + sigma / 255.0 * np.random.default_rng(1).standard_normal(y.shape)
    tight = None if transform else SolverOverride(tol=1e-6)
    prediction = stationary.predict(
        torch.from_numpy(y.reshape(1, channels, h, w)).float(), psf, sigma=sigma, solver=tight
    )
    assert prediction.lam.item() == pytest.approx(lam, rel=1e-6)
    assert prediction.sigma.item() == pytest.approx(sigma, rel=1e-6)
    assert bool(prediction.stats.converged.all())
    iterations = prediction.stats.iterations.item()
    assert iterations == 0 if transform else iterations > 0
    f = prediction.output[0].double().numpy().reshape(channels, n)
    y32 = y.astype(np.float32).astype(np.float64)  # what the model saw
    gram = H @ K @ H.T + lam * np.eye(n)
    for k in range(channels):
        m = np.full(n, y32[k].mean())
        expected = m + K @ H.T @ np.linalg.solve(gram, y32[k] - H @ m)
        np.testing.assert_allclose(f[k], expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("psf_name", ["gaussian:1.6", "motion:7,30"])
def test_the_guided_deblurrer_is_kernel_ridge_regression_twice(
    guided: Deblurrer, guided_dir: Path, psf_name: str
) -> None:
    """Version 2: the pilot is kernel ridge regression with the flat guide's kernel ``k_s/Σk_s``
    (symmetric border), and the output kernel ridge regression with the dense adaptive Gram
    ``D^{-1/2} K D^{-1/2}`` of the pilot (``kdeq.maths.adaptive.guided_gram``, explicit patch features),
    with its local average ``D⁻¹K p`` as the mean."""
    deblurrer = guided
    config = json.loads((guided_dir / "config.json").read_text())
    kern = config["architecture"]["kernel"]
    h, w, sigma = 14, 15, 5.0
    n = h * w
    spatial = deblurrer.tensors["spatial"].double()
    psf = parse_psf(psf_name)
    H = Blur(psf.double(), "symmetric").dense(h, w).numpy()
    lam = (sigma / 255.0) ** 2 / config["lam"]["signal_variance"]
    clean = (smooth_image(h, w, seed=3) > 0.5).astype(np.float64) * 0.6 + 0.2  # edges to follow
    y = H @ clean.reshape(-1) + sigma / 255.0 * np.random.default_rng(2).standard_normal(n)
    y32 = y.astype(np.float32).astype(np.float64)
    prediction = deblurrer.predict(
        torch.from_numpy(y32.reshape(1, 1, h, w)).float(), psf, sigma=sigma, solver=SolverOverride(tol=1e-7)
    )
    assert bool(prediction.stats.converged.all())
    flat = symmetric_correlation_matrix((spatial / spatial.sum()).numpy(), h, w)
    m0 = np.full(n, y32.mean())
    pilot = m0 + flat @ H.T @ np.linalg.solve(H @ flat @ H.T + lam * np.eye(n), y32 - H @ m0)
    np.testing.assert_allclose(prediction.pilot[0, 0].double().numpy().reshape(-1), pilot, atol=2e-5)
    guide = torch.from_numpy(pilot.reshape(1, h, w))
    h2 = (kern["bandwidth"] ** 2 * 2 * (2 * kern["patch_radius"] + 1) ** 2) * haar_sigma(guide[None]) ** 2
    K = guided_gram(guide, spatial, kern["patch_radius"], float(h2), normalize=True).numpy()
    raw = guided_gram(guide, spatial, kern["patch_radius"], float(h2), normalize=False).numpy()
    np.testing.assert_allclose(K, K.T, atol=1e-12)
    assert np.linalg.eigvalsh(K).min() > -1e-12
    m = raw @ pilot / raw.sum(axis=1)
    expected = m + K @ H.T @ np.linalg.solve(H @ K @ H.T + lam * np.eye(n), y32 - H @ m)
    np.testing.assert_allclose(prediction.output[0, 0].double().numpy().reshape(-1), expected, atol=1e-4)


def test_the_guided_deblurrer_beats_its_stationary_pilot_on_edges(
    guided: Deblurrer, stationary: Deblurrer
) -> None:
    clean = (smooth_image(64, 64, seed=5) > 0.5).astype(np.float64) * 0.6 + 0.2
    psf = parse_psf("gaussian:1.6")
    y = blurred(clean, psf.numpy(), 2.55, seed=0)
    x = torch.from_numpy(y[None, None]).float()
    adaptive = psnr(guided.predict(x, psf, sigma=2.55).output[0, 0].clamp(0, 1).double().numpy(), clean)
    plain = psnr(stationary.predict(x, psf, sigma=2.55).output[0, 0].clamp(0, 1).double().numpy(), clean)
    assert adaptive > plain + 0.5, (adaptive, plain)


@pytest.mark.parametrize("size", [8, 24])
def test_the_warm_up_request_is_solved_at_every_warm_up_size(deblurrer: Deblurrer, size: int) -> None:
    # 8 is the smallest size the service's warm-up takes, below the kernel's radius of 12
    (solved,) = solve_batch(TASK, deblurrer, [TASK.warmup(size)])
    assert solved.output.shape == (1, size, size) and solved.finite and solved.converged


@pytest.mark.parametrize("version", ["stationary", "guided"])
def test_a_constant_image_is_its_own_deblurring(request: pytest.FixtureRequest, version: str) -> None:
    # H m = m for a constant m (the PSF sums to 1, the border mirrors): nothing is left to correct
    # (the kGLM versions; the plug-and-play one returns its prior's denoising of the constant)
    deblurrer = request.getfixturevalue(version)
    image = torch.full((1, 3, 16, 18), 0.375)
    for name in ("gaussian:1.6", "motion:9,20"):
        out = deblurrer.predict(image, parse_psf(name), sigma=2.0).output
        torch.testing.assert_close(out, image, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- noise level and quality


def test_the_estimated_noise_level_is_each_images_own(deblurrer: Deblurrer, model_dir: Path) -> None:
    psf = parse_psf("gaussian:1.6")
    levels = (10.0, 4.0, 25.0)
    images = np.stack(
        [blurred(smooth_image(64, 64, seed=k), psf.numpy(), s, k) for k, s in enumerate(levels)]
    )
    prediction = deblurrer.predict(torch.from_numpy(images[:, None]).float(), psf)
    estimated = prediction.sigma.numpy()
    np.testing.assert_allclose(estimated, levels, rtol=0.15)
    # λ follows the checkpoint's rule at each sample's own estimate
    variance = json.loads((model_dir / "config.json").read_text())["lam"]["signal_variance"]
    np.testing.assert_allclose(prediction.lam.numpy(), (estimated / 255.0) ** 2 / variance, rtol=1e-5)


def deblurring_gain(deblurrer: Deblurrer, clean: np.ndarray, sigma: float | None) -> float:
    """PSNR(deblurred) − PSNR(blurred) for ``clean`` blurred by gaussian:1.6 with noise of 2.55."""
    psf = parse_psf("gaussian:1.6")
    observed = blurred(clean, psf.numpy(), 2.55, seed=7)
    prediction = deblurrer.predict(torch.from_numpy(observed)[None, None].float(), psf, sigma=sigma)
    assert bool(prediction.stats.converged.all())
    restored = np.clip(prediction.output[0, 0].double().numpy(), 0, 1)
    return psnr(restored, clean) - psnr(np.clip(observed, 0, 1), clean)


@pytest.mark.parametrize("sigma", [2.55, None])
def test_deblurring_a_synthetic_image_gains_over_a_decibel(deblurrer: Deblurrer, sigma: float | None) -> None:
    assert deblurring_gain(deblurrer, smooth_image(64, 64), sigma) > 1.0


@pytest.mark.skipif(not BSD68.is_dir(), reason="needs ../shared/data/BSD68")
@pytest.mark.parametrize("name", ["test001.png", "test002.png", "test003.png"])
def test_deblurring_a_photo_gains_over_a_decibel(deblurrer: Deblurrer, name: str) -> None:
    with Image.open(BSD68 / name) as im:
        photo = np.asarray(im.convert("L"), dtype=np.float64) / 255.0
    h, w = photo.shape
    crop = photo[h // 2 - 48 : h // 2 + 48, w // 2 - 48 : w // 2 + 48]
    assert deblurring_gain(deblurrer, crop, 2.55) > 1.0


# ---------------------------------------------------------------------------- the task and its route


def png(array: np.ndarray) -> bytes:
    """A uint8 ``(H, W)`` or ``(H, W, c)`` array as PNG bytes."""
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def psf_png(psf: np.ndarray) -> bytes:
    """A PSF as an 8-bit grey PNG, its peak at 255."""
    return png(np.round(psf / psf.max() * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    # the default (version 3, plug-and-play) first, the stationary version 1 beside it
    models = ("deblur-kglm:3", "deblur-kglm:1")
    settings = Settings(models_dir=MODELS, device=("cpu",), models=models, warmup=False)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        assert c.app.state.service.wait_loaded(120)
        yield c


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    """A blurred, slightly noisy grey image ``(40, 48)`` as uint8."""
    psf = parse_psf("gaussian:1.6").numpy()
    return to_uint8(blurred(smooth_image(40, 48), psf, 2.55, seed=3))


def test_deblur_route_answers_with_the_models_own_output(
    client: TestClient, deblurrer: Deblurrer, photo: np.ndarray
) -> None:
    r = client.post("/deblur", files={"image": encode(photo)}, data={"psf": "gaussian:1.6"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png"
    out = np.asarray(decode(r.content))
    assert out.shape == photo.shape
    # the estimated level is reported, and is the one the model estimates itself
    expected = deblurrer.predict(
        torch.from_numpy(photo / 255.0)[None, None].float(), parse_psf("gaussian:1.6")
    )
    assert float(r.headers["X-KDEQ-Sigma"]) == pytest.approx(expected.sigma.item(), abs=1e-3)
    reference = to_uint8(expected.output[0, 0].double().numpy())
    assert np.abs(out.astype(int) - reference).max() <= 1
    # a given level is used as given, and reported in the JSON body too
    r = client.post(
        "/deblur",
        files={"image": encode(photo)},
        data={"psf": "gaussian:1.6", "sigma": "2.55"},
        headers={"Accept": "application/json"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["sigma"] == pytest.approx(2.55) and r.headers["X-KDEQ-Sigma"] == "2.550"
    assert (body["width"], body["height"]) == (48, 40)


def test_an_uploaded_psf_equal_to_the_named_one_deblurs_alike(client: TestClient, photo: np.ndarray) -> None:
    named = client.post("/deblur", files={"image": encode(photo)}, data={"psf": "gaussian:1.6", "sigma": "3"})
    upload = psf_png(parse_psf("gaussian:1.6").numpy())
    uploaded = client.post(
        "/deblur", files={"image": encode(photo), "psf_image": upload}, data={"sigma": "3"}
    )
    assert named.status_code == uploaded.status_code == 200, (named.text, uploaded.text)
    a = np.asarray(decode(named.content)).astype(int)
    b = np.asarray(decode(uploaded.content)).astype(int)
    # the upload is the named PSF rounded to 8 bits (its faintest taps lost): nearly the same output
    assert np.abs(a - b).max() <= 2 and np.abs(a - b).mean() < 0.3


def test_an_uploaded_psf_is_applied_the_right_way_round(
    client: TestClient, deblurrer: Deblurrer, photo: np.ndarray
) -> None:
    # as an 8-bit image exactly (peak 8 → 255 is not exact, so the PNG holds 32·k and is read back as is)
    psf = lopsided_psf().numpy()
    upload = np.round(psf / psf.max() * 256).clip(0, 255).astype(np.uint8)
    r = client.post("/deblur", files={"image": encode(photo), "psf_image": png(upload)}, data={"sigma": "3"})
    assert r.status_code == 200, r.text
    out = np.asarray(decode(r.content)).astype(int)
    image = torch.from_numpy(photo / 255.0)[None, None].float()

    def deblurred(h: np.ndarray) -> np.ndarray:
        return to_uint8(
            deblurrer.predict(image, torch.from_numpy(h / h.sum()), sigma=3.0).output[0, 0].numpy()
        )

    assert np.abs(out - deblurred(upload.astype(np.float64))).max() <= 1
    # a flip or a transpose of the upload would have changed the result
    for wrong in (upload[::-1, ::-1], upload[::-1], upload[:, ::-1]):
        assert np.abs(out - deblurred(wrong.astype(np.float64))).max() > 5


def test_a_colour_image_deblurs_channel_by_channel_to_its_size(client: TestClient, photo: np.ndarray) -> None:
    colour = np.stack([photo, photo[::-1], 255 - photo], axis=-1)
    r = client.post("/deblur", files={"image": encode(colour)}, data={"psf": "motion:5,45", "sigma": "3"})
    assert r.status_code == 200 and r.headers["X-KDEQ-Model"] == "deblur-kglm:3", r.text
    assert decode(r.content).mode == "RGB" and decode(r.content).size == (48, 40)
    # the stationary model: one kernel on every channel alike, no mixing, so each channel is that
    # channel deblurred alone (the guided one's kernel follows all three channels' edges)
    data = {"psf": "motion:5,45", "sigma": "3", "model": "deblur-kglm:1"}
    r = client.post("/deblur", files={"image": encode(colour)}, data=data)
    assert r.status_code == 200, r.text
    out = decode(r.content)
    assert out.mode == "RGB" and out.size == (48, 40)
    for k in range(3):
        alone = client.post("/deblur", files={"image": encode(colour[..., k].copy())}, data=data)
        assert alone.status_code == 200, alone.text
        grey = np.asarray(decode(alone.content)).astype(int)
        assert np.abs(np.asarray(out)[..., k].astype(int) - grey).max() <= 1


def zeros_psf(side: int) -> np.ndarray:
    return np.zeros((side, side), dtype=np.uint8)


def impulse_psf(h: int, w: int) -> np.ndarray:
    out = np.zeros((h, w), dtype=np.uint8)
    out[h // 2, w // 2] = 255
    return out


@pytest.mark.parametrize(
    ("data", "psf_image", "status", "error"),
    [
        ({}, None, 400, "psf_required"),
        ({"psf": "gaussian:1.6"}, impulse_psf(3, 3), 422, "psf_twice"),
        ({"psf": "blob:3"}, None, 422, "invalid_psf"),
        ({"psf": "gaussian:0"}, None, 422, "invalid_psf"),
        ({"psf": "gaussian:11"}, None, 422, "invalid_psf"),  # a 67×67 PSF
        ({}, impulse_psf(4, 5), 422, "invalid_psf"),
        ({}, impulse_psf(MAX_PSF_SIDE + 2, MAX_PSF_SIDE + 2), 422, "invalid_psf"),
        ({}, zeros_psf(5), 422, "invalid_psf"),
    ],
    ids=["neither", "both", "unknown-name", "zero-width", "too-wide", "even-sides", "65x65", "all-zero"],
)
def test_psf_errors(
    client: TestClient,
    photo: np.ndarray,
    data: dict[str, str],
    psf_image: np.ndarray | None,
    status: int,
    error: str,
) -> None:
    files = {"image": encode(photo)}
    if psf_image is not None:
        files["psf_image"] = png(psf_image)
    assert_error(client.post("/deblur", files=files, data=data), status, error)


def test_requests_share_a_batch_only_with_the_same_psf(photo: np.ndarray) -> None:
    image = (photo / 255.0).astype(np.float32)[None]

    def request(
        psf: str | None = None, upload: np.ndarray | None = None, sigma: float | None = None
    ) -> Request:
        files = {} if upload is None else {"psf_image": upload}
        return TASK.prepare(image, None, TASK.options(psf=psf, sigma=sigma), files)

    same = TASK.batch_key(request("gaussian:1.6"))
    assert TASK.batch_key(request("gaussian:1.6")) == same
    assert TASK.batch_key(request("gaussian:1.60")) == same  # the PSF is the key, not its spelling
    assert TASK.batch_key(request("gaussian:1.7")) != same
    assert TASK.batch_key(request("motion:7,30")) != TASK.batch_key(request("motion:7,-30"))
    # given levels may differ within a batch (σ is per sample), but not given and estimated ones
    assert TASK.batch_key(request("gaussian:1.6", sigma=2)) == TASK.batch_key(
        request("gaussian:1.6", sigma=9)
    )
    assert TASK.batch_key(request("gaussian:1.6", sigma=2)) != same
    # an uploaded PSF: its values, normalised, are the key
    blob = np.array([[0, 1, 0], [1, 4, 1], [0, 1, 0]], dtype=np.float32)[None]
    assert TASK.batch_key(request(upload=blob)) == TASK.batch_key(request(upload=2 * blob))
    assert TASK.batch_key(request(upload=blob)) != TASK.batch_key(request(upload=blob**2))


def test_a_batch_of_two_psf_requests_is_solved_as_each_alone(deblurrer: Deblurrer, photo: np.ndarray) -> None:
    image = (photo / 255.0).astype(np.float32)[None]
    requests = [TASK.prepare(image, None, TASK.options(psf="disk:2.5", sigma=s), {}) for s in (2.0, 12.0)]
    assert TASK.batch_key(requests[0]) == TASK.batch_key(requests[1])
    together = solve_batch(TASK, deblurrer, requests)
    for request, solved in zip(requests, together, strict=True):
        alone = solve_batch(TASK, deblurrer, [request])[0]
        assert solved.fields["sigma"] == pytest.approx(request.options.sigma)
        np.testing.assert_allclose(solved.output, alone.output, atol=1e-5)
    assert np.abs(together[0].output - together[1].output).max() > 0.01


# ---------------------------------------------------------------------------- the subcommand


@pytest.mark.parametrize("colour", [False, True])
def test_deblur_subcommand_writes_a_png_of_the_inputs_size(
    tmp_path: Path, photo: np.ndarray, capsys: pytest.CaptureFixture[str], colour: bool
) -> None:
    source = tmp_path / "in.png"
    Image.fromarray(np.stack([photo, photo[::-1], 255 - photo], axis=-1) if colour else photo).save(source)
    psf = tmp_path / "psf.png"
    psf.write_bytes(psf_png(parse_psf("gaussian:1.6").numpy()))
    common = [str(source), "--models-dir", str(MODELS)]
    for extra in (["--psf", "gaussian:1.6"], ["--psf-image", str(psf)]):
        out = tmp_path / "out.png"
        assert kdeq_main(["deblur", *common, "-o", str(out), *extra]) == 0
        assert "converged True" in capsys.readouterr().out
        with Image.open(out) as im:
            assert im.size == (48, 40) and im.mode == ("RGB" if colour else "L")
        out.unlink()
    # neither or both: an error, no output
    assert kdeq_main(["deblur", *common, "-o", str(tmp_path / "x.png")]) == 2
    assert (
        kdeq_main(
            ["deblur", *common, "-o", str(tmp_path / "x.png"), "--psf", "disk:2", "--psf-image", str(psf)]
        )
        == 2
    )
    assert "psf" in capsys.readouterr().err and not (tmp_path / "x.png").exists()
