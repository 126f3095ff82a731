"""The chunked solve of ``kdeq.maths.graphs`` run on the CPU (``replaying_on_cpu``): every step as the
solver's own loop takes it, the chunks run eagerly over the key's static copies. The capture itself needs a
GPU (``tests/test_cuda.py``)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from kdeq import Kernel, SolverConfig, dense_spectral_norm, grid_coordinates, solve
from kdeq.maths import graphs
from kdeq.maths.solvers import linear_cg
from kdeq.models.checkpoint import load_checkpoint
from kdeq.models.repository import default_models_dir, find_model
from kdeq.predictors.denoise import Denoiser

F64 = torch.float64
#: map evaluations, counted from outside the map's closure (a counter inside it is state the map
#: keeps, which the chunked path refuses: see the last test)
EVALUATIONS = {"n": 0}


@pytest.fixture(autouse=True)
def _fresh_cache():
    graphs.clear()
    yield
    graphs.clear()


def _kglm(side: int, norm: float, b: torch.Tensor):
    """``f(z) = (b − z)K`` with a kernel Gram matrix at ``‖K‖ = norm``: the linear Gaussian kGLM-DEQ
    (``A = I + K`` SPD), a contraction for ``norm < 1``."""
    gram = Kernel(lengthscale=2.0, radius=5).gram(grid_coordinates(side, side)).to(b.dtype)
    gram = gram * norm / dense_spectral_norm(gram)

    def f(z: torch.Tensor) -> torch.Tensor:
        EVALUATIONS["n"] += 1
        return (b - z) @ gram

    return f


def _both(f, z0: torch.Tensor, cfg: SolverConfig):
    eager = solve(f, z0, cfg)
    with graphs.replaying_on_cpu():
        chunked = solve(f, z0, cfg)
    return eager, chunked


def _same(a, b) -> None:
    (za, sa), (zb, sb) = a, b
    assert torch.equal(za, zb)
    assert torch.equal(sa.iterations, sb.iterations)
    assert torch.equal(sa.residual, sb.residual)
    assert torch.equal(sa.converged, sb.converged)


@pytest.mark.parametrize("method", ["fixed_point", "anderson", "cg"])
@pytest.mark.parametrize("max_iter", [300, 2 * graphs.CHUNK + 1])
def test_chunked_steps_are_the_solver_loops_own(method: str, max_iter: int) -> None:
    """Bit for bit the same iterate, residual and counts as the solver's loop, converged (in a step
    count no chunk boundary divides) or stopped by a cap that is not a whole number of chunks."""
    gen = torch.Generator().manual_seed(0)
    b = torch.rand(3, 100, dtype=F64, generator=gen)
    f = _kglm(10, 0.8 if method == "fixed_point" else 20.0, b)
    cfg = SolverConfig(method=method, tol=1e-10, max_iter=max_iter, damping=1.0)
    eager, chunked = _both(f, torch.zeros(3, 100, dtype=F64), cfg)
    _same(eager, chunked)
    iterations = eager[1].iterations
    if max_iter < 300:
        assert (iterations == max_iter).all()
    else:
        assert eager[1].converged.all() and int(iterations.max()) % graphs.CHUNK != 0
    assert graphs.cached() == 1


@pytest.mark.parametrize("method", ["fixed_point", "anderson"])
def test_each_sample_stops_counting_the_step_it_converges(method: str) -> None:
    """A batch whose samples contract at rates up to 0.2 to 0.9 (``f(z) = a·tanh(z) + c``) converges
    over many chunks: each sample's count is the eager loop's, and the map ran once for the start,
    once per step of the slowest sample and at most ``CHUNK − 1`` steps past it, the rest of its
    chunk, counted by no sample."""
    slopes = torch.tensor([0.2, 0.5, 0.9], dtype=F64)
    c = torch.linspace(0.01, 0.1, 40, dtype=F64)

    def f(z: torch.Tensor) -> torch.Tensor:
        EVALUATIONS["n"] += 1
        return slopes[:, None] * torch.tanh(z) + c

    cfg = SolverConfig(method=method, tol=1e-9, max_iter=500, damping=1.0, memory=2)
    z0 = torch.zeros(3, 40, dtype=F64)
    eager = solve(f, z0, cfg)
    EVALUATIONS["n"] = 0
    with graphs.replaying_on_cpu():
        chunked = solve(f, z0, cfg)
    _same(eager, chunked)
    counts = chunked[1].iterations
    assert len(set(counts.tolist())) >= 2, counts  # mixed: stopped in different chunks or steps
    slowest = int(counts.max())
    past = EVALUATIONS["n"] - 1 - slowest
    assert 0 <= past < graphs.CHUNK
    assert past == -slowest % graphs.CHUNK


def test_a_second_solve_of_the_key_reuses_its_copies_and_reads_its_own_tensors() -> None:
    """Two right-hand sides of one shape share a key: the second solve copies its own ``b`` into the
    key's buffers (its answer is its eager one, not the first's), and the originals are never written.
    Another batch size is another key; past ``CACHE_SIZE`` the least recently used is dropped."""
    gen = torch.Generator().manual_seed(1)
    cfg = SolverConfig(method="cg", tol=1e-10, max_iter=200)
    first, second = torch.rand(2, 3, 100, dtype=F64, generator=gen)
    kept = second.clone()
    _both(_kglm(10, 20.0, first), torch.zeros(3, 100, dtype=F64), cfg)
    eager, chunked = _both(_kglm(10, 20.0, second), torch.zeros(3, 100, dtype=F64), cfg)
    _same(eager, chunked)
    assert graphs.cached() == 1
    assert torch.equal(second, kept)
    _both(_kglm(10, 20.0, second[:2]), torch.zeros(2, 100, dtype=F64), cfg)
    assert graphs.cached() == 2


def test_the_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graphs, "CACHE_SIZE", 2)
    cfg = SolverConfig(method="fixed_point", tol=1e-8, max_iter=50, damping=1.0)
    with graphs.replaying_on_cpu():
        for batch in (1, 2, 3):
            solve(_kglm(6, 0.5, torch.ones(batch, 36, dtype=F64)), torch.zeros(batch, 36, dtype=F64), cfg)
    assert graphs.cached() == 2


def test_a_map_that_keeps_state_runs_eagerly_with_the_same_results(caplog: pytest.LogCaptureFixture) -> None:
    """A map counting its own calls changes what its step reads: a replay would not see the change,
    so its key is refused after the first chunk's warm-up (logged once) and the rest runs eagerly. The
    count's value is part of what the step reads: each solve is a key of its own."""
    b = torch.rand(2, 36, dtype=F64, generator=torch.Generator().manual_seed(2))
    inner = _kglm(6, 0.6, b)
    calls = 0

    def counted(z: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return inner(z)

    cfg = SolverConfig(method="fixed_point", tol=1e-12, max_iter=200, damping=1.0)
    eager = solve(counted, torch.zeros(2, 36, dtype=F64), cfg)
    with graphs.replaying_on_cpu():
        chunked = solve(counted, torch.zeros(2, 36, dtype=F64), cfg)
        again = solve(counted, torch.zeros(2, 36, dtype=F64), cfg)
    _same(eager, chunked)
    _same(eager, again)
    assert graphs.cached() == 0
    assert sum("eagerly" in r.message for r in caplog.records) == 2


def test_the_default_denoisers_solve_chunked_is_its_solve() -> None:
    """The shipped default denoiser (its guided kernel's CG, rebuilt around copies of the request's
    weight maps, scale and mean): two images of one size share a key, and each output and its
    statistics are the eager solve's, bit for bit."""
    model = Denoiser(load_checkpoint(find_model(default_models_dir(), "denoise-kglm")), "cpu")
    rng = np.random.default_rng(3)
    for seed in range(2):
        images = torch.from_numpy(rng.random((1, 1, 24, 28), dtype=np.float32))
        eager = model.predict(images, sigma=25.0 + seed)
        with graphs.replaying_on_cpu():
            chunked = model.predict(images, sigma=25.0 + seed)
        assert torch.equal(eager.output, chunked.output)
        assert torch.equal(eager.stats.iterations, chunked.stats.iterations)
        assert torch.equal(eager.stats.residual, chunked.stats.residual)
    assert graphs.cached() == 1


def test_graphs_are_for_cuda_off_by_default_and_can_be_turned_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default until measured on a GPU; ``KDEQ_CUDA_GRAPHS`` on in any of the service's spellings
    of true, off in any of false, and ``pin`` (the service's setting) over the variable."""
    monkeypatch.setattr(graphs, "_pinned", None)  # a service made earlier in this process pinned it
    monkeypatch.delenv(graphs.ENV, raising=False)
    assert graphs.mode(torch.device("cpu")) is None
    assert graphs.mode(torch.device("cuda", 0)) is None
    for on in ("1", "true", "Yes"):
        monkeypatch.setenv(graphs.ENV, on)
        assert graphs.mode(torch.device("cuda", 0)) == "graph"
    for off in ("0", "false", "No", "off"):
        monkeypatch.setenv(graphs.ENV, off)
        assert graphs.mode(torch.device("cuda", 0)) is None
    graphs.pin(True)
    assert graphs.mode(torch.device("cuda", 0)) == "graph"
    graphs.pin(None)
    assert graphs.mode(torch.device("cuda", 0)) is None
    with graphs.replaying_on_cpu():
        assert graphs.mode(torch.device("cpu")) == "eager"


@pytest.mark.parametrize("max_iter", [40, 43, 61, 300])
def test_cg_restarts_spend_the_eager_loops_step_budget(max_iter: int) -> None:
    """CG's true residual is that of ``A′ = (1 + ε)A`` while its recursion solves ``A``: each cycle
    converges on ``A``, the true check restarts it (iterative refinement, the error times ``ε`` a
    cycle), and the cycles' steps add up against ``max_iter``. Replayed chunks report the step the batch
    was done after, as the loop does, so the restarts, counts and results are the loop's bit for bit,
    whether the budget ends mid-cycle or the samples (``ε`` from 0.05 to 0.3) converge. (Reporting the
    chunk's last step instead ends the restarts of 40, 43 and 61 early.)"""
    gen = torch.Generator().manual_seed(4)
    gram = Kernel(lengthscale=2.0, radius=5).gram(grid_coordinates(8, 8)).to(F64)
    gram = gram * 5.0 / dense_spectral_norm(gram)
    eps = torch.tensor([0.05, 0.15, 0.3], dtype=F64)[:, None]
    r0 = torch.rand(3, 64, dtype=F64, generator=gen)
    z0 = torch.zeros(3, 64, dtype=F64)
    cycles = {"n": 0}

    def apply_a(p: torch.Tensor) -> torch.Tensor:
        return p + p @ gram

    def residual(d: torch.Tensor) -> torch.Tensor:  # once per cycle, on the host's side of the loop
        cycles["n"] += 1
        return r0 - (1 + eps) * apply_a(d)

    cfg = SolverConfig(method="cg", tol=1e-10, max_iter=max_iter)
    eager = linear_cg(apply_a, r0, z0, cfg, residual=residual)
    eager_cycles, cycles["n"] = cycles["n"], 0
    with graphs.replaying_on_cpu():
        chunked = linear_cg(apply_a, r0, z0, cfg, residual=residual)
    assert cycles["n"] == eager_cycles >= 3
    assert torch.equal(eager[0], chunked[0]) and torch.equal(eager[2], chunked[2])
    for name in ("iterations", "residual", "converged"):
        assert torch.equal(getattr(eager[1], name), getattr(chunked[1], name)), name
    assert bool(eager[1].converged.all()) == (max_iter == 300)
    assert graphs.cached() == 1


Pair = collections.namedtuple("Pair", "scale shift")


class _Slotted:
    __slots__ = ("shift",)

    def __init__(self, shift: torch.Tensor) -> None:
        self.shift = shift

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return 0.5 * z + self.shift


def _counted(shift: torch.Tensor):
    def f(z: torch.Tensor) -> torch.Tensor:
        return 0.5 * z + shift

    f.calls = 0  # an attribute the rebuilt function would not carry
    return f


def _recursive(shift: torch.Tensor):
    def f(z: torch.Tensor, depth: int = 2) -> torch.Tensor:  # calls itself through its own cell
        return 0.5 * z + shift if depth == 0 else f(z, depth - 1)

    return f


def _paired(shift: torch.Tensor):
    pair = Pair(0.5, shift)
    return lambda z: pair.scale * z + pair.shift


@pytest.mark.parametrize(
    ("make", "replayed"), [(_paired, True), (_recursive, True), (_Slotted, False), (_counted, False)]
)
def test_maps_the_walk_reads_replay_and_the_rest_run_eagerly(make, replayed: bool) -> None:
    """A named tuple and a closure calling itself are rebuilt around the copies; an object with
    ``__slots__`` and a function with attributes hold what the walk does not read, so their keys are
    refused. Each solve is its eager one, bit for bit."""
    shift = torch.rand(2, 30, dtype=F64, generator=torch.Generator().manual_seed(6))
    cfg = SolverConfig(method="fixed_point", tol=1e-12, max_iter=100, damping=1.0)
    eager, chunked = _both(make(shift), torch.zeros(2, 30, dtype=F64), cfg)
    _same(eager, chunked)
    assert graphs.cached() == int(replayed)


def test_parameters_replay_without_grad_and_not_with_it() -> None:
    """A map reading an ``nn.Parameter`` replays under ``no_grad`` and ``inference_mode`` (the copies
    need no autograd there); with grad on, it and a state that requires grad run eagerly, and the
    solve is still the loop's."""
    layer = torch.nn.Linear(30, 30, dtype=F64)
    with torch.no_grad():
        layer.weight.mul_(0.5 / torch.linalg.matrix_norm(layer.weight, 2))
    cfg = SolverConfig(method="fixed_point", tol=1e-12, max_iter=200, damping=1.0)
    z0 = torch.zeros(2, 30, dtype=F64)
    with torch.no_grad():
        _same(*_both(layer, z0, cfg))
    with torch.inference_mode():
        _same(*_both(layer, z0, cfg))
    assert graphs.cached() == 2  # inference mode is part of the key
    graphs.clear()
    _same(*_both(layer, z0, cfg))
    _same(*_both(lambda z: 0.5 * z + 1.0, z0.requires_grad_(), cfg))
    assert graphs.cached() == 0


def test_only_small_batches_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of more than ``GATHER_PIXELS`` pixels is bandwidth-bound: it runs eagerly, no copies
    made; at the bound it replays."""
    b = torch.rand(2, 3, 4, 5, dtype=F64, generator=torch.Generator().manual_seed(7))
    cfg = SolverConfig(method="fixed_point", tol=1e-12, max_iter=100, damping=1.0)
    monkeypatch.setattr(graphs, "GATHER_PIXELS", 2 * 4 * 5 - 1)
    _same(*_both(lambda z: 0.5 * z + b, torch.zeros_like(b), cfg))
    assert graphs.cached() == 0
    monkeypatch.setattr(graphs, "GATHER_PIXELS", 2 * 4 * 5)
    _same(*_both(lambda z: 0.5 * z + b, torch.zeros_like(b), cfg))
    assert graphs.cached() == 1
