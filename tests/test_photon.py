"""The photon-count denoiser (``kdeq.predictors.photon``, task ``denoise-poisson``): its equilibrium against
Newton on the same Poisson kGLM, convergence from 0.5 to 100 photons, the Anscombe inverse against the
exact expectation, its Laplace map against the dense covariance, and counts read as stored from
8- and 16-bit files by the service and the command line."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from kdeq.cli import main
from kdeq.images.samples import sample_images
from kdeq.maths.families import Poisson
from kdeq.maths.priors import GaussianPrior
from kdeq.maths.reference import newton_kglm
from kdeq.models.checkpoint import Checkpoint, load_checkpoint
from kdeq.models.repository import find_model, load_predictor
from kdeq.predictors.base import SolverOverride
from kdeq.predictors.denoise import Denoiser
from kdeq.predictors.photon import RATE_FLOOR, PhotonDenoiser, anscombe, inverse_anscombe
from kdeq.predictors.uncertainty import posterior
from service.app import create_app
from service.settings import Settings
from tests.service_helpers import assert_error, encode

MODELS = Path(__file__).resolve().parents[1] / "models"
F64 = torch.float64


@pytest.fixture(scope="module")
def model() -> PhotonDenoiser:
    """The version the service serves (the latest)."""
    return load_predictor(find_model(MODELS, "denoise-poisson-kglm"))


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["closed-form", "fine-tuned", "fine-tuned-longer"])
def each(request: pytest.FixtureRequest) -> PhotonDenoiser:
    """Each shipped version: the closed form and the two fine-tuned ones with a guide network."""
    return load_predictor(find_model(MODELS, "denoise-poisson-kglm", request.param))


def clean(size: int = 24) -> torch.Tensor:
    """A grey ``(1, 1, size, size)`` crop of the generated photo, in [0, 1]."""
    photo = sample_images()["photo"].mean(dim=0, keepdim=True)
    return photo[None, :, 60 : 60 + size, 100 : 100 + size]


def counts(x: torch.Tensor, peak: float, seed: int = 0) -> torch.Tensor:
    return torch.poisson(peak * x, generator=torch.Generator().manual_seed(seed))


def dense(apply, n: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The ``n × n`` matrix of the linear map ``apply`` on images of ``shape``, column by column."""
    eye = torch.eye(n, dtype=F64).reshape(n, *shape[1:])
    return torch.cat([apply(eye[k : k + 1]).reshape(1, n) for k in range(n)]).T


def test_equilibrium_is_the_poisson_kglm_minimiser(each: PhotonDenoiser) -> None:
    """The DEQ's rate ``r̂ = e^{η̃}`` against ``exp(Kα + m)`` with ``α`` from Newton (IRLS with a line
    search, ``kdeq.maths.reference``) on ``Σ [e^η − yη] + (λ/2)αᵀKα``, ``K`` the model's adaptive kernel as a
    dense matrix and ``m`` its mean (the kernel's local average of the counts, mixed with the guide
    network's rate by ``β`` where there is one), at a low and a high light level."""
    model = each
    x = clean(12)
    for peak in (2.0, 40.0):
        y = counts(x, peak)
        got = model.predict(y, peak=peak, solver=SolverOverride(tol=1e-7, max_iter=500))
        assert bool(got.stats.converged[0])
        rate = got.output.double() * peak
        with torch.inference_mode():
            u, s_u, _ = model.stabilised(y)
            op, _ = model.guided_operator(u, s_u)
            local = (op.kernel(y) / op.degree).double()
        if got.pilot is not None:
            beta = float(model.tensors["net_mean_mix"])
            local = beta * got.pilot.double() * peak + (1 - beta) * local
        gram = dense(lambda v, op=op: op(v.float()).double(), x.numel(), tuple(x.shape))
        mean = torch.log(local.clamp(min=RATE_FLOOR)).reshape(1, -1)
        lam = float(got.lam[0])
        family = Poisson(eta_max=math.log(float(y.max())) + 3)
        alpha = newton_kglm(family, GaussianPrior(), gram, y.double().reshape(1, -1), lam, mean)
        want = torch.exp(alpha @ gram + mean).reshape(rate.shape)
        torch.testing.assert_close(rate, want, rtol=2e-4, atol=2e-4 * peak)


