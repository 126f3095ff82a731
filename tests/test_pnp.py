"""Plug-and-play deblurring (``kdeq.maths.pnp``, the ``pnp`` architecture): the data step against the dense
normal equations, the schedule, the whole iteration against a loop written with dense matrices, the
composed checkpoint (its prior whole, rebuilt bit for bit) and the shipped ``deblur-kglm:3``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kdeq.cli import main as kdeq_main
from kdeq.maths.operators import Blur
from kdeq.maths.pnp import data_step, noise_schedule, plug_and_play
from kdeq.maths.psf import parse_psf
from kdeq.maths.solvers import SolverConfig, SolverStats
from kdeq.models.checkpoint import (
    CheckpointError,
    ModelSpec,
    load_checkpoint,
    prior_checkpoint,
    save_checkpoint,
)
from kdeq.models.initialize import (
    DEFAULT_SPECS,
    PLUG_AND_PLAY_SPECS,
    RETASKED,
    compose_checkpoint,
    init_tensors,
)
from kdeq.models.repository import load_predictor
from kdeq.predictors.deblur import Deblurrer
from kdeq.predictors.denoise import Denoiser
from kdeq.train.config import TrainConfig
from tests.service_helpers import MODELS, smooth_image
from tests.tolerances import assert_within, dense_solve_error, norm2, observed_solve_error

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
TIGHT = SolverConfig(method="cg", tol=1e-12, max_iter=3000)
SPEC = PLUG_AND_PLAY_SPECS[0]
DENOISER = next(s for s in DEFAULT_SPECS if s.name == "denoise-kglm")
INPAINTER = next(s for s in DEFAULT_SPECS if s.name == "inpaint-kglm")


def lopsided_psf() -> torch.Tensor:
    """A 3×5 PSF that no flip maps onto itself (the blur's orientation shows)."""
    psf = torch.tensor([[0.0, 2.0, 0.0, 0.0, 0.0], [1.0, 6.0, 3.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0, 1.0]])
    return psf / psf.sum()


def normal_equations(H: np.ndarray, y: np.ndarray, z: np.ndarray, lam: float) -> np.ndarray:
    """``(HᵀH + λI)⁻¹(Hᵀy + λz)``: the data step's own definition, the minimiser of
    ``‖y − Hx‖² + λ‖x − z‖²``."""
    return np.linalg.solve(H.T @ H + lam * np.eye(H.shape[1]), H.T @ y + lam * z)


def data_step_error(H: np.ndarray, y: np.ndarray, m: np.ndarray, lam: float, config: SolverConfig) -> float:
    """A bound on ``‖x − x̂‖₂`` over a sample's channels ``(c, n)`` between ``data_step``'s ``x``, solved
    to ``config.tol``, and ``normal_equations``' ``x̂``: ``data_step`` is ``solve_observed`` with ``K = I``
    (``tolerances.observed_solve_error``), and the dense reference errs by
    ``tolerances.dense_solve_error`` per channel."""
    M = H.T @ H + lam * np.eye(H.shape[1])
    reference = sum(
        dense_solve_error(M, normal_equations(H, yc, mc, lam)) for yc, mc in zip(y, m, strict=True)
    )
    return observed_solve_error(H, np.eye(H.shape[1]), y, m, lam, config.tol, config.atol) + reference


@pytest.mark.parametrize(
    ("psf", "border"),
    [
        ("gaussian:1.2", "symmetric"),
        ("motion:6,30", "symmetric"),
        ("lopsided", "symmetric"),
        ("disk:1.5", "zeros"),
    ],
    ids=["even-dct", "oblique-cg", "lopsided-cg", "zero-border-cg"],
)
def test_the_data_step_solves_the_normal_equations(psf: str, border: str) -> None:
    h, w = 9, 11
    kernel = lopsided_psf() if psf == "lopsided" else parse_psf(psf)
    op = Blur(kernel.double(), border)
    H = op.dense(h, w).numpy()
    gen = torch.Generator().manual_seed(0)
    y = torch.rand(2, 3, h, w, generator=gen, dtype=F64)
    z = torch.rand(2, 3, h, w, generator=gen, dtype=F64)
    lam = torch.tensor([0.3, 2e-3], dtype=F64)
    x, stats = data_step(op, y, z, lam, TIGHT)
    assert bool(stats.converged.all())
    for b in range(2):
        yb, zb = y[b].reshape(3, -1).numpy(), z[b].reshape(3, -1).numpy()
        expected = np.stack(
            [normal_equations(H, yc, zc, lam[b].item()) for yc, zc in zip(yb, zb, strict=True)]
        )
        assert_within(x[b].reshape(3, -1), expected, data_step_error(H, yb, zb, lam[b].item(), TIGHT))


def test_the_schedule_is_geometric_from_the_start_to_each_level() -> None:
    final = torch.tensor([0.01, 0.1, 0.5], dtype=F64)
    levels = noise_schedule(0.2, final, 6)
    assert levels.shape == (6, 3)
    torch.testing.assert_close(levels[0], torch.tensor([0.2, 0.2, 0.5], dtype=F64))
    torch.testing.assert_close(levels[-1], final)
    ratios = levels[1:] / levels[:-1]
    torch.testing.assert_close(ratios, ratios[:1].expand_as(ratios))
    # a level above the start is held: every step at it
    torch.testing.assert_close(levels[:, 2], torch.full((6,), 0.5, dtype=F64))
    torch.testing.assert_close(noise_schedule(0.2, final, 1), final[None])


def test_the_iteration_equals_the_dense_half_quadratic_splitting() -> None:
    """``plug_and_play`` against the splitting written out with the dense ``H`` and a denoiser that
    depends on its level (a Gaussian blur of width ``σ_k``, as a dense matrix too)."""
    h, w, steps = 8, 10, 5
    psf = parse_psf("motion:5,20").double()
    op = Blur(psf, "symmetric")
    H = op.dense(h, w).numpy()

    def smoother(level: float) -> np.ndarray:
        """Row-normalised Gaussian weights of width ``20·level`` pixels between the pixels."""
        ii, jj = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        d2 = (ii.reshape(-1, 1) - ii.reshape(1, -1)) ** 2 + (jj.reshape(-1, 1) - jj.reshape(1, -1)) ** 2
        weights = np.exp(-d2 / (2 * (20 * level) ** 2))
        return weights / weights.sum(axis=1, keepdims=True)

    def denoise(v: torch.Tensor, level: torch.Tensor) -> tuple[torch.Tensor, SolverStats]:
        out = torch.stack(
            [
                torch.from_numpy(smoother(level[b].item()) @ v[b, 0].reshape(-1).numpy()).reshape(1, h, w)
                for b in range(v.shape[0])
            ]
        )
        ones = torch.ones(v.shape[0])
        return out, SolverStats(ones.long() * 2, ones * 1e-9, ones.bool())

    gen = torch.Generator().manual_seed(1)
    y = torch.rand(2, 1, h, w, generator=gen, dtype=F64)
    lam = torch.tensor([1e-3, 4e-2], dtype=F64)
    levels = noise_schedule(0.15, torch.tensor([0.01, 0.05], dtype=F64), steps)
    out, stats = plug_and_play(op, y, y, lam, levels, denoise, TIGHT)
    assert bool(stats.converged.all())
    # each data step is one CG solve (the PSF is oblique) and each prior step reported 2
    assert (stats.iterations >= steps * 3).all()
    for b in range(2):
        target = y[b, 0].reshape(-1).numpy()
        z, bound = target, 0.0
        for k in range(steps):
            s = levels[k, b].item()
            step_lam = lam[b].item() / s**2
            # the data step adds its own error and passes on its input's times ‖λ(HᵀH + λI)⁻¹‖₂ ≤ 1;
            # the smoother, the same product on both sides, multiplies the sum by its norm
            bound += data_step_error(H, target[None], z[None], step_lam, TIGHT)
            x = normal_equations(H, target, z, step_lam)
            z = smoother(s) @ x
            bound *= norm2(smoother(s))
        assert_within(out[b, 0].reshape(-1), z, bound)


# ---------------------------------------------------------------------------- the composed model


@pytest.fixture(scope="module")
def closed_form(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``SPEC`` around the closed-form default denoiser (``kdeq init`` of the plug-and-play spec)."""
    root = tmp_path_factory.mktemp("pnp")
    assert kdeq_main(["init", str(write_spec(root / "spec.json", SPEC)), "--models-dir", str(root)]) == 0
    return root / SPEC.name / str(SPEC.version)


def write_spec(path: Path, spec: ModelSpec) -> Path:
    path.write_text(spec.model_dump_json())
    return path


def test_the_deblurrer_is_the_splitting_around_its_own_denoiser(closed_form: Path) -> None:
    """The model's schedule, ``λ_k = λ(σ̄)/σ_k²`` and prior calls, against the loop written with the
    denoiser built alone from the same tensors and the dense normal equations."""
    deblurrer = load_predictor(closed_form)
    assert isinstance(deblurrer, Deblurrer) and deblurrer.plug_and_play
    denoiser = Denoiser(prior_checkpoint(load_checkpoint(closed_form)))
    h, w, sigma = 20, 22, 3.0
    psf = parse_psf("gaussian:1.6")
    H = Blur(psf.double(), "symmetric").dense(h, w).numpy()
    clean = smooth_image(h, w, seed=2)
    y = H @ clean.reshape(-1) + sigma / 255 * np.random.default_rng(0).standard_normal(h * w)
    y = torch.from_numpy(y.reshape(1, 1, h, w)).float()
    prediction = deblurrer.predict(y, psf, sigma=sigma)
    arch, rule = SPEC.architecture, SPEC.lam
    lam = (sigma / 255) ** 2 / rule.signal_variance
    assert prediction.lam.item() == pytest.approx(lam, rel=1e-5)
    ratio = (arch.start_sigma / sigma) ** (1 / (arch.steps - 1))
    target = y[0, 0].double().reshape(-1).numpy()
    z = target
    for k in range(arch.steps):
        level = arch.start_sigma / ratio**k
        x = normal_equations(H, target, z, lam / (level / 255) ** 2)
        z = denoiser.predict(torch.from_numpy(x.reshape(1, 1, h, w)).float(), sigma=level).output
        z = z[0, 0].double().reshape(-1).numpy()
    np.testing.assert_allclose(prediction.output[0, 0].double().reshape(-1).numpy(), z, rtol=0, atol=2e-4)
    assert bool(prediction.stats.converged.all())


def test_a_composed_checkpoint_embeds_its_prior_whole(tmp_path: Path) -> None:
    prior_dir = MODELS / "denoise-kglm" / "2"
    folder, config = compose_checkpoint(SPEC, load_checkpoint(prior_dir), tmp_path)
    own = load_checkpoint(prior_dir)
    embedded = prior_checkpoint(load_checkpoint(folder))
    # the spec, the tensors and so the weights' hash are the prior checkpoint's own
    assert embedded.config == own.config.model_copy(update={"provenance": embedded.config.provenance})
    assert embedded.config.weights_sha256 == own.config.weights_sha256
    assert embedded.tensors.keys() == own.tensors.keys()
    assert all(torch.equal(embedded.tensors[k], t) for k, t in own.tensors.items())
    assert config.provenance.epochs == own.config.provenance.epochs
    assert "denoise-kglm:2" in config.provenance.notes


def test_the_shipped_models_around_the_denoiser_are_its_composition(tmp_path: Path) -> None:
    """``kdeq init --prior models/denoise-kglm/2`` rebuilds the plug-and-play deblurrer and the impulse
    denoiser (``RETASKED``: the prior's spec and tensors under another task) bit for bit."""
    assert (
        kdeq_main(["init", "--prior", str(MODELS / "denoise-kglm" / "2"), "--models-dir", str(tmp_path)]) == 0
    )
    built = [(spec.name, spec.version) for spec in PLUG_AND_PLAY_SPECS] + [m[:2] for m in RETASKED]
    assert ("denoise-impulse-kglm", 2) in built
    for model, version in built:
        for name in ("config.json", "weights.safetensors"):
            shipped = MODELS / model / str(version) / name
            rebuilt = tmp_path / model / str(version) / name
            assert shipped.read_bytes() == rebuilt.read_bytes(), f"{shipped} differs from a rebuild"
    impulse = load_checkpoint(tmp_path / "denoise-impulse-kglm" / "2")
    prior = load_checkpoint(MODELS / "denoise-kglm" / "2")
    assert (
        impulse.config.task == "denoise-impulse" and impulse.config.architecture == prior.config.architecture
    )
    assert impulse.config.weights_sha256 == prior.config.weights_sha256


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda d: d["architecture"].update(prior=json.loads(INPAINTER.model_dump_json())),
            "prior is a denoiser",
        ),
        (lambda d: d.update(mean="global"), "mean none"),
        (lambda d: d["architecture"].update(steps=0), "greater than or equal to 1"),
        (lambda d: d["architecture"].update(extra=1), "Extra inputs"),
    ],
    ids=["prior-task", "mean", "steps", "unknown-key"],
)
def test_plug_and_play_specs_are_checked(change, match: str) -> None:
    data = json.loads(SPEC.model_dump_json())
    change(data)
    with pytest.raises(ValueError, match=match):
        ModelSpec.model_validate(data)


