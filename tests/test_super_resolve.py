"""The super-resolve task (DESIGN §2 fact 8, ``A = S H``): its bicubic prior mean against PIL and an
independent interpolation, the shipped ``super-resolve-kglm`` model against kernel ridge regression with
explicit dense matrices, its consistency and quality, its route and its subcommand.

``BlurSubsample`` itself (against MATLAB's ``imresize`` degradation, its adjoint) is tested in
``tests/test_operators.py``; here the model and the task around it are."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from kdeq.cli import main as kdeq_main
from kdeq.maths.operators import BlurSubsample
from kdeq.maths.psf import bicubic_taps
from kdeq.models.repository import find_model, load_predictor
from kdeq.predictors.base import SolverOverride
from kdeq.predictors.super_resolve import SuperResolver, upsample
from kdeq.registry import TASKS
from kdeq.tasks.base import solve_batch
from service.app import create_app
from service.settings import Settings
from tests.helpers import symmetric_correlation_matrix
from tests.service_helpers import MODELS, ROOT, assert_error, decode, encode, psnr, smooth_image, to_uint8
from tests.tolerances import gamma

BSD68 = ROOT.parent / "shared" / "data" / "BSD68"
TASK = TASKS["super-resolve"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def resolver() -> SuperResolver:
    """The closed-form ``super-resolve-kglm:1``, whose output the tests below derive."""
    predictor = load_predictor(find_model(MODELS, "super-resolve-kglm", 1))
    assert isinstance(predictor, SuperResolver) and predictor.config.architecture.net is None
    return predictor


@pytest.fixture(scope="module")
def served() -> SuperResolver:
    """The latest ``super-resolve-kglm``, the one the service and the CLI load."""
    predictor = load_predictor(find_model(MODELS, "super-resolve-kglm"))
    assert isinstance(predictor, SuperResolver)
    return predictor


def up64(y: np.ndarray, scale: int) -> np.ndarray:
    """``upsample`` of an ``(h, w)`` float64 array."""
    return upsample(torch.from_numpy(y)[None, None], scale)[0, 0].numpy()


def fine_centres(n: int, scale: int) -> np.ndarray:
    """The ``s·n`` finer pixel centres in the coarse grid's coordinates (pixel edges aligned)."""
    return (np.arange(scale * n) + 0.5) / scale - 0.5