@pytest.mark.parametrize("peak", [0.5, 1.0, 3.0, 10.0, 30.0, 100.0, 3000.0, 10000.0])
def test_converges_and_denoises_at_every_light_level(each: PhotonDenoiser, peak: float) -> None:
    """Every solve converges within its default cap (100 steps), in at most 5 up to 100 photons, and
    the estimate ``r̂/peak`` is nearer the clean image than the raw counts ``y/peak`` are (mean
    squared error; up to 3000 photons, half as far). The fine-tuned model's solve at 3000 and 10000
    photons needs Anderson's safeguard (``kdeq.maths.solvers``): without it, it stalled at a residual of
    1e-2."""
    x = clean(64)
    y = counts(x, peak, seed=int(peak * 10))
    got = each.predict(y, peak=peak)
    assert bool(got.stats.converged[0]), float(got.stats.residual[0])
    if peak <= 100:
        assert int(got.stats.iterations[0]) <= 5
    raw = (y / peak - x).square().mean()
    # at 10⁴ photons the counts are within 1 % of the rate: nearer, not twice as near
    assert (got.output - x).square().mean() < (0.5 if peak <= 3000 else 1.0) * raw


def test_peak_default_and_output_scale(each: PhotonDenoiser) -> None:
    """Without a peak the output's 99.5th percentile is 1 (full scale) and ``output · peak`` is the
    same rate a given peak returns; a non-positive peak is an error."""
    model = each
    y = counts(clean(32), 20.0)
    free = model.predict(y)
    fixed = model.predict(y, peak=20.0)
    flat = free.output.reshape(-1)
    assert float(flat.kthvalue(math.ceil(0.995 * flat.numel())).values) == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(free.output * free.peak, fixed.output * 20.0, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="positive"):
        model.predict(y, peak=0.0)
    with pytest.raises(ValueError, match="non-negative"):
        model.predict(y - y.max() - 1.0)


def test_the_tuned_pilot_is_its_network_as_a_gaussian_guide_on_the_anscombe_image(model) -> None:
    """The fine-tuned model's pilot, from ``forward`` and ``pilot_only``, against its network run by
    the Gaussian denoiser (``denoise-kglm:2``'s spec with these tensors) on the stabilised image ``u``
    at ``σ_u = 1/span``, mapped back by Mäkitalo and Foi's inverse ``I(p·span + a(0))`` and divided
    by the peak: the output's scale, which the trainer's pilot loss compares with the clean image."""
    assert model.config.architecture.net is not None
    gaussian = load_checkpoint(find_model(MODELS, "denoise-kglm", 2))
    as_denoiser = Denoiser(Checkpoint(gaussian.config, model.tensors, Path("<tuned>")))
    x = clean(32)
    for peak in (1.0, 8.0):
        y = counts(x, peak)
        bright = float(y.reshape(-1).kthvalue(math.ceil(0.999 * y.numel())).values.clamp(min=1.0))
        span = 2 * math.sqrt(bright + 0.375) - 2 * math.sqrt(0.375)
        u = (2 * torch.sqrt(y + 0.375) - 2 * math.sqrt(0.375)) / span
        with torch.inference_mode():
            p = as_denoiser.pilot_only(u, sigma=255.0 / span)
        want = inverse_anscombe(p * span + 2 * math.sqrt(0.375)) / peak
        got = model.predict(y, peak=peak)
        torch.testing.assert_close(got.pilot, want, rtol=1e-4, atol=1e-5)
        with torch.inference_mode():
            torch.testing.assert_close(model.pilot_only(y, peak), want, rtol=1e-4, atol=1e-5)


def test_inverse_anscombe_against_the_exact_expectation() -> None:
    """``I(E[2√(y + 3/8)]) ≈ r`` for ``y ~ Poisson(r)``, the expectation summed over the pmf: within
    1 % from one photon up (Mäkitalo & Foi's approximation of the exact unbiased inverse) and within
    0.05 photons below."""
    k = torch.arange(0, 400, dtype=F64)
    for r in (0.3, 0.7, 1.0, 2.0, 5.0, 20.0, 100.0):
        pmf = torch.exp(k * math.log(r) - r - torch.lgamma(k + 1))
        expected = (pmf * anscombe(k)).sum()
        back = float(inverse_anscombe(expected))
        if r >= 1:
            assert back == pytest.approx(r, rel=0.01), r
        else:
            assert abs(back - r) < 0.05, r


