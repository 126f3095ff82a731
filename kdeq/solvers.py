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
  ``α ∈ (0, 2m/L²)`` — a monotone DEQ (Winston and Kolter 2020; ``kdeq.mondeq``) — and its fixed
  point is that of ``z = f(z)`` for every ``α``. It refuses any other map (``SPLIT_ONLY`` lists
  such methods).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

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
            (``kdeq.mondeq.monotone_step``).
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


class _Tracker:
    """Per-sample bookkeeping shared by the solvers: best iterate, counts, and the exit test."""

    def __init__(self, z: torch.Tensor, res: torch.Tensor, config: SolverConfig) -> None:
        """``z`` ``(B, ...)`` the start, ``res`` ``(B,)`` its relative residual."""
        self.config = config
        self.best = z.clone()
        self.best_res = res.nan_to_num(nan=torch.inf)
        self.iterations = torch.zeros(z.shape[0], dtype=torch.int64, device=z.device)
        self.active = self.best_res > config.tol
        self.look_ahead = None if z.device.type in SYNC_FREE_DEVICES else _LookAhead(z.device)
        self.history: list[torch.Tensor] | None = [] if config.history else None

    def update(self, step: int, z: torch.Tensor, res: torch.Tensor) -> bool:
        """Record iterate ``z`` with its relative residual ``res`` ``(B,)`` for the samples still
        active; return True to stop (module docstring: at once on the CPU, one step late elsewhere)."""
        if self.history is not None:  # kept on the device: no host read per step
            self.history.append(torch.where(self.active, res, torch.nan))
        res = torch.where(self.active, res, torch.inf)
        self.iterations += self.active.to(torch.int64)
        better = res < self.best_res
        self.best = torch.where(_expand(better, z), z, self.best)
        self.best_res = torch.where(better, res, self.best_res)
        self.active = self.active & (self.best_res > self.config.tol) & ~torch.isnan(res)
        if self.look_ahead is None:
            return not bool(self.active.any())
        period = self.config.check_every
        # this step's work is queued: read the flag posted one step ago, then post this step's
        done = step % period == 0 and self.look_ahead.read() is False
        if (step + 1) % period == 0:
            self.look_ahead.post(self.active.any())
        return done

    def restart(self, active: torch.Tensor) -> None:
        """Resume the samples ``active`` ``(B,)`` (CG's restarts); a flag posted before is stale."""
        self.active = active
        if self.look_ahead is not None:
            self.look_ahead.pending = None

    def result(self) -> tuple[torch.Tensor, SolverStats]:
        history = None
        if self.history is not None:
            empty = self.best_res.new_empty(self.best_res.shape[0], 0)
            history = torch.stack(self.history, dim=1) if self.history else empty
        stats = SolverStats(
            iterations=self.iterations,
            residual=self.best_res,
            converged=self.best_res <= self.config.tol,
            history=history,
        )
        return self.best, stats


def fixed_point(f: Map, z0: torch.Tensor, config: SolverConfig) -> tuple[torch.Tensor, SolverStats]:
    """Damped Picard iteration ``z_{k+1} = (1−β) z_k + β f(z_k)``."""
    z, fz = z0, f(z0)
    track = _Tracker(z, _rel_residual(fz, z, config.atol), config)
    beta = config.damping
    for step in range(1, config.max_iter + 1):
        keep = _expand(track.active, z)
        z = torch.where(keep, (1.0 - beta) * z + beta * fz, z)
        fz = f(z)
        if track.update(step, z, _rel_residual(fz, z, config.atol)):
            break
    return track.result()


