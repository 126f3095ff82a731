"""The predictor interface shared by the task models (denoise, inpaint, segment).

A predictor is built from a validated checkpoint on a device and maps a batch
of same-size images ``(B, c, H, W)`` (float, nominally in [0, 1]) to a
``Prediction``: outputs plus per-sample solver statistics. Images of different
sizes batch exactly where ``pads_exactly``: each is put in the top-left corner
of a common ``H×W`` (``pad_images``), ``sizes`` says where, and the padding is
unobserved — the kernel restricted to each image's pixels is the kernel the
image has alone, and means are computed on each image's own pixels, so every
result solves the system it solves alone (equal to the solver's tolerance;
the iterates differ: a zero-border stationary model's padded batch takes its
CG without the preconditioner, whose DCT needs the whole grid). ``forward`` is the
differentiable computation (the trainer calls it with its tensors requiring
gradients); ``predict`` runs it under ``torch.inference_mode()``. A per-call
``SolverOverride`` changes the tolerance or the iteration cap. A model whose
output is a Gaussian posterior mean describes that Gaussian itself
(``gaussian_posterior``, which ``kdeq.predictors.uncertainty`` reads).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from kdeq.maths.adaptive import Sizes
from kdeq.maths.conv import ScaledConv, Stationary
from kdeq.maths.deq import KGLMDEQ
from kdeq.maths.families import Family
from kdeq.maths.filters import gaussian_taps, normalized_convolution, observed_mean
from kdeq.maths.implicit import Backward
from kdeq.maths.linear import Negated
from kdeq.maths.noise import estimate_sigma
from kdeq.maths.operators import Operator
from kdeq.maths.precision import ieee
from kdeq.maths.priors import GaussianPrior
from kdeq.maths.solvers import SolverConfig, SolverStats
from kdeq.predictors.spec import EXTRAS, Checkpoint, ConvArchitecture, ModelSpecBase


class SolverOverride(BaseModel):
    """Per-call changes to a model's solver defaults; unknown keys are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tol: float | None = Field(None, gt=0)
    max_iter: int | None = Field(None, ge=1, le=10_000)
    history: bool | None = None


def overridden(config: SolverConfig, override: SolverOverride | None) -> SolverConfig:
    """``config`` with ``override``'s set fields applied."""
    if override is None:
        return config
    return config.model_copy(update=override.model_dump(exclude_none=True))


@dataclass(frozen=True)
class Prediction:
    """A batch's results.

    Attributes:
        output: ``(B, c, H, W)`` float32 — the restored image (denoise, inpaint) or the
            foreground probability ``(B, 1, H, W)`` (segment).
        stats: per-sample solver statistics, each ``(B,)``.
        lam: ``λ`` used per sample ``(B,)``.
        sigma: noise level used per sample on the 0–255 scale ``(B,)`` (denoise), else ``None``.
        mask: foreground ``(B, 1, H, W)`` bool (segment), else ``None``.
        threshold: binarisation threshold per sample ``(B,)`` (segment), else ``None``.
        peak: the counts shown as full scale per sample ``(B,)`` (denoise-poisson), else ``None``.
        pilot: a model with a network (``kdeq.maths.guidenet``): its pilot image ``(B, c, H, W)``
            (denoise, inpaint, deblur, super-resolve), the segmenter's ``logistic(m)``
            ``(B, 1, H, W)``; the adaptive deblurrer without one: its first solve ``f₀``; else
            ``None``.
    """

    output: torch.Tensor
    stats: SolverStats
    lam: torch.Tensor
    sigma: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    threshold: torch.Tensor | None = None
    pilot: torch.Tensor | None = None
    peak: torch.Tensor | None = None


