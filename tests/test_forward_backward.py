"""Forward–backward splitting (kdeq.maths.solvers.forward_backward) and the claim that every shipped
flat-prior kGLM model is a monotone DEQ (kdeq.research.mondeq; DESIGN §2 fact 11).

For each shipped model of the Gaussian or Bernoulli family, the equilibria its own solve computes
on a small image are recorded (``KGLMDEQ.forward`` for the layer models, ``kdeq.maths.operators``'
``solve_affine`` for the models observed through an operator ``A``, whose equilibrium is on the
observation grid with ``K → AKAᵀ``), and for each one:

- (b) the matrix ``D = −M W1 M`` of the solve's own map (``K/λ``, ``MKM/λ`` or ``AKAᵀ/λ``), built
  column by column from the model's modules, is symmetric positive semi-definite, so that
  ``I − W1 = I + D ⪰ I``: monotone with ``m = 1``;
- (c) forward–backward on the split form ``pre(z) = −Dz + c`` (``c = pre(0)`` from the model's own
  modules) with ``prox`` the family's, run in float64, reaches the equilibrium the model's default
  solver returned, within what that solver's residual allows: ``‖z − z*‖ ≤ ‖f(z) − z‖/m`` for the
  affine map ``f`` with ``I − ∂f ⪰ mI``.

The float64 dense form is what makes (c) a test of the equilibrium rather than of float32: at
``‖K/λ‖ ~ 10³`` (the inpainter, the super-resolver) a float32 evaluation of ``pre`` carries an error
of ``10⁻⁴`` relative, the models' own tolerance.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kdeq.maths.operators
from kdeq.maths.deq import KGLMDEQ, DEQOutput
from kdeq.maths.families import Bernoulli, Family, Gaussian, Poisson, Spin, get_family
from kdeq.maths.operators import BlurSubsample
from kdeq.maths.psf import gaussian_psf
from kdeq.maths.solvers import SolverConfig, SolverStats, SplitMap, forward_backward, solve
from kdeq.models.repository import default_models_dir, load_predictor
from kdeq.registry import TASKS
from kdeq.research.mondeq import family_prox, kglm_split
from tests.tolerances import assert_within, column_gap

EXACT = SolverConfig(method="forward_backward", tol=1e-8, max_iter=20000, atol=1e-30)


# --- (a) the solver ---------------------------------------------------------------------------


def test_affine_gaussian_case_equals_the_dense_solve() -> None:
    """``z = −Dz + c`` with ``D`` SPD: forward–backward with the identity prox is the linear solve
    ``(I + D) z = c``, per sample."""
    gen = torch.Generator().manual_seed(0)
    n = 20
    root = torch.randn(n, n, dtype=torch.float64, generator=gen)
    d = root @ root.T / n * 3.0
    c = torch.randn(4, n, dtype=torch.float64, generator=gen)
    norm = float(torch.linalg.eigvalsh(d)[-1])
    split = kglm_split(lambda z: -z @ d.T + c, Gaussian(), norm)
    z, stats = solve(split, torch.zeros_like(c), EXACT.model_copy(update={"tol": 1e-12}))
    dense = torch.linalg.solve(torch.eye(n, dtype=torch.float64) + d, c.T).T
    assert bool(stats.converged.all())
    assert torch.allclose(z, dense, atol=1e-9)
    # a sample that is done stops counting while the others go on
    split2 = kglm_split(lambda z: -z @ d.T + torch.cat([c[:1], 0 * c[1:]]), Gaussian(), norm)
    _, stats2 = solve(split2, torch.zeros_like(c), EXACT)
    assert int(stats2.iterations[1]) == 0 and int(stats2.iterations[0]) > 0


@pytest.mark.parametrize(
    "family", [Bernoulli(), Spin(), get_family("binomial", trials=4)], ids=lambda f: f.name
)
@pytest.mark.parametrize("alpha", [0.05, 0.3, 1.0, 1.7, 6.0])
def test_prox_solves_its_defining_equation(family: Family, alpha: float) -> None:
    """``v = prox_{αφ}(x)`` is the root of ``(1 − α)v + α σ⁻¹(v) = x``: built from points ``v`` inside
    ``σ``'s range (so that the answer is representable), recovered from ``x``; ``α = 1`` is ``σ``."""
    ends = family.sigma(torch.tensor([-30.0, 30.0], dtype=torch.float64))
    v = ends[0] + (ends[1] - ends[0]) * torch.linspace(0.001, 0.999, 201, dtype=torch.float64)
    x = (1 - alpha) * v + alpha * family.sigma_inv(v)
    prox = family_prox(family)
    assert torch.allclose(prox(x, alpha), v, atol=1e-12, rtol=0)
    assert torch.allclose(prox(x, 1.0), family.sigma(x))
    # prox_{αφ} is firmly non-expansive, and in particular monotone with slope at most 1
    slope = prox(x, alpha).diff() / x.diff()
    assert bool((slope >= 0).all()) and bool((slope <= 1 + 1e-9).all())


