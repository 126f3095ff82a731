"""A colour image's luminance alone solved, its colour differences left at the prior mean
(``GuidedArchitecture.chroma = "prior_mean"``, ``denoise-kglm:5``), against dense float64 algebra."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from kdeq.cli import main
from kdeq.maths.adaptive import GuidedOperator, guided_gram
from kdeq.maths.guidenet import opponent
from kdeq.models.checkpoint import ModelSpec, read_config
from kdeq.models.repository import load_predictor
from kdeq.predictors.base import SolverOverride
from kdeq.predictors.uncertainty import posterior

MODELS = Path(__file__).resolve().parents[1] / "models"
TIGHT = SolverOverride(tol=1e-9, max_iter=500)
SIGMA = 25.0


def colour_scene(size: int = 20, seed: int = 0) -> torch.Tensor:
    """A ``(1, 3, size, size)`` colour image with edges in every channel, plus σ = 25 noise."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    disc = ((rows - size / 2) ** 2 + (cols - size / 2.5) ** 2 < (size / 3) ** 2).float()
    clean = torch.stack([0.2 + 0.6 * disc, 0.7 - 0.4 * disc + 0.2 * cols / size, 0.3 + 0.3 * rows / size])
    return (clean + SIGMA / 255 * torch.randn(clean.shape, generator=gen)).clamp(0, 1)[None]


@pytest.fixture(scope="module")
def models():
    return load_predictor(MODELS / "denoise-kglm" / "4"), load_predictor(MODELS / "denoise-kglm" / "5")


def test_the_luminance_is_the_solve_and_the_colour_differences_the_mean(models) -> None:
    """``z = Qᵀ(z₀, m₁, m₂)`` with ``z₀ = m₀ + K̃(K̃ + λI)⁻¹(y₀ − m₀)``, ``m = β p + (1 − β) D⁻¹K y``: ``K̃``
    and ``D⁻¹K`` from the dense Gram matrix of the guide's explicit patch features."""
    _, model = models
    x = colour_scene()
    with torch.no_grad():
        got = model.predict(x, SIGMA, solver=TIGHT)
        s = model._guide_level(model.noise_level(x, SIGMA))
        guide, pilot = model.guide(x, s)
    kern = model.config.architecture.kernel
    h2 = float(model.guide_h2(3, s))
    spatial = model.tensors["spatial"].double()
    raw = guided_gram(guide[0].double(), spatial, kern.patch_radius, h2, normalize=False)
    k = guided_gram(guide[0].double(), spatial, kern.patch_radius, h2, normalize=True)
    flat = x[0].double().reshape(3, -1)  # (c, N)
    beta = float(model.tensors["net_mean_mix"])
    mean = beta * pilot[0].double().reshape(3, -1) + (1 - beta) * (flat @ raw.T) / raw.sum(1)
    q = opponent(3, torch.float64)
    y, m = q @ flat, q @ mean
    lam = float(got.lam)
    z0 = m[0] + k @ torch.linalg.solve(k + lam * torch.eye(k.shape[0], dtype=torch.float64), y[0] - m[0])
    expected = (q.T @ torch.stack([z0, m[1], m[2]])).reshape(x.shape)
    assert got.stats.converged.all()
    torch.testing.assert_close(got.output.double(), expected, atol=2e-5, rtol=0)


def test_a_grey_image_is_solved_as_before_and_colour_differs(models) -> None:
    v4, v5 = models
    grey, colour = colour_scene()[:, :1], colour_scene(seed=1)
    with torch.no_grad():
        assert torch.equal(v4.predict(grey, SIGMA).output, v5.predict(grey, SIGMA).output)
        a, b = v4.predict(colour, SIGMA).output, v5.predict(colour, SIGMA).output
    assert (a - b).abs().max() > 1e-3


def test_the_solve_applies_the_kernel_to_the_luminance_alone_once_a_step(models, monkeypatch) -> None:
    """After the one pass for the degree and the local mean (``[1, y]``, four channels), every ``K̃``
    application is on one channel: the start's residual, then one per CG step, and no readout (the
    equilibrium map's last value is the output)."""
    _, model = models
    channels = []
    kernel = GuidedOperator.kernel

    def recorded(self, v):
        channels.append(v.shape[1])
        return kernel(self, v)

    monkeypatch.setattr(GuidedOperator, "kernel", recorded)
    with torch.no_grad():
        got = model.predict(colour_scene(), SIGMA)
    assert channels[0] == 4 and set(channels[1:]) == {1}
    assert len(channels) - 1 == int(got.stats.iterations) + 1