def anderson(f: Map, z0: torch.Tensor, config: SolverConfig) -> tuple[torch.Tensor, SolverStats]:
    """Anderson acceleration: ``z_{k+1} = Σ_i α_i (β f(z_i) + (1−β) z_i)`` over the last ``m`` iterates,
    with ``α = argmin ‖Σ_i α_i g_i‖² + r‖α‖²`` subject to ``Σ_i α_i = 1``, ``g_i = f(z_i) − z_i``.

    The ``(m+1)×(m+1)`` bordered system is solved in float64 per sample; a
    sample whose system is singular or non-finite takes a plain damped step.

    Safeguard: an extrapolated step whose residual ‖g‖/‖f‖ grows past ``SAFEGUARD`` times its
    predecessor's is undone, and that sample's history restarts at its last accepted iterate, so its
    next step is the plain damped one from there, which is always kept. A stiff exponential map
    (the photon denoiser's at thousands of counts, ``kdeq.photon``) otherwise extrapolates into a
    region where ``f`` explodes, again and again: without it such a solve stalled at a residual of
    1.6e-2 for 400 steps. The undone step counts as an iteration; it costs no extra evaluation of
    ``f``, and a host read only on the CPU, where it is free. A non-finite residual is not undone:
    it stops the sample, as in every solver.
    """
    bsz = z0.shape[0]
    shape = z0.shape
    m = config.memory
    beta = config.damping
    xs = torch.zeros(bsz, m, z0[0].numel(), dtype=z0.dtype, device=z0.device)
    fs = torch.zeros_like(xs)

    z, fz = z0, f(z0)
    res = _rel_residual(fz, z, config.atol)
    track = _Tracker(z, res, config)
    # a history of one point: the next step is the plain damped one, which is not undone
    fresh = torch.ones_like(track.active)
    xs[:, 0], fs[:, 0] = z.reshape(bsz, -1), fz.reshape(bsz, -1)
    for step in range(1, config.max_iter + 1):
        n = min(step, m)
        g = (fs[:, :n] - xs[:, :n]).to(torch.float64)
        gram = g @ g.transpose(1, 2)
        scale = gram.diagonal(dim1=1, dim2=2).mean(dim=1).clamp(min=torch.finfo(torch.float64).tiny)
        system = torch.zeros(bsz, n + 1, n + 1, dtype=torch.float64, device=z0.device)
        system[:, 0, 1:] = 1.0
        system[:, 1:, 0] = 1.0
        system[:, 1:, 1:] = gram + (config.regularization * scale)[:, None, None] * torch.eye(
            n, dtype=torch.float64, device=z0.device
        )
        rhs = torch.zeros(bsz, n + 1, 1, dtype=torch.float64, device=z0.device)
        rhs[:, 0] = 1.0
        sol, info = torch.linalg.solve_ex(system, rhs)
        alpha = sol[:, 1:, 0]
        latest = (step - 1) % m
        plain = torch.zeros_like(alpha)
        plain[:, latest] = 1.0
        bad = (info != 0) | ~torch.isfinite(alpha).all(dim=1)
        alpha = torch.where(bad[:, None], plain, alpha).to(z0.dtype)

        mixed = beta * torch.einsum("bi,bin->bn", alpha, fs[:, :n])
        if beta < 1.0:
            mixed = mixed + (1.0 - beta) * torch.einsum("bi,bin->bn", alpha, xs[:, :n])
        keep = _expand(track.active, z)
        stepped = torch.where(keep, mixed.reshape(shape), z)
        f_stepped = f(stepped)
        new = _rel_residual(f_stepped, stepped, config.atol)
        undo = track.active & ~fresh & (new > SAFEGUARD * res)  # NaN compares False: it stops the sample
        fresh = undo
        back = _expand(undo, z)
        z, fz = torch.where(back, z, stepped), torch.where(back, fz, f_stepped)
        res = torch.where(undo, res, new)
        slot = step % m
        xs[:, slot], fs[:, slot] = z.reshape(bsz, -1), fz.reshape(bsz, -1)
        if track.look_ahead is not None or bool(undo.any()):  # the host read is free on the CPU only
            restart = undo[:, None, None]
            xs.copy_(torch.where(restart, z.reshape(bsz, 1, -1), xs))
            fs.copy_(torch.where(restart, fz.reshape(bsz, 1, -1), fs))
        if track.update(step, z, res):
            break
    return track.result()


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

    def relative(d: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return _ratio(r, z0 + d + r, config.atol)

    d = torch.zeros_like(z0)
    r = r0
    track = _Tracker(d, relative(d, r), config)
    step = 0
    while True:
        y = r if identity else precondition(r)
        p = y
        ry = _bdot(r, y)
        first = None
        while step < config.max_iter:
            step += 1
            ap = apply_a(p)
            pap = _bdot(p, ap)
            ok = track.active & (pap > 0) & torch.isfinite(pap)
            track.active = ok
            a = torch.where(ok, ry / pap.clamp(min=_TINY64), 0.0).to(z0.dtype)
            d = d + _expand(a, d) * p
            r = r - _expand(a, r) * ap
            first = (d, r) if first is None else first
            if track.update(step, d, relative(d, r)):
                break
            y = r if identity else precondition(r)
            ry_new = _bdot(r, y)
            beta = torch.where(ok, ry_new / ry.clamp(min=_TINY64), 0.0).to(z0.dtype)
            p = y + _expand(beta, p) * p
            ry = torch.where(ok, ry_new, ry)
        d = track.best
        if residual is not None:
            r = residual(d)
        elif first is not None and torch.equal(d, first[0]):
            r = first[1]
        else:
            r = r0 - apply_a(d)
        true_res = relative(d, r).nan_to_num(nan=torch.inf)
        track.best_res = true_res
        retry = (true_res > config.tol) & torch.isfinite(true_res) & (track.iterations < config.max_iter)
        if step >= config.max_iter or not bool(retry.any()):
            break
        track.restart(retry)
    d, stats = track.result()
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
            "forward_backward needs f as a kdeq.solvers.SplitMap (pre: z ↦ Wz + b, "
            f"prox: (x, α) ↦ prox_αφ(x), step: α), got {type(f).__name__}"
        )
    alpha = f.step
    if not 0.0 < alpha < float("inf"):
        raise ValueError(f"forward_backward needs a finite step α > 0, got {alpha}")
    z = z0
    p = f.pre(z)
    fz = f.prox(p, 1.0)
    track = _Tracker(z, _rel_residual(fz, z, config.atol), config)
    for step in range(1, config.max_iter + 1):
        keep = _expand(track.active, z)
        z = torch.where(keep, f.prox((1.0 - alpha) * z + alpha * p, alpha), z)
        p = f.pre(z)
        fz = f.prox(p, 1.0)
        if track.update(step, z, _rel_residual(fz, z, config.atol)):
            break
    return track.result()


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
