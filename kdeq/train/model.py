"""A checkpoint's model with its tensors as parameters, kept a kernel model while it trains.

The forward pass is the task predictor's own ``forward`` (so training optimises
exactly what the service runs), with the checkpoint's tensors replaced by
constrained views of the parameters:

- the equilibrium kernel (``w1`` of a conv model, ``spatial`` of a guided one) is
  symmetric by construction, ``C = (P + P^⊤)/2`` with ``P^⊤[o, i, n] = P[i, o, −n]``, and stays
  positive semi-definite (``project_``): a step that would leave the PSD set is shortened to the
  longest feasible fraction ``t`` of itself (the smallest eigenvalue of the symbol ``Ĉ(ω)`` is
  concave along a line, so the feasible ``t`` form an interval, found by bisection). So the fixed
  point stays unique (DESIGN §2.1) and CG stays valid. Lifting the whole symbol instead (adding
  ``δ·I``) would be a projection too, but every lift adds to the regularisation and they pile up:
  in a 96-step inpainting run the centre tap drifted from 1.0 to 1.22 and the model got worse
  even on its own training data. A random start that is not PSD is lifted once;
- a conv model's other maps keep or relax the kGLM relations ``w2 = w1`` and ``v1 = v2``. With
  the noise ``λ`` rule they are kept (``w1`` and ``v2`` are learned, two kernels): the layer's
  ``W2 − W1 = (w2 − w1)/λ`` would otherwise multiply the input by ``1/λ``, which grows without
  bound as the noise level falls, so no fixed offset is safe at every σ. With a fixed ``λ`` they
  are relaxed as offsets, ``w2 = w1 + λΔ_w`` and ``v1 = v2 − λΔ_v`` with ``Δ = 0`` at the kGLM
  start, so a step in ``Δ`` moves the output by ``O(step)``, as a step in ``w2`` itself would not;
- a bank the task's predictor does not read (``Predictor.reads``: the deblurrer and the
  super-resolver read ``w1`` alone) is not learned;
- the guide's smoothing taps (guided) are symmetric;
- a guided model also learns ``log`` factors on ``λ`` and on the bandwidth ``h``
  (its normalised kernel is blind to the scale of ``spatial``, so ``λ`` needs its own);
  ``export`` folds them back into the ``λ`` rule and the kernel's ``bandwidth``;
- a guided model with a guide network (``kdeq.maths.guidenet``) learns the network, its mean mixing and
  the ``λ`` factor; its kernel taps, guide smoothing and bandwidth stay at their start, so the
  weight maps need no autograd (without it the solve already costs ~4× the network per step). The
  trainer adds the pilot's own loss (``pilot_loss``), through which the guide is learned. An
  inpainter's network (its mean) is learned with the kernel banks, and with the same pilot loss.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from kdeq.maths.guidenet import REFINE
from kdeq.maths.implicit import Backward
from kdeq.maths.kernels import symbol_min_eigenvalue
from kdeq.maths.spectral import circular_spectral_norm
from kdeq.models.checkpoint import (
    FORMAT_VERSION,
    Checkpoint,
    ConvArchitecture,
    ModelConfig,
    ModelSpec,
    NoiseLambda,
    load_checkpoint,
    task_family,
)
from kdeq.models.initialize import init_tensors
from kdeq.predictors.base import Prediction, SolverOverride
from kdeq.registry import TASKS
from kdeq.train.trainings import TRAININGS

#: the eigenvalue floor ``project_`` leaves, relative to ``Σ|C|`` (above the checkpoint check's −1e-6)
PSD_MARGIN = 1e-6


def symmetrize(p: torch.Tensor) -> torch.Tensor:
    """``(P + P^⊤)/2`` for a bank ``(c, c, k, k)`` (``P^⊤[o, i, n] = P[i, o, −n]``), or point-symmetric
    taps ``(P + P(−·))/2`` for ``(k, k)`` or ``(k,)``."""
    if p.dim() == 4:
        return 0.5 * (p + p.flip(-1, -2).transpose(0, 1))
    return 0.5 * (p + p.flip(tuple(range(p.dim()))))


def psd_slack(bank: torch.Tensor) -> float:
    """``min_ω λ_min(Ĉ(ω)) − PSD_MARGIN·Σ|C|`` for a symmetric bank ``(c, c, k, k)`` or filter
    ``(k, k)``: non-negative when ``C`` passes the checkpoint's PSD check with room to spare."""
    b = bank.detach().cpu().to(torch.float64)
    b = b if b.dim() == 4 else b[None, None]
    return symbol_min_eigenvalue(b) - PSD_MARGIN * float(b.abs().sum())