def test_the_guided_kernels_diagonal_is_the_dense_grams(models) -> None:
    _, model = models
    x = colour_scene()
    s = model._guide_level(model.noise_level(x, SIGMA))
    with torch.no_grad():
        guide, _ = model.guide(x, s)
    kern = model.config.architecture.kernel
    h2 = model.guide_h2(3, s)
    spatial = model.tensors["spatial"]
    for normalize in (True, False):
        op = GuidedOperator(guide.double(), spatial.double(), kern.patch_radius, h2.double(), normalize)
        dense = guided_gram(guide[0].double(), spatial.double(), kern.patch_radius, float(h2), normalize)
        torch.testing.assert_close(op.diagonal().reshape(-1), dense.diagonal(), rtol=1e-12, atol=0)


def test_the_colour_differences_carry_the_priors_variance(models) -> None:
    """Each RGB channel's variance is ``Σ_k Q_kj² var_k = (1/3)·var₀ + (2/3)·s² K̃_ii``: the luminance's
    posterior (version 4's map, whose every channel is solved, on the same probes) and the prior's."""
    v4, v5 = models
    x = colour_scene()
    both = [posterior(m, x, sigma=SIGMA, generator=torch.Generator().manual_seed(3)) for m in (v4, v5)]
    solved, mixed = both
    assert torch.equal(solved.amplitude, mixed.amplitude)
    s = v5._guide_level(v5.noise_level(x, SIGMA))
    with torch.no_grad():
        guide, _ = v5.guide(x, s)
    kern = v5.config.architecture.kernel
    dense = guided_gram(
        guide[0].double(), v5.tensors["spatial"].double(), kern.patch_radius, float(v5.guide_h2(3, s)), True
    )
    prior = float(solved.amplitude) * dense.diagonal().reshape(x.shape[-2:])
    expected = (solved.std.double().square() / 3 + 2 / 3 * prior).sqrt().expand(x.shape)
    torch.testing.assert_close(mixed.std.double(), expected, rtol=1e-5, atol=0)


def test_version_5_is_version_4_with_the_colour_differences_at_the_mean() -> None:
    """The shipped files differ only where docs/training.md's recipe says (which its test rebuilds)."""
    v4, v5 = (json.loads((MODELS / "denoise-kglm" / v / "config.json").read_text()) for v in "45")
    assert v5["architecture"].pop("chroma") == "prior_mean"
    assert v5["weights_sha256"] == v4["weights_sha256"]
    for key in ("version", "description", "provenance"):
        v4.pop(key), v5.pop(key)
    assert v4 == v5
    assert (
        "chroma"
        not in json.loads(read_config(MODELS / "denoise-kglm" / "4").model_dump_json())["architecture"]
    )


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"chroma": "dropped"}, "chroma"),
        ({"task": "denoise-impulse"}, "chroma 'prior_mean'"),
        ({"mean": "none"}, "needs one"),
    ],
    ids=["unknown-value", "another-task", "no-mean"],
)
def test_what_cannot_leave_the_colour_differences_at_the_mean_is_refused(update: dict, message: str) -> None:
    spec = json.loads(read_config(MODELS / "denoise-kglm" / "5").spec().model_dump_json())
    if "chroma" in update:
        spec["architecture"]["chroma"] = update.pop("chroma")
    spec.update(update)
    with pytest.raises(ValidationError, match=message):
        ModelSpec.model_validate(spec)


def test_kdeq_init_composes_and_retasks_around_version_5(tmp_path) -> None:
    """``kdeq init --prior`` around the default denoiser: the plug-and-play deblurrer embeds it as it
    is (its colour differences at the mean), the impulse denoiser, a task that solves every channel,
    takes its kernel and network with ``chroma`` back at ``solved``."""
    assert main(["init", "--prior", str(MODELS / "denoise-kglm" / "5"), "--models-dir", str(tmp_path)]) == 0
    deblur = read_config(tmp_path / "deblur-kglm" / "3")
    impulse = load_predictor(tmp_path / "denoise-impulse-kglm" / "2")
    assert deblur.architecture.prior.architecture.chroma == "prior_mean"
    assert impulse.config.architecture.chroma == "solved"
    v5 = load_predictor(MODELS / "denoise-kglm" / "5")
    assert impulse.tensors.keys() == v5.tensors.keys()
    assert all(torch.equal(impulse.tensors[k], v5.tensors[k]) for k in v5.tensors)