def keys(x: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution kernel for ``a = −1/2``, written out piecewise."""
    t = np.abs(x)
    return np.where(
        t <= 1, 1.5 * t**3 - 2.5 * t**2 + 1, np.where(t < 2, -0.5 * t**3 + 2.5 * t**2 - 4 * t + 2, 0.0)
    )


def keys_interpolation(n: int, scale: int) -> np.ndarray:
    """``(s·n, n)``: Keys interpolation at ``fine_centres`` of a signal extended by ``numpy.pad``'s
    ``symmetric`` mode (edge repeated), every coarse sample weighted by ``κ(u − i)``."""
    pad = 3
    extended = np.pad(np.eye(n), ((pad, pad), (0, 0)), mode="symmetric")  # rows: samples −3 … n+2
    positions = np.arange(-pad, n + pad)
    weights = keys(fine_centres(n, scale)[:, None] - positions[None, :])
    return weights @ extended


# ---------------------------------------------------------------------------- the prior mean: bicubic


@pytest.mark.parametrize("size", [(9, 11), (2, 3)])
@pytest.mark.parametrize("scale", [2, 3, 4])
def test_upsample_is_keys_bicubic_with_a_symmetric_border(scale: int, size: tuple[int, int]) -> None:
    h, w = size
    y = np.random.default_rng(scale).random((h, w))
    rows, cols = keys_interpolation(h, scale), keys_interpolation(w, scale)
    np.testing.assert_allclose(up64(y, scale), rows @ y @ cols.T, rtol=0, atol=1e-12)
    # and in float32, in float32
    out = upsample(torch.from_numpy(y).float()[None, None], scale)
    assert out.dtype == torch.float32 and out.shape == (1, 1, h * scale, w * scale)
    # entrywise, the float32 rounding of y, of U's entries and of two products of h and w terms
    # (Higham §3.5) against the magnitudes |U_h||y||U_w|ᵀ, not a fixed 1e-6: ~2e-6 at the largest
    bound = gamma(h + w + 3, np.float32) * (np.abs(rows) @ np.abs(y) @ np.abs(cols).T)
    error = np.abs(out[0, 0].numpy() - rows @ y @ cols.T)
    assert (error <= bound).all(), float((error / bound).max())


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_upsample_equals_pil_bicubic_in_the_interior(scale: int) -> None:
    h, w = 9, 11
    y = np.random.default_rng(10 + scale).random((h, w)).astype(np.float32)
    pil = Image.fromarray(y)
    assert pil.mode == "F"
    expected = np.asarray(pil.resize((scale * w, scale * h), Image.Resampling.BICUBIC), dtype=np.float64)
    out = up64(y.astype(np.float64), scale)
    # PIL renormalises the taps that fall inside the image at the border; both agree once all four
    # taps are inside: 2·s fine pixels from each side
    m = 2 * scale
    np.testing.assert_allclose(out[m:-m, m:-m], expected[m:-m, m:-m], rtol=0, atol=1e-6)
    assert np.abs(out - expected).max() > 1e-3  # (and the border is not PIL's)


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_upsample_reproduces_constants_and_ramps(scale: int) -> None:
    h, w = 8, 10
    i, k = np.meshgrid(np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64), indexing="ij")
    u, v = np.meshgrid(fine_centres(h, scale), fine_centres(w, scale), indexing="ij")
    # a constant everywhere, borders included (the weights sum to 1, the border mirrors)
    np.testing.assert_allclose(up64(np.full((h, w), 0.3), scale), 0.3, rtol=0, atol=1e-14)
    # a linear ramp (and, Keys' a = −1/2 being third-order, a quadratic) exactly in the interior
    m = 2 * scale
    for coarse, fine in [
        (0.1 + 0.05 * i - 0.03 * k, 0.1 + 0.05 * u - 0.03 * v),
        (
            0.2 + 0.01 * i * i - 0.02 * i * k + 0.004 * k * k,
            0.2 + 0.01 * u * u - 0.02 * u * v + 0.004 * v * v,
        ),
    ]:
        np.testing.assert_allclose(up64(coarse, scale)[m:-m, m:-m], fine[m:-m, m:-m], rtol=0, atol=1e-13)


# ---------------------------------------------------------------------------- the model is kernel ridge


def degradation(scale: int) -> BlurSubsample:
    return BlurSubsample(*bicubic_taps(scale, torch.float64), scale, "symmetric")


def degrade(hr: np.ndarray, scale: int) -> np.ndarray:
    """``A f`` of an ``(H, W)`` float64 image."""
    return degradation(scale).forward(torch.from_numpy(hr)[None, None])[0, 0].numpy()


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize(
    ("scale", "h", "w"),
    # the last: a 4×6 output, narrower than the kernel's radius (its border mirrors periodically)
    [(2, 6, 7), (3, 6, 7), (2, 2, 3)],
    ids=["x2", "x3", "x2-narrow"],
)
def test_super_resolver_is_kernel_ridge_regression_through_the_degradation(
    resolver: SuperResolver, scale: int, h: int, w: int, channels: int
) -> None:
    hh, ww = scale * h, scale * w
    assert resolver.config.architecture.padding == "symmetric" and resolver.config.mean == "interpolated"
    K = symmetric_correlation_matrix(resolver.tensors["w1"][0, 0].double().numpy(), hh, ww)
    np.testing.assert_allclose(K, K.T, atol=1e-12)
    assert np.linalg.eigvalsh(K).min() > 0
    A = degradation(scale).dense(hh, ww).numpy()
    lam = resolver.config.lam.value
    # low-resolution images: smooth ones degraded, plus a little noise; one per channel
    y = np.stack([degrade(smooth_image(hh, ww, seed=k), scale) for k in range(channels)])
    y = (y + 0.01 * np.random.default_rng(scale).standard_normal(y.shape)).astype(np.float32)
    prediction = resolver.predict(torch.from_numpy(y)[None], scale=scale, solver=SolverOverride(tol=1e-6))
    assert prediction.output.shape == (1, channels, hh, ww)
    assert prediction.lam.item() == pytest.approx(lam, rel=1e-6)
    assert bool(prediction.stats.converged.all())
    gram = A @ K @ A.T + lam * np.eye(h * w)
    for k in range(channels):
        yk = y[k].astype(np.float64)
        m = up64(yk, scale).reshape(-1)
        expected = m + K @ A.T @ np.linalg.solve(gram, yk.reshape(-1) - A @ m)
        # the float32 floor: the readout K Aᵀ(y − z)/λ divides z's rounding (~3e-8) by λ = 1e-3
        np.testing.assert_allclose(prediction.output[0, k].double().numpy().reshape(-1), expected, atol=1e-4)


@pytest.mark.parametrize("size", [8, 24])
def test_the_warm_up_request_is_solved_at_every_warm_up_size(
    resolver: SuperResolver, served: SuperResolver, size: int
) -> None:
    request = TASK.warmup(size)
    for model in (resolver, served):
        (solved,) = solve_batch(TASK, model, [request])
        assert solved.output.shape == (1, *TASK.output_size(request)) and solved.finite and solved.converged


def test_a_constant_image_enlarges_to_the_constant(resolver: SuperResolver) -> None:
    image = torch.full((1, 3, 5, 7), 0.625)
    for scale in (2, 3, 4):
        out = resolver.predict(image, scale=scale).output
        torch.testing.assert_close(out, torch.full((1, 3, 5 * scale, 7 * scale), 0.625), rtol=0, atol=1e-6)


def test_the_output_reproduces_the_observations_up_to_the_shrinkage(resolver: SuperResolver) -> None:
    for scale in (2, 3, 4):
        hr = smooth_image(24 * scale, 20 * scale, seed=scale)
        y = degrade(hr, scale)
        f = (
            resolver.predict(torch.from_numpy(y).float()[None, None], scale=scale)
            .output[0, 0]
            .double()
            .numpy()
        )
        bicubic = np.linalg.norm(degrade(up64(y, scale), scale) - y)
        # A f − y = −λ (A K Aᵀ + λI)⁻¹ (y − A m): a small part of the bicubic mean's mismatch
        assert np.linalg.norm(degrade(f, scale) - y) < 0.05 * bicubic


@pytest.mark.skipif(not BSD68.is_dir(), reason="needs ../shared/data/BSD68")
@pytest.mark.parametrize("name", ["test001.png", "test003.png"])
def test_super_resolving_a_photo_beats_bicubic(
    resolver: SuperResolver, served: SuperResolver, name: str
) -> None:
    """The closed form by 0.3 dB at ×2 (the issue's target for it), the served model by more."""
    with Image.open(BSD68 / name) as im:
        photo = np.asarray(im.convert("L"), dtype=np.float64) / 255.0
    h, w = photo.shape
    hr = photo[h // 2 - 48 : h // 2 + 48, w // 2 - 48 : w // 2 + 48]
    y = degrade(hr, 2)

    def score(x: np.ndarray) -> float:
        return psnr(np.clip(x, 0, 1)[2:-2, 2:-2], hr[2:-2, 2:-2])

    scores = []
    for model in (resolver, served):
        prediction = model.predict(torch.from_numpy(y).float()[None, None], scale=2)
        assert bool(prediction.stats.converged.all())
        scores.append(score(prediction.output[0, 0].double().numpy()))
    assert scores[0] >= score(up64(y, 2)) + 0.3
    assert scores[1] >= scores[0]


# ---------------------------------------------------------------------------- the task and its route


def make_client(**overrides: object) -> TestClient:
    settings = Settings(
        models_dir=MODELS, device=("cpu",), models=("super-resolve-kglm",), warmup=False, **overrides
    )
    return TestClient(create_app(settings), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with make_client() as c:
        assert c.app.state.service.wait_loaded(120)
        yield c


@pytest.fixture(scope="module")
def small() -> np.ndarray:
    """A grey uint8 image ``(14, 18)``."""
    return to_uint8(degrade(smooth_image(28, 36), 2))


def test_super_resolve_route_enlarges_by_the_scale(
    client: TestClient, served: SuperResolver, small: np.ndarray
) -> None:
    r = client.post(
        "/super-resolve",
        files={"image": encode(small)},
        data={"scale": "3"},
        headers={"Accept": "application/json"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["width"], body["height"]) == (54, 42)
    out = decode(base64.b64decode(body["image"]))
    assert out.size == (54, 42) and out.mode == "L"
    # the model's own output, in 8 bits
    expected = served.predict(torch.from_numpy(small / 255.0)[None, None].float(), scale=3).output
    assert np.abs(np.asarray(out).astype(int) - to_uint8(expected[0, 0].double().numpy())).max() <= 1
    # the default scale is 2; PNG by default
    r = client.post("/super-resolve", files={"image": encode(small)})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert decode(r.content).size == (36, 28)


@pytest.mark.parametrize("scale", ["5", "1", "0"])
def test_a_scale_outside_two_to_four_is_refused(client: TestClient, small: np.ndarray, scale: str) -> None:
    r = client.post("/super-resolve", files={"image": encode(small)}, data={"scale": scale})
    assert_error(r, 422, "invalid_option")


def test_the_pixel_limit_applies_to_the_output(small: np.ndarray) -> None:
    with make_client(max_pixels=1000) as c:
        assert c.app.state.service.wait_loaded(120)
        # 14×18 = 252 pixels in: 1008 out at ×2, 2268 at ×3; 10×12 = 120 in: 480 out at ×2
        assert_error(c.post("/super-resolve", files={"image": encode(small)}), 413, "too_many_pixels")
        r = c.post("/super-resolve", files={"image": encode(small[:10, :12].copy())}, data={"scale": "2"})
        assert r.status_code == 200, r.text
        assert decode(r.content).size == (24, 20)
        r = c.post("/super-resolve", files={"image": encode(small[:10, :12].copy())}, data={"scale": "3"})
        assert_error(r, 413, "too_many_pixels")


def test_an_rgba_image_keeps_an_alpha_of_the_outputs_size(client: TestClient, small: np.ndarray) -> None:
    alpha = np.linspace(0, 255, small.size).reshape(small.shape).astype(np.uint8)
    rgba = np.stack([small, small[::-1], 255 - small, alpha], axis=-1)
    r = client.post(
        "/super-resolve", files={"image": encode(Image.fromarray(rgba, "RGBA"))}, data={"scale": "2"}
    )
    assert r.status_code == 200, r.text
    out = decode(r.content)
    assert out.mode == "RGBA" and out.size == (36, 28)
    np.testing.assert_array_equal(np.asarray(out)[..., 3], alpha.repeat(2, axis=0).repeat(2, axis=1))


def test_requests_share_a_batch_only_with_the_same_scale(small: np.ndarray) -> None:
    image = (small / 255.0).astype(np.float32)[None]

    def key(scale: int) -> object:
        return TASK.batch_key(TASK.prepare(image, None, TASK.options(scale=scale), {}))

    assert key(2) == key(2) and key(2) != key(3) != key(4)


# ---------------------------------------------------------------------------- the subcommand


@pytest.mark.parametrize("colour", [False, True])
def test_super_resolve_subcommand_writes_a_png_twice_the_size(
    tmp_path: Path, small: np.ndarray, capsys: pytest.CaptureFixture[str], colour: bool
) -> None:
    source, out = tmp_path / "in.png", tmp_path / "out.png"
    Image.fromarray(np.stack([small, small[::-1], 255 - small], axis=-1) if colour else small).save(source)
    args = ["super-resolve", str(source), "-o", str(out), "--models-dir", str(MODELS), "--scale", "2"]
    assert kdeq_main(args) == 0
    assert "converged True" in capsys.readouterr().out
    with Image.open(out) as im:
        assert im.size == (36, 28) and im.mode == ("RGB" if colour else "L")
    with pytest.raises(SystemExit) as refused:  # argparse's choices
        kdeq_main([*args[:-1], "5"])
    assert refused.value.code == 2