@dataclass(frozen=True)
class GaussianPosterior:
    """The Gaussian model a prediction solved, as the posterior needs it (float64, on the device).

    Attributes:
        kernel: ``u ↦ K u`` on the output grid, ``(B, n, H, W) → (B, n, H, W)`` for any ``n``
            channels (the same kernel on each channel; per sample where it is the adaptive one).
        op: the forward operator ``A``, ``(B, n, H, W) → (B, n, H', W')``.
        lam: ``λ`` ``(B,)``.
        amplitude: ``s²`` ``(B,)``, or ``None``: estimated by maximum likelihood from ``centred``.
        centred: ``y − A m`` ``(B, c, H', W')``, the observations less the seen prior mean (needed
            only without ``amplitude``).
        shape: the output's ``(B, c, H, W)``.
        stationary: ``K`` as one filter with its border (``kdeq.maths.conv.Stationary``), for the exact
            transform path; ``None`` for a non-stationary kernel.
        spacing: the probes' colouring period ``d`` (``kdeq.predictors.uncertainty.probe_spacing``).
        scale: ``∂output/∂f`` ``(B, 1, H, W)`` where the output is a function of the Gaussian ``f``
            (the segmenter's ``π(1 − π)``): the std is multiplied by it (the delta method); ``None``
            where the output is ``f`` itself.
        prior_diag: ``diag K`` ``(B, 1, H, W)`` where part of each channel is left at the prior mean,
            unobserved (``None`` elsewhere): a colour image whose colour differences are not solved
            (``kdeq.predictors.denoise.Denoiser.luminance_only``). Its posterior there is the prior, ``s² K``.
        prior_share: the part of each channel's variance that is the prior's: with ``Q`` the opponent
            basis, channel ``j``'s variance is ``Σ_k Q_kj² var_k`` = ``(1/3)·var₀ + (2/3)·s² K_ii``
            (``Q_0j² = 1/3`` for every ``j``), so 2/3 there.
    """

    kernel: Callable[[torch.Tensor], torch.Tensor]
    op: Operator
    lam: torch.Tensor
    amplitude: torch.Tensor | None
    centred: torch.Tensor | None
    shape: tuple[int, int, int, int]
    stationary: Stationary | None = None
    spacing: int = 6
    scale: torch.Tensor | None = None
    prior_diag: torch.Tensor | None = None
    prior_share: float = 0.0