def test_a_plug_and_play_prior_cannot_itself_be_plug_and_play() -> None:
    data = json.loads(SPEC.model_dump_json())
    data["architecture"]["prior"].update(
        architecture=json.loads(SPEC.architecture.model_dump_json()), mean="none"
    )
    with pytest.raises(ValueError, match="pnp architecture is not for the denoise task"):
        ModelSpec.model_validate(data)


def test_a_plug_and_play_checkpoint_holds_exactly_its_priors_tensors(tmp_path: Path) -> None:
    tensors = init_tensors(SPEC)
    assert set(tensors) == {f"prior.{k}" for k in init_tensors(DENOISER)}
    with pytest.raises(CheckpointError, match=r"missing \['prior.spatial'\]"):
        save_checkpoint(tmp_path / "m", SPEC, {k: v for k, v in tensors.items() if k != "prior.spatial"})
    with pytest.raises(CheckpointError, match=r"extra \['spatial'\]"):
        save_checkpoint(tmp_path / "m", SPEC, tensors | {"spatial": tensors["prior.spatial"]})
    # the prior's own kernel checks apply to its embedded tensors
    skewed = tensors["prior.spatial"].clone()
    skewed[0, 1] += 0.1
    with pytest.raises(CheckpointError, match="point-symmetric"):
        save_checkpoint(tmp_path / "m", SPEC, tensors | {"prior.spatial": skewed})


def test_init_refuses_a_prior_for_a_spec_that_is_not_plug_and_play(tmp_path: Path, capsys) -> None:
    spec = write_spec(tmp_path / "spec.json", DEFAULT_SPECS[0])
    args = ["init", str(spec), "--prior", str(MODELS / "denoise-kglm" / "2"), "--models-dir", str(tmp_path)]
    assert kdeq_main(args) == 2
    assert "not a plug-and-play one" in capsys.readouterr().err


def test_the_trainer_refuses_a_plug_and_play_model(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec.json", SPEC)
    with pytest.raises(ValueError, match="plug-and-play model, composed around a denoiser"):
        TrainConfig(
            task="deblur", spec=str(spec), train=(tmp_path,), val=(tmp_path,), out=tmp_path / "m" / "1"
        )