def test_laplace_map_against_the_dense_covariance(each: PhotonDenoiser) -> None:
    """The log-rate's Laplace covariance ``(λK⁻¹ + W)⁻¹ = (λI + KW)⁻¹K``, ``W = diag(r̂)``, dense; the
    probed std within 5 % mean relative error of it, and the map its delta-method image ``r̂/peak ·
    std(η)`` on the output's scale."""
    model = each
    x = clean(12)
    peak = 8.0
    y = counts(x, peak)
    got = model.predict(y, peak=peak)
    rate = (got.output.double() * peak).reshape(-1)
    with torch.inference_mode():
        u, s_u, _ = model.stabilised(y)
        op, _ = model.guided_operator(u, s_u)
    k = dense(lambda v: op(v.float()).double(), x.numel(), tuple(x.shape))
    lam = float(got.lam[0])
    cov = torch.linalg.solve(lam * torch.eye(x.numel(), dtype=F64) + k * rate[None, :], k)
    want = cov.diagonal().sqrt().reshape(12, 12)
    found = posterior(model, y, peak=peak, generator=torch.Generator().manual_seed(1))
    rel = (found.latent[0, 0].double() - want).abs() / want
    assert rel.mean().item() < 0.05, rel.mean().item()
    scaled = found.latent[0, 0] * got.output[0, 0]
    torch.testing.assert_close(found.std[0, 0], scaled, rtol=1e-4, atol=1e-7)


# --- counts as stored: the service and the command line -------------------------------------------


@pytest.fixture(scope="module")
def client():
    settings = Settings(models_dir=MODELS, device=("cpu",), models=("denoise-poisson-kglm",))
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        assert c.app.state.service.wait_loaded(120)
        yield c


@pytest.mark.parametrize("bits", [8, 16])
def test_service_reads_counts_as_stored_and_answers_in_their_depth(
    client: TestClient, model: PhotonDenoiser, bits: int
) -> None:
    """A PNG of counts (8-bit up to 40 photons, 16-bit up to 3000) is solved on the values as stored:
    the answer, in the input's bit depth, times ``peak`` over the full scale is the library's rate
    for those counts (to the output's rounding), and the JSON gives the peak used."""
    peak = 40.0 if bits == 8 else 3000.0  # 3000: the damping keeps the solve contractive
    y = counts(clean(32), peak)
    dtype = np.uint8 if bits == 8 else np.uint16
    png = encode(Image.fromarray(y[0, 0].numpy().astype(dtype)))
    r = client.post("/denoise-poisson", files={"image": png}, data={"peak": str(peak)})
    assert r.status_code == 200, r.text
    out = Image.open(io.BytesIO(r.content))
    assert (out.mode == "L") if bits == 8 else out.mode in {"I;16", "I"}
    full = 255.0 if bits == 8 else 65535.0
    rate = np.asarray(out, dtype=np.float64) / full * peak
    want = (model.predict(y, peak=peak).output[0, 0].double().clamp(0, 1) * peak).numpy()
    assert np.abs(rate - want).max() <= 0.51 * peak / full
    assert float(r.headers["X-KDEQ-Peak"]) == pytest.approx(peak)
    body = client.post(
        "/denoise-poisson", files={"image": png}, headers={"Accept": "application/json"}
    ).json()
    assert body["peak"] > 0 and body["solver"]["converged"]


def test_service_refuses_floats_and_a_colour_map(client: TestClient) -> None:
    """A floating-point image holds no counts (422 ``not_counts``); the uncertainty map of colour
    counts is refused (422 ``uncertainty_unsupported``) while grey counts get theirs."""
    floats = io.BytesIO()
    Image.fromarray(np.full((16, 16), 3.0, dtype=np.float32), mode="F").save(floats, format="TIFF")
    assert_error(client.post("/denoise-poisson", files={"image": floats.getvalue()}), 422, "not_counts")
    colour = np.random.default_rng(0).poisson(5.0, (16, 16, 3)).astype(np.uint8)
    json_only = {"Accept": "application/json"}
    r = client.post(
        "/denoise-poisson",
        files={"image": encode(colour)},
        data={"uncertainty": "true"},
        headers=json_only,
    )
    assert_error(r, 422, "uncertainty_unsupported")
    grey = encode(colour[..., 0])
    r = client.post(
        "/denoise-poisson", files={"image": grey}, data={"uncertainty": "true"}, headers=json_only
    )
    assert r.status_code == 200 and r.json()["uncertainty"]["probes"] > 0


def test_cli_reads_16_bit_counts_and_writes_16_bits(tmp_path: Path, model: PhotonDenoiser) -> None:
    """``kdeq denoise-poisson IN -o OUT --peak P`` on a 16-bit file: the output is 16-bit and equals the
    library's estimate on the counts as stored."""
    y = counts(clean(32), 1000.0)
    source, out = tmp_path / "counts.png", tmp_path / "rate.png"
    Image.fromarray(y[0, 0].numpy().astype(np.uint16)).save(source)
    assert main(["denoise-poisson", str(source), "-o", str(out), "--peak", "1000"]) == 0
    with Image.open(out) as im:
        assert im.mode in {"I;16", "I"}
        got = np.asarray(im, dtype=np.float64) / 65535.0
    want = model.predict(y, peak=1000.0).output[0, 0].double().clamp(0, 1).numpy()
    assert np.abs(got - want).max() <= 0.51 / 65535