def test_families_whose_sigma_is_no_prox_are_refused() -> None:
    with pytest.raises(ValueError, match="no proximal map"):
        family_prox(Poisson())
    with pytest.raises(ValueError, match="no proximal map"):
        family_prox(get_family("binomial", trials=5))
    assert family_prox(Gaussian())(torch.tensor([3.0]), 0.2).item() == 3.0


def test_a_plain_map_is_refused() -> None:
    z0 = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="SplitMap"):
        forward_backward(lambda z: 0.5 * z, z0, EXACT)
    with pytest.raises(TypeError, match="SplitMap"):
        solve(lambda z: 0.5 * z, z0, EXACT)
    with pytest.raises(ValueError, match="step"):
        solve(SplitMap(lambda z: 0.5 * z, lambda x, a: x, 0.0), z0, EXACT)


def test_step_one_is_the_plain_iteration() -> None:
    """At ``α = 1`` forward–backward is Picard's ``z ← σ(pre(z))`` step for step."""
    gen = torch.Generator().manual_seed(1)
    w = 0.3 * torch.randn(6, 6, dtype=torch.float64, generator=gen)
    c = torch.randn(2, 6, dtype=torch.float64, generator=gen)
    split = SplitMap(lambda z: z @ w.T + c, lambda x, a: torch.sigmoid(x), 1.0)
    cfg = SolverConfig(method="forward_backward", tol=1e-30, max_iter=7, history=True)
    z, stats = solve(split, torch.zeros_like(c), cfg)
    picard, _ = solve(
        split, torch.zeros_like(c), cfg.model_copy(update={"method": "fixed_point", "damping": 1.0})
    )
    assert torch.allclose(z, picard, atol=1e-15)
    assert stats.history is not None and stats.history.shape == (2, 7)


# --- (b), (c) the shipped models ----------------------------------------------------------------

SIDE = 10
MONOTONE_FAMILIES = {"gaussian", "bernoulli"}


#: tasks whose solve is not one kGLM equilibrium: the impulse denoiser's half-quadratic loop reweights
#: its data term between CG solves, each on the SPD ``I + SK̃S/λ`` (``kdeq.predictors.robust``,
#: tests/test_robust.py)
NOT_ONE_EQUILIBRIUM = frozenset({"denoise-impulse"})


def _models() -> list[Path]:
    root = default_models_dir()
    configs = {p.parent: json.loads(p.read_text()) for p in sorted(root.glob("*/*/config.json"))}
    return [
        path
        for path, config in configs.items()
        if config["family"] in MONOTONE_FAMILIES and config["task"] not in NOT_ONE_EQUILIBRIUM
    ]