def psd_shift(bank: torch.Tensor) -> float:
    """The ``δ ≥ 0`` that ``C + δ·I·e_centre`` needs for ``psd_slack ≥ 0`` (approximately: the
    margin grows with ``Σ|C|``), for a symmetric bank or filter."""
    return max(0.0, -psd_slack(bank))


def _as_bank(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 4 else t[None, None]


def random_tensors(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors for ``spec``'s architecture: i.i.d. normal, symmetrised where the model needs it,
    each scaled to the spectral norm (circular, 64² grid) or ℓ2 norm of the kGLM initialisation's;
    a guide network's tensors from ``GuideNet.random_start``."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    net = getattr(spec.architecture, "net", None)
    for name, ref in init_tensors(spec).items():
        if name.startswith("net_"):
            continue
        t = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        if name in ("w1", "spatial", "smoothing"):
            t = symmetrize(t)
        if t.dim() >= 2:
            scale = circular_spectral_norm(_as_bank(ref), (64, 64)) / circular_spectral_norm(
                _as_bank(t), (64, 64)
            )
        else:
            scale = float(ref.norm() / t.norm())
        out[name] = (t * scale).to(torch.float32)
    if net is not None:
        out.update(net.random_start(seed))
    return out


class TrainableModel(nn.Module):
    """``spec``'s predictor with ``tensors`` as parameters; see the module docstring.

    ``forward(inputs)`` takes a batch of the task's examples (``Training.corrupt``, collated; the
    predictor's arguments are ``Training.predictor_inputs``) and returns the
    prediction's ``(output, iterations, converged, pilot)`` (shapes ``(B, c, H, W)``, ``(B,)``,
    ``(B,)``, and ``(B, c, H, W)`` or ``None`` without a guide network).
    """

    def __init__(
        self,
        spec: ModelSpec,
        tensors: dict[str, torch.Tensor],
        device: torch.device,
        backward: Backward = "implicit",
        train_only: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.spec = spec
        self.guided = not isinstance(spec.architecture, ConvArchitecture)
        self.tied = isinstance(spec.lam, NoiseLambda)
        raw = {k: v.detach().to(torch.float64) for k, v in tensors.items()}
        if not self.guided:
            w2, v1 = raw.pop("w2"), raw.pop("v1")
            if not self.tied:
                lam = spec.lam.value
                raw["dw"], raw["dv"] = (w2 - raw["w1"]) / lam, (raw["v2"] - v1) / lam
        self.has_net = spec.architecture.net is not None
        frozen_names = {"spatial", "smoothing"} if self.guided and self.has_net else set()
        reads = TASKS[spec.task].predictor.reads
        if reads is not None:
            # a bank the model never reads gets no gradient, which DistributedDataParallel waits for;
            # a parameter is learned when a bank it makes (w2 = w1 + λΔw, v1 = v2 − λΔv) is read
            makes = {"w1": {"w1", "w2"}, "dw": {"w2"}, "dv": {"v1"}, "v2": {"v1", "v2"}}
            frozen_names |= {k for k in raw if not k.startswith("net_") and not makes.get(k, {k}) & reads}
        if train_only:
            frozen_names |= {k for k in raw if not k.startswith(train_only)}
            if frozen_names >= set(raw):
                raise ValueError(f"train_only {list(train_only)} names none of the tensors {sorted(raw)}")
            # p' enters the mean as β·p': with β at 0 and kept there, a refinement gets no gradient
            refining = any(k.startswith(REFINE) and k not in frozen_names for k in raw)
            if refining and "net_mean_mix" in frozen_names and float(raw["net_mean_mix"].abs().max()) == 0:
                raise ValueError(
                    "the refinement reaches the output through β (net_mean_mix), which is 0 at this start "
                    "and would stay 0: train net_mean_mix with it"
                )
        self.raw = nn.ParameterDict(
            {
                k: nn.Parameter(v.to(device, torch.float32).clone(), requires_grad=k not in frozen_names)
                for k, v in raw.items()
            }
        )
        self.log_lam = (
            nn.Parameter(torch.zeros((), device=device), requires_grad=not train_only)
            if self.guided
            else None
        )
        # not tensors of the checkpoint, but train_only keeps the bandwidth factor as it keeps λ's
        self.log_bandwidth = (
            nn.Parameter(torch.zeros((), device=device), requires_grad=not (self.has_net or train_only))
            if self.guided
            else None
        )
        config = ModelConfig(
            **spec.model_dump(),
            format_version=FORMAT_VERSION,
            family=task_family(spec.task),
            weights_sha256="0" * 64,  # in memory only; save_checkpoint computes the real one
        )
        frozen = {k: v.detach().cpu() for k, v in tensors.items()}
        self.task, self.training = TASKS[spec.task], TRAININGS[spec.task]
        self.predictor = self.task.predictor(Checkpoint(config, frozen, Path("<training>")), device)
        self.predictor.backward = backward
        #: steps ``project_`` shortened to stay PSD (reported by the trainer)
        self.truncated_steps = 0
        self._feasible: torch.Tensor | None = None
        #: what training may move at all; ``set_phase`` narrows ``requires_grad`` to a phase's share
        self._trainable = [n for n, p in self.named_parameters() if p.requires_grad]
        self.project_()

    def phase_parameters(self, pilot_only: bool) -> list[str]:
        """The names of the parameters a phase's loss depends on, in ``named_parameters`` order:
        every trainable one for the whole model; for the pilot phase (``pilot_only``) the guide
        network's, its mean mixing ``β`` and its refinement ``H_φ`` (``kdeq.maths.refine``) excepted, which
        only enter the solve's mean, as the kernel banks and the ``λ`` factor do."""
        if not pilot_only:
            return list(self._trainable)
        mean_only = ("raw.net_mean_mix", f"raw.{REFINE}_")
        return [n for n in self._trainable if n.startswith("raw.net_") and not n.startswith(mean_only)]

    def set_phase(self, pilot_only: bool) -> None:
        """Let only ``phase_parameters(pilot_only)`` require gradients. A parameter that no loss of
        the phase reaches then has no gradient at all, rather than one DistributedDataParallel waits
        for (it reduces the parameters that require gradients), and autograd builds no graph for
        the constrained views of the parameters the phase leaves alone."""
        trained = set(self.phase_parameters(pilot_only))
        for name, p in self.named_parameters():
            p.requires_grad_(name in trained)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors: constrained views of the parameters (differentiable)."""
        if self.guided:
            fixed = ("spatial", "smoothing")
            return {
                "spatial": symmetrize(self.raw["spatial"]),
                "smoothing": symmetrize(self.raw["smoothing"]),
                **{k: v for k, v in self.raw.items() if k not in fixed},
            }
        w1, v2 = symmetrize(self.raw["w1"]), self.raw["v2"]
        net = {k: v for k, v in self.raw.items() if k.startswith("net_")}
        if self.tied:
            return {"w1": w1, "w2": w1, "v1": v2, "v2": v2, **net}
        lam = self.spec.lam.value
        banks = {"w1": w1, "w2": w1 + lam * self.raw["dw"], "v1": v2 - lam * self.raw["dv"], "v2": v2}
        return {**banks, **net}

    def _bind(self) -> None:
        self.predictor.tensors = self.tensors()
        if self.guided:
            self.predictor.lam_scale = self.log_lam.exp()
            self.predictor.bandwidth_scale = self.log_bandwidth.exp()

    def forward(
        self, inputs: dict[str, torch.Tensor], solver: SolverOverride | None = None, pilot_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if pilot_only:
            return self.pilot(inputs)
        pred = self.run(inputs, solver)
        # a prediction may carry an intermediate image as its pilot (the deblurrer's first solve);
        # only a network's pilot has a loss of its own
        pilot = pred.pilot if self.has_net else None
        return pred.output, pred.stats.iterations, pred.stats.converged, pilot

    def pilot(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        """The network's pilot alone as ``forward``'s output (no solve: 0 iterations, converged)."""
        self._bind()
        out = self.predictor.pilot_only(*self.training.predictor_inputs(inputs))
        n = out.shape[0]
        return (
            out,
            torch.zeros(n, dtype=torch.long, device=out.device),
            torch.ones(n, dtype=torch.bool, device=out.device),
            None,
        )

    def run(self, inputs: dict[str, torch.Tensor], solver: SolverOverride | None = None) -> Prediction:
        """The predictor's ``forward`` on one batch (``predict`` semantics when autograd is off)."""
        self._bind()
        return self.predictor.forward(*self.training.predictor_inputs(inputs), solver=solver)

    @torch.no_grad()
    def project_(self) -> None:
        """Keep the equilibrium kernel PSD after a step (see the module docstring); a no-op when the
        step stayed feasible."""
        p = self.raw["spatial" if self.guided else "w1"]
        if psd_slack(symmetrize(p)) >= 0:
            self._feasible = p.detach().clone()
            return
        if self._feasible is None:  # a start that is not PSD: lift it once
            self._lift_to_psd(p)
            self._feasible = p.detach().clone()
            return
        start, step = self._feasible, p.detach() - self._feasible
        lo, hi = 0.0, 1.0
        for _ in range(20):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if psd_slack(symmetrize(start + mid * step)) >= 0 else (lo, mid)
        p.copy_(start + lo * step)
        self._feasible = p.detach().clone()
        self.truncated_steps += 1

    @classmethod
    def _lift_to_psd(cls, p: torch.Tensor) -> None:
        """Add ``δ·I`` at the centre tap until ``psd_slack ≥ 0``. Each lift is twice the shortfall
        plus a few float32 spacings of the tap: the margin grows with the lift, and a smaller
        increment could round away in float32 and never arrive."""
        r = p.shape[-1] // 2
        for _ in range(8):
            slack = psd_slack(symmetrize(p))
            if slack >= 0:
                return
            centre = float(p.detach()[(r, r) if p.dim() == 2 else (0, 0, r, r)].abs())
            cls._lift(p, 2.0 * -slack + 8.0 * torch.finfo(p.dtype).eps * max(centre, 1.0))
        raise RuntimeError("could not lift the start's kernel to positive semi-definite")

    @staticmethod
    def _lift(p: torch.Tensor, delta: float) -> None:
        r = p.shape[-1] // 2
        if p.dim() == 2:
            p[r, r] += delta
        else:
            idx = torch.arange(p.shape[0], device=p.device)
            p[idx, idx, r, r] += delta

    def export(self) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
        """The spec (``λ`` and bandwidth factors folded in) and float32 CPU tensors to save."""
        spec = self.spec
        tensors = {k: v.detach().cpu().clone() for k, v in self.tensors().items()}
        if not self.guided:
            return spec, tensors
        data = spec.model_dump()
        scale = math.exp(self.log_lam.item())
        if isinstance(spec.lam, NoiseLambda):
            data["lam"]["signal_variance"] = spec.lam.signal_variance / scale
        else:
            data["lam"]["value"] = spec.lam.value * scale
        data["architecture"]["kernel"]["bandwidth"] *= math.exp(self.log_bandwidth.item())
        return ModelSpec.model_validate(data), tensors


def start_tensors(
    spec: ModelSpec, init: str, seed: int, warm_start: Path | None = None
) -> dict[str, torch.Tensor]:
    """The starting tensors: the closed-form kGLM initialisation or ``random_tensors``, with those
    the checkpoint ``warm_start`` has under the same names in their place (``warm_started``)."""
    if init == "kglm":
        tensors = init_tensors(spec)
    elif init == "random":
        tensors = random_tensors(spec, seed)
    else:
        raise ValueError(f"unknown init {init!r}; use kglm or random")
    return tensors if warm_start is None else warm_started(tensors, load_checkpoint(warm_start))


def warm_started(tensors: dict[str, torch.Tensor], checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """``tensors`` with each one ``checkpoint`` also has replaced by the checkpoint's; ``ValueError``
    where a shared name differs in shape or no name is shared (a warm start that starts nothing)."""
    shared = sorted(set(tensors) & set(checkpoint.tensors))
    where = checkpoint.path
    if not shared:
        raise ValueError(f"warm start {where}: shares no tensor with the spec ({sorted(tensors)})")
    for name in shared:
        if checkpoint.tensors[name].shape != tensors[name].shape:
            raise ValueError(
                f"warm start {where}: {name} is {tuple(checkpoint.tensors[name].shape)}, the spec's "
                f"{tuple(tensors[name].shape)}"
            )
    return tensors | {name: checkpoint.tensors[name].to(torch.float32).clone() for name in shared}