def pad_images(images: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """``(c, h, w)`` images stacked into a zero ``(B, c, max h, max w)`` batch, each in the top-left
    corner, with their sizes."""
    if not images or len({im.shape[0] for im in images}) != 1:
        raise ValueError("need one or more images with equal channel counts")
    height = max(im.shape[-2] for im in images)
    width = max(im.shape[-1] for im in images)
    out = images[0].new_zeros(len(images), images[0].shape[0], height, width)
    for k, im in enumerate(images):
        out[k, :, : im.shape[-2], : im.shape[-1]] = im
    return out, [(im.shape[-2], im.shape[-1]) for im in images]


def valid_region(x: torch.Tensor, sizes: Sizes | None) -> torch.Tensor | None:
    """``(B, 1, H, W)`` float, 1 on each image's own ``(h, w)`` pixels of the batch ``x``; ``None``
    without ``sizes`` (every pixel is the image's)."""
    if sizes is None:
        return None
    if len(sizes) != x.shape[0] or any(
        not (2 <= h <= x.shape[-2] and 2 <= w <= x.shape[-1]) for h, w in sizes
    ):
        raise ValueError(f"sizes {list(sizes)} do not fit a batch of shape {tuple(x.shape)}")
    rows = torch.arange(x.shape[-2], device=x.device).reshape(1, 1, -1, 1)
    cols = torch.arange(x.shape[-1], device=x.device).reshape(1, 1, 1, -1)
    h = torch.tensor([s[0] for s in sizes], device=x.device).reshape(-1, 1, 1, 1)
    w = torch.tensor([s[1] for s in sizes], device=x.device).reshape(-1, 1, 1, 1)
    return ((rows < h) & (cols < w)).to(x.dtype)


def per_image(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, sizes: Sizes) -> torch.Tensor:
    """``fn`` applied to each image's own pixels ``(1, c, h, w)``, results padded back with zeros."""
    parts = [fn(x[k : k + 1, :, :h, :w])[0] for k, (h, w) in enumerate(sizes)]
    out = parts[0].new_zeros(len(parts), parts[0].shape[0], *x.shape[-2:])
    for k, (h, w) in enumerate(sizes):
        out[k, :, :h, :w] = parts[k]
    return out


def resolve_device(device: str | torch.device) -> torch.device:
    """The ``torch.device`` for ``auto`` (the current CUDA device when CUDA is usable, else the CPU),
    ``cpu``, ``cuda`` (the current CUDA device, as ``cuda:N``, so that one device has one name) or
    ``cuda:N``. Raises ``ValueError`` for any other name, and for a CUDA device that is not usable
    here, saying why: torch built without CUDA, the driver's or runtime's own error, or no such
    device."""
    if str(device) == "auto":
        try:
            return resolve_device("cuda")
        except ValueError:
            return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"unsupported device {device!r}; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            why = f"this torch ({torch.__version__}) is built without CUDA"
        else:
            try:  # initialising CUDA raises the reason is_available() only warns about
                torch.cuda.init()
                why = "no CUDA device is visible"
            except Exception as err:
                why = str(err)
        raise ValueError(f"device {str(device)!r} is not available: {why}")
    count = torch.cuda.device_count()
    # before CUDA is initialised the current device is 0, and asking would initialise it
    current = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    index = current if dev.index is None else dev.index
    if index >= count:
        raise ValueError(f"device {device!r} is not available (this machine has {count} CUDA devices)")
    return torch.device("cuda", index)


def _tasks_whose(has: Callable[[type[Predictor]], bool]) -> list[str]:
    """The tasks, sorted, of the predictor classes loaded so far for which ``has(cls)`` holds."""
    found, classes = set(), [Predictor]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if hasattr(cls, "task") and has(cls):
            found.add(cls.task)
    return sorted(found)


def no_posterior(task: str) -> str:
    """Why a model of ``task`` has no posterior map: its predictor class has no ``gaussian_posterior``.
    Names the tasks whose (loaded) predictor classes have one."""
    found = _tasks_whose(lambda cls: cls.has_posterior)
    return f"the {task} task has no Gaussian posterior (those that have one: {found})"


class Predictor:
    """Base of the task models; subclasses set ``task`` and implement ``forward``.

    Class attributes, the rules its checkpoints obey (``check_spec``):
        task: the task whose checkpoints it loads.
        family: the exponential family of its models (``kdeq.maths.families``).
        architectures: the architecture kinds (``kdeq.predictors.spec``) its models may have.
        network: the conditioning (``kdeq.maths.guidenet.GuideNet.condition``) a network of its
            models has, ``None`` when they have none.
        extras: the parts of a spec that only some models read (``ModelSpecBase.extras``) that it
            reads.

    Attributes:
        tensors: the checkpoint's tensors on the device (the trainer swaps in its parameters).
        lam_scale: factor on the checkpoint's ``λ`` rule, 1 for a loaded model (the trainer learns
            it as a tensor and folds it back into the rule when it writes a checkpoint).
        reads: the kernel tensors ``forward`` reads, of ``w1``, ``w2``, ``v1``, ``v2`` (a conv
            architecture's) and ``spatial``, ``smoothing`` (a guided one's), or ``None`` for all;
            the trainer learns no other (kGLM-through-an-operator models read ``w1`` alone).
        has_posterior: whether the class has a Gaussian posterior, i.e. overrides
            ``gaussian_posterior`` (set per class; an instance may still refuse, e.g. a
            plug-and-play deblurrer, ``kdeq.predictors.uncertainty.unsupported``).
    """

    task: ClassVar[str]
    family: ClassVar[str] = "gaussian"
    architectures: ClassVar[tuple[str, ...]] = ("conv",)
    network: ClassVar[str | None] = None
    extras: ClassVar[frozenset[str]] = frozenset()
    reads: ClassVar[frozenset[str] | None] = None
    has_posterior: ClassVar[bool] = False

    @classmethod
    def check_spec(cls, spec: ModelSpecBase) -> None:
        """Raise ``ValueError`` where ``spec`` is not a model this class can run (its family is
        checked by ``kdeq.models.checkpoint``): here the declared ``architectures``, ``network`` and
        ``extras``; a subclass adds its own rules after these."""
        arch = spec.architecture
        if arch.kind not in cls.architectures:
            raise ValueError(
                f"the {arch.kind} architecture is not for the {cls.task} task (it takes "
                f"{', '.join(cls.architectures)})"
            )
        if arch.net is not None and cls.network is None:
            raise ValueError(f"the {cls.task} task has no network")
        if arch.net is not None and arch.net.condition != cls.network:
            wanted, got = cls.network, arch.net.condition
            raise ValueError(f"the {cls.task} task's network is conditioned on {wanted!r}, not {got!r}")
        for extra in sorted(spec.extras() - cls.extras):
            instead, setting = EXTRAS[extra]
            readers = " and ".join(_tasks_whose(lambda c, e=extra: e in c.extras))
            raise ValueError(f"the {cls.task} task's models {instead}: {setting} is {readers}'s")

    def __init_subclass__(cls, **kwargs: object) -> None:
        # every task model's forward and pilot run their kGLM operators (and the guide network,
        # not yet measured in TF32) in IEEE float32, on every device and whatever the process's
        # defaults (kdeq.maths.precision); done here so that no task can forget it
        super().__init_subclass__(**kwargs)
        for name in ("forward", "pilot_only"):
            if name in cls.__dict__:
                setattr(cls, name, ieee(cls.__dict__[name]))
        cls.has_posterior = cls.gaussian_posterior is not Predictor.gaussian_posterior

    def __init__(self, checkpoint: Checkpoint, device: str | torch.device = "cpu") -> None:
        if checkpoint.config.task != self.task:
            raise ValueError(f"{checkpoint.path}: a {checkpoint.config.task} model, not {self.task}")
        self.config: ModelSpecBase = checkpoint.config
        self.device = resolve_device(device)
        self.tensors = {k: v.to(self.device) for k, v in checkpoint.tensors.items()}
        self.mean_taps = gaussian_taps(self.config.mean_smoothing).to(self.device)
        self.lam_scale: float | torch.Tensor = 1.0
        #: gradient of the equilibrium layers (``kdeq.maths.implicit``), used when autograd is on
        self.backward: Backward = "implicit"

    def forward(self, *args: object, **kwargs: object) -> Prediction:
        raise NotImplementedError

    def predict(self, *args: object, **kwargs: object) -> Prediction:
        """``forward`` (see the subclass for its arguments) without autograd."""
        with torch.inference_mode():
            return self.forward(*args, **kwargs)

    def gaussian_posterior(self, *args: object, **kwargs: object) -> GaussianPosterior:
        """The Gaussian model ``f ~ GP(m, s² K)``, ``y = A f + ε`` that ``forward`` solves for these
        inputs (``forward``'s arguments), as ``kdeq.predictors.uncertainty.posterior`` needs it; a
        model with one overrides this. Here: ``ValueError``, the task has none."""
        raise ValueError(f"{self.name}: {no_posterior(self.task)}")

    def noise_level(
        self,
        x: torch.Tensor,
        sigma: float | Sequence[float] | torch.Tensor | None,
        sizes: Sizes | None = None,
    ) -> torch.Tensor:
        """``σ`` per sample in [0, 1] units ``(B,)``: from ``sigma`` (0–255 scale) or estimated
        (from each image's own pixels when ``sizes`` are given)."""
        if sigma is None:
            if sizes is None:
                return estimate_sigma(x)
            return torch.cat([estimate_sigma(x[k : k + 1, :, :h, :w]) for k, (h, w) in enumerate(sizes)])
        s = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1)
        if s.numel() == 1:
            s = s.expand(x.shape[0])
        if s.numel() != x.shape[0]:
            raise ValueError(f"got {s.numel()} noise levels for {x.shape[0]} images")
        if not bool(torch.isfinite(s).all()) or bool((s < 0).any()) or bool((s > 255).any()):
            raise ValueError("sigma must be a finite noise level in [0, 255]")
        return s / 255.0

    @property
    def pads_exactly(self) -> bool:
        """Whether ``forward`` takes ``sizes`` (exact batching of different sizes, module docstring)."""
        return False

    def lam(self, sigma: torch.Tensor) -> torch.Tensor:
        """``λ`` ``(B,)``: the checkpoint's rule at ``sigma`` ``(B,)`` (in [0, 1]) times ``lam_scale``."""
        return self.config.lam(sigma) * self.lam_scale

    @property
    def name(self) -> str:
        return f"{self.config.name}:{self.config.version}"

    def coupled_reach(self, reach: int) -> int:
        """The halo a tile of a convolution-kernel model needs for its core's *solution* to match the
        whole image's to the solver's tolerance: its equations' ``reach`` plus four radii of the kernel
        ``w1``. The equilibrium couples pixels through the resolvent ``(K + λI)⁻¹`` beyond ``reach``
        (``tests/test_tiling.py`` measures the stationary denoiser, the inpainters, the segmenters and
        the super-resolver at this halo)."""
        return reach + 4 * (self.tensors["w1"].shape[-1] // 2)

    def solver(self, override: SolverOverride | None) -> SolverConfig:
        """The model's solver defaults with ``override``'s set fields applied."""
        return overridden(self.config.solver, override)

    def images(self, images: torch.Tensor) -> torch.Tensor:
        """Validate a batch ``(B, c, H, W)`` and move it to the device as float32."""
        if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[0] == 0:
            raise ValueError("images must be a non-empty (B, c, H, W) tensor")
        if images.shape[-1] < 2 or images.shape[-2] < 2:
            raise ValueError(f"images must be at least 2×2 pixels, got {tuple(images.shape[-2:])}")
        arch = self.config.architecture
        c = images.shape[1]
        if isinstance(arch, ConvArchitecture) and arch.kernel.channels not in (1, c):
            raise ValueError(f"{self.name} takes {arch.kernel.channels}-channel images, got {c}")
        # a channels-last batch (an (H, W, c) array permuted) would make every kernel map strided:
        # the guided kernel's per-channel products run ~3× slower on it
        x = images.to(self.device, torch.float32).contiguous()
        if not bool(torch.isfinite(x).all()):
            raise ValueError("images contain non-finite values")
        return x

    def mean(
        self, y: torch.Tensor, observed: torch.Tensor | None = None, sizes: Sizes | None = None
    ) -> torch.Tensor | None:
        """The Appendix H mean ``m`` ``(B, c, H, W)`` of kind ``none``, ``global`` (per-channel mean of
        the observed pixels) or ``normalized_convolution``; ``observed`` ``(B, 1, H, W)`` (shared by the
        channels) or ``(B, c, H, W)`` (each channel's own), default all (with ``sizes``, each image's
        own pixels, whose smoothing mirrors at that image's borders as it does when the image is
        alone)."""
        kind = self.config.mean
        if kind == "none":
            return None
        obs = observed if observed is not None else valid_region(y, sizes)
        obs = torch.ones_like(y[:, :1]) if obs is None else obs
        if kind == "global":
            return observed_mean(y, obs).expand_as(y)
        if kind == "normalized_convolution":
            if sizes is None:
                return normalized_convolution(y, obs, self.mean_taps)
            taps, c = self.mean_taps, y.shape[1]
            both = torch.cat([y, obs], dim=1)
            return per_image(lambda v: normalized_convolution(v[:, :c], v[:, c:], taps), both, sizes)
        raise ValueError(f"mean {kind!r} is not defined for {self.name}")

    def kglm_layer(
        self,
        family: Family,
        lam: torch.Tensor,
        kernel_map: Callable[[str, torch.Tensor], nn.Module],
        tied: bool = False,
        tie_w2: bool = False,
    ) -> KGLMDEQ:
        """The kGLM-DEQ ``W1 = −K₁/λ, W2 = K₂/λ, V1 = −K₃/λ, V2 = K₄/λ`` (flat prior) with per-sample
        ``λ`` ``(B,)``; ``kernel_map(name, s)`` is ``x ↦ s·K x`` for ``name`` in ``w1, w2, v1, v2``.
        ``tied``: one kernel ``K₁ = K₂ = K₃ = K₄`` on ``X̃ = X`` (Theorem 3 as it stands), built once:
        ``W2 = −W1`` and the readout's maps are ``W1``, ``W2`` themselves (``kdeq.maths.linear`` uses both).
        ``tie_w2``: ``K₁ = K₂`` only, ``W2 = −W1`` built as one kernel (the readout keeps its own)."""
        inv = 1.0 / lam
        if tied:
            w1 = kernel_map("w1", -inv)
            w2: nn.Module = Negated(w1)
            v1, v2 = w1, w2
        else:
            w1 = kernel_map("w1", -inv)
            w2 = Negated(w1) if tie_w2 else kernel_map("w2", inv)
            v1, v2 = kernel_map("v1", -inv), kernel_map("v2", inv)
        return KGLMDEQ(family, GaussianPrior(), w1, w2, None, v1, v2, self.config.solver, self.backward)

    def conv_layer(self, family: Family, lam: torch.Tensor) -> KGLMDEQ:
        """``kglm_layer`` with the checkpoint's convolution banks ``w1, w2, v1, v2``."""
        pad = self.config.architecture.padding
        t = self.tensors
        # equal banks are Theorem 3's W2 = −W1, which kdeq.maths.linear solves from an accurate residual
        # (a start at the observations, good to float32 at low noise); not while the trainer
        # learns the two banks apart
        tie_w2 = not t["w2"].requires_grad and torch.equal(t["w1"], t["w2"])
        return self.kglm_layer(family, lam, lambda name, s: ScaledConv(t[name], s, pad), tie_w2=tie_w2)