def _inputs(task: str) -> tuple[tuple[object, ...], dict[str, object]]:
    """A small grey test image and the task's other arguments: a smooth image of the tasks' own
    (noisy, masked, blurred or subsampled), or the task's warm-up request."""
    gen = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, SIDE), torch.linspace(0, 1, SIDE), indexing="ij")
    img = (0.5 + 0.3 * torch.sin(6 * xx) * torch.cos(4 * yy))[None, None]
    noisy = (img + 0.1 * torch.randn(img.shape, generator=gen)).clamp(0, 1)
    if task == "denoise":
        return (noisy,), {"sigma": 25}
    if task == "inpaint":
        return (img, (torch.rand(1, 1, SIDE, SIDE, generator=gen) < 0.3).float()), {}
    if task == "segment":
        return (noisy,), {}
    if task == "deblur":
        return (noisy, gaussian_psf(1.0)), {"sigma": 5}
    if task == "super-resolve":
        return (img[..., : SIDE // 2, : SIDE // 2],), {"scale": 2}
    # any other task: its own warm-up request (``Task.warmup``), as its predictor takes it
    t = TASKS[task]
    request = t.warmup(SIDE)
    return t.arguments(torch.from_numpy(request.image)[None], [request], None)


def _excess(taps: torch.Tensor) -> float:
    """``‖h‖₁/|Σh|``: how far a filter's magnitudes can add up beyond its response to a constant."""
    taps = taps.double()
    return float(taps.abs().sum() / taps.sum().abs())


@dataclass(frozen=True)
class Solve:
    """One equilibrium a model solved: ``z = σ(M(W1 M z + W2 M t) + m)`` and the solver's answer."""

    w1: torch.nn.Module
    w2: torch.nn.Module
    t: torch.Tensor
    mean: torch.Tensor | None
    mask: torch.Tensor | None
    family: Family
    z: torch.Tensor
    stats: SolverStats

    def restrict(self, v: torch.Tensor) -> torch.Tensor:
        return v if self.mask is None else self.mask * v

    def pre(self, z: torch.Tensor) -> torch.Tensor:
        """``M(W1 M z + W2 M t) + m`` with the model's own modules (float32)."""
        out = self.restrict(self.w1(self.restrict(z)) + self.w2(self.restrict(self.t)))
        return out if self.mean is None else out + self.mean

    def column_map(self, v: torch.Tensor) -> torch.Tensor:
        """``v ↦ −M W1 M v`` for ``v`` ``(1, k, H, W)`` where the map applies one kernel to each channel
        alike (``k`` unit vectors go through as the channels of one image), or ``(k, c, H, W)`` where a
        coregionalised kernel couples the ``c`` channels (``k`` images)."""
        return -self.restrict(self.w1(self.restrict(v)))

    def units(self, rows: torch.Tensor) -> torch.Tensor:
        """The unit vectors ``rows`` ``(k, n)`` shaped as ``column_map`` takes them."""
        if self.z.shape[1] == 1:
            return rows.reshape(1, rows.shape[0], *self.z.shape[2:])
        return rows.reshape(rows.shape[0], *self.z.shape[1:])

    def terms(self, n: int) -> int:
        """The terms along ``W1``'s deepest chain of sums for ``n`` pixels: a filter or guided sum over
        at most its input's pixels; a map seen through an operator adds ``Aᵀ`` and ``A`` on the full grid
        (``s²`` times the pixels for a subsampling one) and may apply ``K`` by a DCT of that length."""
        op = getattr(self.w1, "op", None)
        if op is None:
            return n
        full = n * (op.scale**2 if isinstance(op, BlurSubsample) else 1)
        return 3 * full + 4 * math.ceil(math.log2(full)) + 4

    @property
    def negative_mass(self) -> float:
        """How far ``|A||K||Aᵀ|`` can exceed ``|A K Aᵀ|`` for a map seen through an operator ``A``: the
        ratio ``‖h‖₁/|Σh|`` of each filter per application (bicubic taps have negative lobes, and a
        trained kernel may; a separable filter is applied along both axes). A single filter or guided
        sum applied to a unit image has one product per entry, whose magnitude is the entry's: 1."""
        op = getattr(self.w1, "op", None)
        if op is None:
            return 1.0
        describe = getattr(self.w1.kernel_map, "stationary", None)
        inner = describe() if callable(describe) else None
        mass = 1.0 if inner is None else _excess(inner.taps)
        if isinstance(op, BlurSubsample):
            return mass * _excess(op.taps) ** 4
        psf = getattr(op, "psf", None)
        return mass * (1.0 if psf is None else _excess(psf) ** 2)

    @functools.cached_property
    def dense(self) -> torch.Tensor:
        """``D = −M W1 M`` ``(n, n)`` in float64, its columns the images of the ``n`` unit vectors
        (computed once: (b) and (c) share it); two columns are checked against one-channel
        applications, which guards the channels-alike assumption."""
        n = self.z[0].numel()
        eye = torch.eye(n, dtype=self.z.dtype)
        d = self.column_map(self.units(eye)).reshape(n, n).T
        # the columns' float32 rounding (tolerances.column_gap), not a fixed 1e-6 of the largest entry
        gap = column_gap(d, self.z.dtype, self.terms(n), self.negative_mass)
        for j in (0, n - 1):
            alone = self.column_map(self.units(eye[j : j + 1])).reshape(-1)
            assert_within(d[:, j], alone, gap)
        return d.double()


@functools.cache
def _solves(path: Path) -> tuple[Solve, ...]:
    """Every equilibrium the model at ``path`` solves on its task's test inputs, with its default solver."""
    found: list[Solve] = []
    layer_forward = KGLMDEQ.forward
    operator_solve = kdeq.maths.operators.solve_affine

    def recorded_forward(
        self: KGLMDEQ,
        y: torch.Tensor,
        mean: torch.Tensor | None = None,
        mean_out: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        z0: torch.Tensor | None = None,
        solver: SolverConfig | None = None,
    ) -> DEQOutput:
        out = layer_forward(self, y, mean, mean_out, mask, z0, solver)
        found.append(Solve(self.w1, self.w2, self.family.T(y), mean, mask, self.family, out.z, out.stats))
        return out

    def recorded_solve(
        w1: torch.nn.Module,
        w2: torch.nn.Module,
        t: torch.Tensor,
        mean: torch.Tensor | None,
        mask: torch.Tensor | None,
        z0: torch.Tensor | None,
        config: SolverConfig,
        with_map: bool = False,
    ) -> tuple[torch.Tensor, SolverStats, torch.Tensor | None]:
        out = operator_solve(w1, w2, t, mean, mask, z0, config, with_map)
        found.append(Solve(w1, w2, t, mean, mask, Gaussian(), out[0], out[1]))
        return out

    predictor = load_predictor(path)
    args, kwargs = _inputs(predictor.task)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(KGLMDEQ, "forward", recorded_forward)
        patch.setattr(kdeq.maths.operators, "solve_affine", recorded_solve)
        predictor.predict(*args, **kwargs)
    return tuple(found)


def _name(path: Path) -> str:
    return f"{path.parent.name}:{path.name}"


def test_the_shipped_flat_prior_models_are_all_here() -> None:
    names = {_name(p) for p in _models()}
    expected = {
        "denoise-kglm:1", "denoise-kglm:2", "denoise-kglm:3", "denoise-kglm:4", "denoise-kglm:5",
        "denoise-kglm:6", "denoise-kglm:7", "denoise-kglm:8",
        "denoise-stationary-kglm:1",
        "denoise-stationary-kglm:2", "inpaint-kglm:1", "inpaint-kglm:2", "inpaint-kglm:3", "segment-kglm:1",
        "segment-kglm:2",
        "deblur-kglm:1", "deblur-kglm:2", "deblur-kglm:3", "super-resolve-kglm:1", "super-resolve-kglm:2",
    }  # fmt: skip
    assert expected <= names
    assert not any(n.startswith("denoise-poisson") for n in names)


@pytest.mark.parametrize("path", _models(), ids=_name)
def test_shipped_model_is_a_monotone_deq(path: Path) -> None:
    """(b): every equilibrium the model solves has ``I − W1 = I + D`` with ``D`` symmetric PSD."""
    solves = _solves(path)
    assert solves, f"{_name(path)} solved no recorded equilibrium"
    for s in solves:
        d = s.dense
        scale = d.abs().max()
        assert scale > 0
        # float32 kernels: symmetric and PSD to a few float32 units of the largest entry/eigenvalue
        assert (d - d.T).abs().max() <= 1e-5 * scale
        eig = torch.linalg.eigvalsh(0.5 * (d + d.T))
        assert eig[0] >= -1e-5 * eig[-1]
        family_prox(s.family)  # σ is a proximal map (raises otherwise)


@pytest.mark.parametrize("path", _models(), ids=_name)
def test_forward_backward_reaches_the_shipped_models_equilibrium(path: Path) -> None:
    """(c): forward–backward on ``pre(z) = −Dz + c`` reaches each equilibrium the model's own solver
    returned: within the models' tolerance, and for the affine (Gaussian) ones within ``‖f(z) − z‖/m``
    of the model's iterate (plus float32 rounding)."""
    for s in _solves(path):
        d = s.dense
        eig = torch.linalg.eigvalsh(0.5 * (d + d.T))
        with torch.no_grad():
            c = s.pre(torch.zeros_like(s.z)).double().reshape(s.z.shape[0], -1)
            model = s.z.double().reshape(s.z.shape[0], -1)
            split = kglm_split(
                lambda z, c=c, d=d: c - z @ d.T, s.family, float(eig[-1]), max(float(eig[0]), 0.0)
            )
            z, stats = solve(split, torch.zeros_like(c), EXACT)
            assert bool(stats.converged.all()), stats.residual
            assert torch.allclose(z, split(z), atol=1e-8)
            err = (z - model).norm(dim=1)
            if isinstance(s.family, Gaussian):
                # f(v) − v = −(I + D)(v − z*) for the affine map, so ‖v − z*‖ ≤ ‖f(v) − v‖/(1 + λ_min(D))
                residual = (split(model) - model).norm(dim=1) / (1.0 + max(float(eig[0]), 0.0))
                assert bool((err <= 1.05 * residual + 1e-6 * model.norm(dim=1)).all()), (err, residual)
        # within the models' own tolerance (1e-4, relative)
        assert bool((err <= 2e-4 * model.norm(dim=1)).all()), err / model.norm(dim=1)
