"""Fixed-point solvers behind one contract: ``solve(f, z0, config) -> (z, stats)``.

``f`` maps a batch ``(B, ...)`` to a batch of the same shape, and samples are
independent: ``f(z)[b]`` depends on ``z[b]`` only. Each solver tracks, per
sample, the relative residual ``‖f(z) − z‖/max(‖f(z)‖, a√n)`` (``n`` entries
per sample, ``a`` the config's ``atol``: the floor only matters for a fixed
point near 0, where a pure ratio can never fall) and returns the best
iterate it saw, with its residual. A sample stops iterating (and counting)
the step its residual reaches ``tol``. Whether the whole batch is done is read
by the host every step on the CPU, where reading the flag costs nothing. On an
asynchronous device (CUDA) a blocking read would drain the device's queue every
step, so the flag is copied to the host without blocking and read one step
later, once the next step's work is queued: a converged batch stops after one
look-ahead step, never more, whose map evaluation is counted by no sample
(``tests/test_solvers.py`` counts the evaluations on a simulated asynchronous
device).

Solvers (registry ``SOLVERS``):

- ``fixed_point``: damped iteration ``z ← (1−β)z + βf(z)``; converges when
  ``f`` is a contraction (Assumption 2).
- ``anderson``: Anderson acceleration (type II) with memory ``m``; converges
  well beyond the contraction regime.
- ``cg``: conjugate gradients for affine ``f(z) = b − Az + z`` with ``A = I − ∂f``
  symmetric positive definite — the linear Gaussian kGLM, where
  ``A = I + K/λ``. It uses only evaluations of ``f``.
- ``forward_backward``: forward–backward splitting for ``f = prox_φ ∘ pre`` given in split form
  (``SplitMap``): ``z ← prox_{αφ}((1−α)z + α·pre(z))``. For ``pre(z) = Wz + b`` with
  ``I − W ⪰ mI`` and ``‖I − W‖₂ ≤ L`` it contracts by ``√(1 − 2αm + α²L²)`` for every
  ``α ∈ (0, 2m/L²)`` — a monotone DEQ (Winston and Kolter 2020; ``kdeq.research.mondeq``) — and its fixed
  point is that of ``z = f(z)`` for every ``α``. It refuses any other map (``SPLIT_ONLY`` lists
  such methods).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from kdeq.maths import graphs

Map = Callable[[torch.Tensor], torch.Tensor]


class SolverConfig(BaseModel):
    """Typed, frozen solver settings; unknown keys are an error.

    Attributes:
        method: ``fixed_point`` | ``anderson`` | ``cg`` | ``forward_backward`` (the last needs a
            ``SplitMap`` and takes its step ``α`` from it, not ``damping``).
        tol: target relative residual ``‖f(z) − z‖/‖f(z)‖``.
        max_iter: iteration cap per sample.
        check_every: on devices outside ``SYNC_FREE_DEVICES``, the host reads the batch's
            look-ahead convergence flag every ``check_every`` steps (1: a converged batch stops
            after one look-ahead step; more saves host reads at the price of up to ``check_every``
            map evaluations past convergence). On the CPU the flag is read every step.
        damping: ``β`` in ``(1−β)z + βf(z)`` (fixed point) and in Anderson's mixing.
        memory: Anderson's history length ``m``.
        regularization: Anderson's Tikhonov term, relative to the mean squared
            residual of the history (scale-free).
        atol: root-mean-square floor ``a`` under the residual's denominator.
        history: record each step's relative residual (``SolverStats.history``); a per-call
            choice, never stored with a model (``exclude``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["fixed_point", "anderson", "cg", "forward_backward"] = "anderson"
    tol: float = Field(1e-4, gt=0)
    max_iter: int = Field(200, ge=1)
    check_every: int = Field(1, ge=1)
    damping: float = Field(0.5, gt=0, le=1)
    memory: int = Field(10, ge=1)
    regularization: float = Field(1e-8, ge=0)
    atol: float = Field(1e-8, ge=0)
    history: bool = Field(False, exclude=True)


@dataclass(frozen=True)
class SolverStats:
    """Per-sample solve statistics; every field has shape ``(B,)``.

    Attributes:
        iterations: ``int64``, steps taken until the residual reached ``tol``
            (or the cap, or the step a non-finite value appeared).
        residual: relative residual ``‖f(z) − z‖/‖f(z)‖`` of the returned iterate.
        converged: ``bool``, ``residual ≤ tol``.
        history: ``(B, T)``, when the solve was asked for it (``SolverConfig.history``): the
            relative residual of each sample's iterate at each of the ``T ≤ max_iter`` steps the
            batch took, NaN where the sample had stopped; else ``None``.
    """

    iterations: torch.Tensor
    residual: torch.Tensor
    converged: torch.Tensor
    history: torch.Tensor | None = None


@dataclass(frozen=True)
class SplitMap:
    """``f(z) = prox_φ(pre(z))`` with ``pre(z) = W z + b`` affine: the split form forward–backward needs.

    Attributes:
        pre: ``z ↦ W z + b``, a batch ``(B, ...) → (B, ...)``.
        prox: ``(x, α) ↦ prox_{αφ}(x) = (I + α(σ⁻¹ − I))⁻¹(x)`` elementwise for ``σ = prox_φ``;
            ``α = 1`` gives ``σ`` itself.
        step: the forward–backward step ``α > 0``, chosen by whoever knows ``m`` and ``L``
            (``kdeq.research.mondeq.monotone_step``).
    """

    pre: Map
    prox: Callable[[torch.Tensor, float], torch.Tensor]
    step: float

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """``f(z) = σ(W z + b)`` ``(B, ...)``."""
        return self.prox(self.pre(z), 1.0)


def chained(stats: Sequence[SolverStats]) -> SolverStats:
    """The statistics of solves run one after another on a batch: iterations summed, the worst
    residual, converged when every solve did, and the histories joined step after step (``None``
    unless every solve recorded one)."""
    histories = [st.history for st in stats]
    return SolverStats(
        torch.stack([st.iterations for st in stats]).sum(0),
        torch.stack([st.residual.to(stats[0].residual.dtype) for st in stats]).amax(0),
        torch.stack([st.converged for st in stats]).all(0),
        None if any(h is None for h in histories) else torch.cat(histories, dim=1),
    )


#: device types whose tensors are read by the host without waiting for queued work
SYNC_FREE_DEVICES = frozenset({"cpu"})
#: Anderson undoes a step whose relative residual grows past this factor (``anderson``)
SAFEGUARD = 2.0

_TINY64 = torch.finfo(torch.float64).tiny


def _flat_norm(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).norm(dim=1)


def _bdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``⟨a_b, b_b⟩`` per sample ``(B,)``, accumulated in float64 (CG's step lengths at
    ``‖A‖ ~ 10⁴`` lose digits to a float32 sum over a megapixel), returned in float64."""
    return (a.reshape(a.shape[0], -1) * b.reshape(b.shape[0], -1)).sum(dim=1, dtype=torch.float64)


def _ratio(r: torch.Tensor, fz: torch.Tensor, atol: float) -> torch.Tensor:
    """``‖r‖/max(‖f(z)‖, atol·√n)`` per sample for the residual ``r = f(z) − z``; NaN where either
    is non-finite."""
    floor = max(atol * fz[0].numel() ** 0.5, torch.finfo(fz.dtype).tiny)
    ratio = _flat_norm(r) / _flat_norm(fz).clamp(min=floor)
    return torch.where(torch.isfinite(ratio), ratio, torch.nan)


def _rel_residual(fz: torch.Tensor, z: torch.Tensor, atol: float) -> torch.Tensor:
    """``‖f(z) − z‖/max(‖f(z)‖, atol·√n)`` per sample; NaN where either is non-finite."""
    return _ratio(fz - z, fz, atol)


def _expand(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.reshape(mask.shape[0], *([1] * (like.dim() - 1)))


class _LookAhead:
    """The batch's "still active" flag, posted to the host without blocking and read one post later.

    On CUDA the flag is copied into pinned host memory behind an event; reading it waits for that
    event only, which the device passed long ago if the host is ahead by a step. Other asynchronous
    devices (and the tests' simulated one) keep the posted flag as a device tensor.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        if self.cuda:
            self.buffers = [torch.empty((), dtype=torch.bool, pin_memory=True) for _ in range(2)]
            self.turn = 0

    def post(self, flag: torch.Tensor) -> None:
        if not self.cuda:
            self.pending = (flag.clone(), None)
            return
        host = self.buffers[self.turn]
        self.turn = 1 - self.turn
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending = (host, event)

    def read(self) -> bool | None:
        """The last posted flag (``None`` before the first post)."""
        if self.pending is None:
            return None
        flag, event = self.pending
        if event is not None:
            event.synchronize()
        return bool(flag)


#: a solve's per-sample bookkeeping and its method's own tensors, by name: ``best`` ``(B, ...)`` the
#: best iterate, ``best_res`` ``(B,)`` its relative residual, ``iterations`` ``(B,)`` int64 the steps
#: counted, ``active`` ``(B,)`` bool the samples still iterating
State = dict[str, torch.Tensor]
#: one step of a method: ``advance(state, step)`` updates ``state`` (rebinding its entries, or writing
#: them in place) with device work only, no host read, and returns it
Advance = Callable[[State, int], State]


def _start(z: torch.Tensor, res: torch.Tensor, config: SolverConfig) -> State:
    """The bookkeeping of a solve from ``z`` ``(B, ...)`` with relative residual ``res`` ``(B,)``."""
    best_res = res.nan_to_num(nan=torch.inf)
    return {
        "best": z.clone(),
        "best_res": best_res,
        "iterations": torch.zeros(z.shape[0], dtype=torch.int64, device=z.device),
        "active": best_res > config.tol,
    }


def _record(
    s: State, z: torch.Tensor, res: torch.Tensor, tol: float, history: list[torch.Tensor] | None
) -> None:
    """Record iterate ``z`` with its relative residual ``res`` ``(B,)`` for the samples still active: a
    sample counts the step, keeps ``z`` where it is its best, and stops once its best residual reaches
    ``tol`` (or ``res`` is NaN)."""
    if history is not None:  # kept on the device: no host read per step
        history.append(torch.where(s["active"], res, torch.nan))
    res = torch.where(s["active"], res, torch.inf)
    s["iterations"] = s["iterations"] + s["active"].to(torch.int64)
    better = res < s["best_res"]
    s["best"] = torch.where(_expand(better, z), z, s["best"])
    s["best_res"] = torch.where(better, res, s["best_res"])
    s["active"] = s["active"] & (s["best_res"] > tol) & ~torch.isnan(res)


class _Exit:
    """Whether the batch is done after a step: read at once on the CPU, one step late elsewhere
    (module docstring)."""

    def __init__(self, device: torch.device, config: SolverConfig) -> None:
        self.period = config.check_every
        self.look_ahead = None if device.type in SYNC_FREE_DEVICES else _LookAhead(device)

    def done(self, step: int, active: torch.Tensor) -> bool:
        if self.look_ahead is None:
            return not bool(active.any())
        # this step's work is queued: read the flag posted one step ago, then post this step's
        done = step % self.period == 0 and self.look_ahead.read() is False
        if (step + 1) % self.period == 0:
            self.look_ahead.post(active.any())
        return done


def _iterate(
    advance: Advance,
    s: State,
    config: SolverConfig,
    start: int,
    phase: Callable[[int], Hashable] | None = None,
) -> tuple[State, int]:
    """``s`` after ``advance`` ran steps ``start, start + 1, …`` until the batch is done or step
    ``max_iter`` ran, and the last step run (``start − 1`` if none). Where ``kdeq.maths.graphs`` replays
    steps (CUDA), it runs them in captured chunks (``phase(step)``: what of ``step`` a step's work
    depends on, ``None`` for nothing); elsewhere, and for any steps it leaves, one at a time here."""
    step = start - 1
    if config.max_iter < start:
        return s, step
    device = s["active"].device
    if config.history is False and graphs.mode(device) is not None:
        s, step, finished = graphs.iterate(advance, s, start, config.max_iter, phase or _no_phase)
        if finished:
            return s, step
    done, first = _Exit(device, config), step + 1
    for step in range(first, config.max_iter + 1):
        s = advance(s, step)
        if done.done(step, s["active"]):
            break
    return s, step


def _no_phase(step: int) -> None:
    return None


def _result(
    s: State, config: SolverConfig, history: list[torch.Tensor] | None
) -> tuple[torch.Tensor, SolverStats]:
    stacked = None
    if history is not None:
        empty = s["best_res"].new_empty(s["best_res"].shape[0], 0)
        stacked = torch.stack(history, dim=1) if history else empty
    stats = SolverStats(
        iterations=s["iterations"],
        residual=s["best_res"],
        converged=s["best_res"] <= config.tol,
        history=stacked,
    )
    return s["best"], stats


def fixed_point(f: Map, z0: torch.Tensor, config: SolverConfig) -> tuple[torch.Tensor, SolverStats]:
    """Damped Picard iteration ``z_{k+1} = (1−β) z_k + β f(z_k)``."""
    fz = f(z0)
    s = _start(z0, _rel_residual(fz, z0, config.atol), config)
    s["z"], s["fz"] = z0, fz
    beta, atol, tol = config.damping, config.atol, config.tol
    history: list[torch.Tensor] | None = [] if config.history else None

    def advance(s: State, step: int) -> State:
        z = torch.where(_expand(s["active"], s["z"]), (1.0 - beta) * s["z"] + beta * s["fz"], s["z"])
        fz = f(z)
        _record(s, z, _rel_residual(fz, z, atol), tol, history)
        s["z"], s["fz"] = z, fz
        return s

    s, _ = _iterate(advance, s, config, 1)
    return _result(s, config, history)


def anderson(f: Map, z0: torch.Tensor, config: SolverConfig) -> tuple[torch.Tensor, SolverStats]:
    """Anderson acceleration: ``z_{k+1} = Σ_i α_i (β f(z_i) + (1−β) z_i)`` over the last ``m`` iterates,
    with ``α = argmin ‖Σ_i α_i g_i‖² + r‖α‖²`` subject to ``Σ_i α_i = 1``, ``g_i = f(z_i) − z_i``.

    The ``(m+1)×(m+1)`` bordered system is solved in float64 per sample; a
    sample whose system is singular or non-finite takes a plain damped step.

    Safeguard: an extrapolated step whose residual ‖g‖/‖f‖ grows past ``SAFEGUARD`` times its
    predecessor's is undone, and that sample's history restarts at its last accepted iterate, so its
    next step is the plain damped one from there, which is always kept. A stiff exponential map
    (the photon denoiser's at thousands of counts, ``kdeq.predictors.photon``) otherwise extrapolates into a
    region where ``f`` explodes, again and again: without it such a solve stalled at a residual of
    1.6e-2 for 400 steps. The undone step counts as an iteration; it costs no extra evaluation of
    ``f``, and a host read only on the CPU, where it is free. A non-finite residual is not undone:
    it stops the sample, as in every solver.
    """
    bsz = z0.shape[0]
    shape = z0.shape
    m = config.memory
    beta, atol, tol, reg = config.damping, config.atol, config.tol, config.regularization
    sync_free = z0.device.type in SYNC_FREE_DEVICES
    history: list[torch.Tensor] | None = [] if config.history else None

    fz = f(z0)
    res = _rel_residual(fz, z0, atol)
    s = _start(z0, res, config)
    s["z"], s["fz"], s["res"] = z0, fz, res
    s["xs"] = torch.zeros(bsz, m, z0[0].numel(), dtype=z0.dtype, device=z0.device)
    s["fs"] = torch.zeros_like(s["xs"])
    # a history of one point: the next step is the plain damped one, which is not undone
    s["fresh"] = torch.ones_like(s["active"])
    s["xs"][:, 0], s["fs"][:, 0] = z0.reshape(bsz, -1), fz.reshape(bsz, -1)

    def advance(s: State, step: int) -> State:
        xs, fs, z, fz, res = s["xs"], s["fs"], s["z"], s["fz"], s["res"]
        n = min(step, m)
        g = (fs[:, :n] - xs[:, :n]).to(torch.float64)
        gram = g @ g.transpose(1, 2)
        scale = gram.diagonal(dim1=1, dim2=2).mean(dim=1).clamp(min=torch.finfo(torch.float64).tiny)
        system = torch.zeros(bsz, n + 1, n + 1, dtype=torch.float64, device=z.device)
        system[:, 0, 1:] = 1.0
        system[:, 1:, 0] = 1.0
        system[:, 1:, 1:] = gram + (reg * scale)[:, None, None] * torch.eye(
            n, dtype=torch.float64, device=z.device
        )
        rhs = torch.zeros(bsz, n + 1, 1, dtype=torch.float64, device=z.device)
        rhs[:, 0] = 1.0
        sol, info = torch.linalg.solve_ex(system, rhs)
        alpha = sol[:, 1:, 0]
        latest = (step - 1) % m
        plain = torch.zeros_like(alpha)
        plain[:, latest] = 1.0
        bad = (info != 0) | ~torch.isfinite(alpha).all(dim=1)
        alpha = torch.where(bad[:, None], plain, alpha).to(z.dtype)

        mixed = beta * torch.einsum("bi,bin->bn", alpha, fs[:, :n])
        if beta < 1.0:
            mixed = mixed + (1.0 - beta) * torch.einsum("bi,bin->bn", alpha, xs[:, :n])
        stepped = torch.where(_expand(s["active"], z), mixed.reshape(shape), z)
        f_stepped = f(stepped)
        new = _rel_residual(f_stepped, stepped, atol)
        undo = s["active"] & ~s["fresh"] & (new > SAFEGUARD * res)  # NaN compares False: it stops the sample
        back = _expand(undo, z)
        z, fz = torch.where(back, z, stepped), torch.where(back, fz, f_stepped)
        res = torch.where(undo, res, new)
        slot = step % m
        xs[:, slot], fs[:, slot] = z.reshape(bsz, -1), fz.reshape(bsz, -1)
        if not sync_free or bool(undo.any()):  # the host read is free on the CPU only
            restart = undo[:, None, None]
            xs.copy_(torch.where(restart, z.reshape(bsz, 1, -1), xs))
            fs.copy_(torch.where(restart, fz.reshape(bsz, 1, -1), fs))
        _record(s, z, res, tol, history)
        s["z"], s["fz"], s["res"], s["fresh"] = z, fz, res, undo
        return s

    # a step's work depends on the history's length and on which of its slots are the latest
    s, _ = _iterate(advance, s, config, 1, lambda step: (min(step, m), step % m))
    return _result(s, config, history)


def linear_cg(
    apply_a: Map,
    r0: torch.Tensor,
    z0: torch.Tensor,
    config: SolverConfig,
    precondition: Map | None = None,
    residual: Map | None = None,
) -> tuple[torch.Tensor, SolverStats, torch.Tensor]:
    """Preconditioned CG on ``A z = b`` per sample from ``z0`` ``(B, …)`` given its residual
    ``r0 = b − A z0``; ``A`` and ``P⁻¹`` SPD. ``residual(d)``, when given, computes the true
    residual ``b − A(z0 + d)`` in whichever way is most accurate for the caller (a caller holding
    ``f`` evaluates ``f(z) − z``); by default it is ``r0 − A d``.

    Returns the best iterate ``z``, its statistics and its true residual ``b − Az``
    (so ``f(z) = z + b − Az`` costs the caller no further application of ``A``).

    ``b − Az`` is the fixed-point residual ``f(z) − z`` of ``f(z) = z − Az + b``
    and is tracked as the other solvers track theirs. CG runs on the correction
    ``d = z − z0``, ``A d = r0``, accumulated apart from ``z0``: in float32 an
    iterate ``z`` carries a rounding error of ``2⁻²⁴‖z‖``, which ``A`` magnifies to
    a residual of ``2⁻²⁴‖A‖‖z‖`` — above the tolerance once ``‖A‖`` passes ~10³
    (a denoiser at σ ≤ 2) — while ``d`` is small where ``z0`` is close, and the
    residual ``r0 − A d`` carries only ``2⁻²⁴‖A‖‖d‖``. So the caller should form
    ``r0`` accurately (from ``t − z0``, not ``b − A z0``) and start close: the
    statistics then describe ``z0 + d`` before its final rounding to float32,
    which moves ``z`` by at most half a unit in the last place.

    The CG residual is updated by recursion; in finite precision it drifts from
    the true ``r0 − A d``, so when the recursion says a sample has converged its
    true residual is computed, and a sample that has not truly converged
    restarts from its best iterate (while its iteration budget lasts). Where the
    best iterate is a cycle's first step ``d + αp`` (a denoiser's usual one-step
    solve) there is nothing to drift: its residual ``r − α·Ap`` is formed from the
    product ``Ap`` itself, as accurate as applying ``A`` once more, so that
    application is saved (without ``residual``). A sample
    whose curvature ``pᵀAp`` is not positive stops (its best iterate stands).
    Inner products accumulate in float64.
    """
    identity = precondition is None
    atol, tol = config.atol, config.tol
    history: list[torch.Tensor] | None = [] if config.history else None

    def relative(d: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return _ratio(r, z0 + d + r, atol)

    def direction(r: torch.Tensor) -> torch.Tensor:
        return r if identity else precondition(r)

    def advance(s: State, step: int) -> State:
        p, ry = s["p"], s["ry"]
        ap = apply_a(p)
        pap = _bdot(p, ap)
        ok = s["active"] & (pap > 0) & torch.isfinite(pap)
        s["active"] = ok
        a = torch.where(ok, ry / pap.clamp(min=_TINY64), 0.0).to(z0.dtype)
        d = s["d"] + _expand(a, p) * p
        r = s["r"] - _expand(a, ap) * ap
        # a cycle's first step, kept: its residual is the product's own (docstring)
        s["first_d"] = torch.where(s["fresh"], d, s["first_d"])
        s["first_r"] = torch.where(s["fresh"], r, s["first_r"])
        s["fresh"] = torch.zeros_like(s["fresh"])
        _record(s, d, relative(d, r), tol, history)
        # the next step's direction, made on every step, the last too (none reads it then), so that
        # a step is the same work whichever step it is
        y = direction(r)
        ry_new = _bdot(r, y)
        beta = torch.where(ok, ry_new / ry.clamp(min=_TINY64), 0.0).to(z0.dtype)
        s["d"], s["r"], s["p"], s["ry"] = d, r, y + _expand(beta, p) * p, torch.where(ok, ry_new, ry)
        return s

    d = torch.zeros_like(z0)
    s = _start(d, relative(d, r0), config)
    s["d"], s["r"], s["first_d"], s["first_r"] = d, r0, d, r0
    step = 0
    while True:
        y = direction(s["r"])
        s["p"], s["ry"] = y, _bdot(s["r"], y)
        s["fresh"] = torch.ones((), dtype=torch.bool, device=z0.device)
        cycle = step
        s, step = _iterate(advance, s, config, step + 1)
        d = s["best"]
        if residual is not None:
            r = residual(d)
        elif step > cycle and torch.equal(d, s["first_d"]):
            r = s["first_r"]
        else:
            r = r0 - apply_a(d)
        true_res = relative(d, r).nan_to_num(nan=torch.inf)
        s["best_res"] = true_res
        retry = (true_res > tol) & torch.isfinite(true_res) & (s["iterations"] < config.max_iter)
        if step >= config.max_iter or not bool(retry.any()):
            break
        # a restart from the best iterate, of the samples that have not truly converged
        s["active"], s["d"], s["r"] = retry, d, r
    d, stats = _result(s, config, history)
    return z0 + d, stats, r


def conjugate_gradient(f: Map, z0: torch.Tensor, config: SolverConfig) -> tuple[torch.Tensor, SolverStats]:
    """Conjugate gradients on ``A z = b`` with ``A z = z − f(z) + f(0)`` and ``b = f(0)`` (``linear_cg``).

    Valid when ``f`` is affine and ``I − ∂f`` is symmetric positive definite.
    """
    f0 = f(torch.zeros_like(z0))

    def residual(d: torch.Tensor) -> torch.Tensor:
        z = z0 + d
        return f(z) - z

    z, stats, _ = linear_cg(lambda p: p - (f(p) - f0), f(z0) - z0, z0, config, residual=residual)
    return z, stats


def forward_backward(f: Map, z0: torch.Tensor, config: SolverConfig) -> tuple[torch.Tensor, SolverStats]:
    """Forward–backward splitting ``z_{k+1} = prox_{αφ}((1−α) z_k + α pre(z_k))`` for ``f`` a
    ``SplitMap`` (its ``step`` is ``α``; ``config.damping`` is not used).

    ``(1−α)z + α(Wz + b) = z − α((I − W)z − b)`` is the forward (gradient) step on the monotone
    operator ``I − W``, and ``prox_{αφ}`` the backward step. Each step evaluates ``pre`` once: its
    value serves both the residual ``f(z) − z = prox_φ(pre(z)) − z`` of the iterate and the next step.
    """
    if not isinstance(f, SplitMap):
        raise TypeError(
            "forward_backward needs f as a kdeq.maths.solvers.SplitMap (pre: z ↦ Wz + b, "
            f"prox: (x, α) ↦ prox_αφ(x), step: α), got {type(f).__name__}"
        )
    alpha = f.step
    if not 0.0 < alpha < float("inf"):
        raise ValueError(f"forward_backward needs a finite step α > 0, got {alpha}")
    atol, tol = config.atol, config.tol
    history: list[torch.Tensor] | None = [] if config.history else None
    p = f.pre(z0)
    fz = f.prox(p, 1.0)
    s = _start(z0, _rel_residual(fz, z0, atol), config)
    s["z"], s["p"] = z0, p

    def advance(s: State, step: int) -> State:
        z = torch.where(
            _expand(s["active"], s["z"]), f.prox((1.0 - alpha) * s["z"] + alpha * s["p"], alpha), s["z"]
        )
        p = f.pre(z)
        fz = f.prox(p, 1.0)
        _record(s, z, _rel_residual(fz, z, atol), tol, history)
        s["z"], s["p"] = z, p
        return s

    s, _ = _iterate(advance, s, config, 1)
    return _result(s, config, history)


Solver = Callable[[Map, torch.Tensor, SolverConfig], tuple[torch.Tensor, SolverStats]]

SOLVERS: dict[str, Solver] = {
    "fixed_point": fixed_point,
    "anderson": anderson,
    "cg": conjugate_gradient,
    "forward_backward": forward_backward,
}

#: the registered methods that need ``f`` in split form (``SplitMap``), not any map
SPLIT_ONLY = frozenset({"forward_backward"})


def solve(f: Map, z0: torch.Tensor, config: SolverConfig) -> tuple[torch.Tensor, SolverStats]:
    """Find ``z = f(z)`` from ``z0`` ``(B, ...)`` with ``config.method``; see the module docstring."""
    return SOLVERS[config.method](f, z0, config)
