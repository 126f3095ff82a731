"""A model's specification and tensors, as far as they concern the model alone.

The architectures (``conv``, ``guided``, ``pnp``) with the kernel hyperparameters a model was
initialised from, the ``λ`` rules, the mean functions, ``ModelSpecBase`` (a spec checked without the
task registry), the tensors an architecture needs (``expected_tensors``) and their checks (shapes,
dtypes, finite values, symmetric PSD kernels where the model relies on them), and the ``Checkpoint``
a predictor is built from. The rules of a model's task, ``config.json`` and the files are
``kdeq.models.checkpoint``'s, above the task registry.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar, Literal, TypeVar

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)
from safetensors.torch import save as save_safetensors

from kdeq.maths.adaptive import GuidedKernel
from kdeq.maths.conv import Padding
from kdeq.maths.guidenet import GuideNet
from kdeq.maths.kernels import Coregional, NotPSDError, require_psd_filter
from kdeq.maths.solvers import SolverConfig


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _MayHaveNet(_Strict):
    """An architecture with an optional learned network, ``net``, and fields written only where they
    differ from their defaults (``_unless_default``)."""

    _unless_default: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict:
        # without a network, or with a later field at its default, the config is written as before,
        # so rebuilt checkpoints stay byte-identical
        data = handler(self)
        if self.net is None:
            data.pop("net", None)
        for name in self._unless_default:
            if getattr(self, name) == type(self).model_fields[name].default:
                data.pop(name, None)
        return data


class ConvArchitecture(_MayHaveNet):
    """Stationary kernel as convolutions (Corollary 11): tensors ``w1, w2, v1, v2`` ``(c, c, 2R+1, 2R+1)``,
    the layer's maps being ``W1 = −w1/λ``, ``W2 = w2/λ``, ``V1 = −v1/λ``, ``V2 = v2/λ``; all equal
    ``kernel``'s filter bank at the kGLM initialisation. ``c = 1`` applies one kernel to every image
    channel; ``c > 1`` is a coregionalised kernel over exactly ``c`` image channels. With ``net``
    (inpaint, segment) the prior mean is learned (``kdeq.maths.guidenet``)."""

    kind: Literal["conv"] = "conv"
    kernel: Coregional
    padding: Padding = "zeros"
    net: GuideNet | None = None


class GuidedArchitecture(_MayHaveNet):
    """Adaptive kernel on ``(position, guide patch)`` (DESIGN §2.5): tensors ``spatial`` ``(2R+1, 2R+1)``
    (the taps of ``k_s``) and ``smoothing`` ``(L,)`` (1-D taps pre-smoothing the guide, ``L`` odd).
    With ``net`` the guide is a learned pilot image (``kdeq.maths.guidenet``), with the network's tensors."""

    kind: Literal["guided"] = "guided"
    kernel: GuidedKernel
    smoothing: float = Field(0.7, ge=0)
    net: GuideNet | None = None
    #: a colour image's two colour-difference channels in the opponent basis
    #: (``kdeq.maths.guidenet.opponent``):
    #: ``solved`` like the luminance, or ``prior_mean``: left at the prior mean ``m``, their ``λ``
    #: infinite, so that only the luminance is solved (``kdeq.predictors.denoise``; the denoise task's alone)
    chroma: Literal["solved", "prior_mean"] = "solved"

    _unless_default: ClassVar[tuple[str, ...]] = ("chroma",)


class PlugAndPlayArchitecture(_Strict):
    """Plug-and-play half-quadratic splitting (``kdeq.maths.pnp``): ``steps`` alternations of the data step,
    the kGLM with the white kernel ``K = I`` observed through the task's operator around the last
    denoised image, and the embedded denoiser ``prior`` at noise levels ``σ_k`` geometric from
    ``start_sigma`` (0–255) down to the observations' ``σ``. Tensors: the prior's, each named
    ``prior.<name>``, so that the checkpoint is whole in itself."""

    kind: Literal["pnp"] = "pnp"
    prior: ModelSpecBase
    steps: int = Field(6, ge=1, le=64)
    start_sigma: float = Field(49.0, gt=0, le=255)

    @property
    def net(self) -> None:
        """No network of its own (the prior's is the prior's)."""
        return None

    @model_validator(mode="after")
    def _prior_denoises(self) -> PlugAndPlayArchitecture:
        if self.prior.task != "denoise":
            raise ValueError(f"the prior is a denoiser, not a {self.prior.task} model")
        if not isinstance(self.prior.lam, NoiseLambda):
            raise ValueError("the prior takes the noise level σ_k: its λ rule is the noise rule")
        return self


Architecture = Annotated[
    ConvArchitecture | GuidedArchitecture | PlugAndPlayArchitecture, Field(discriminator="kind")
]


class NoiseLambda(_Strict):
    """``λ = max(σ, σ_min)²/s²`` with ``σ`` the noise level in [0, 1] units (DESIGN §2.6):
    the Gaussian-process reading with prior variance ``s²`` in the kernel's units."""

    rule: Literal["noise"] = "noise"
    signal_variance: float = Field(gt=0)
    min_sigma: float = Field(0.5, gt=0, description="floor on σ, 0–255 scale")

    def __call__(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma.clamp(min=self.min_sigma / 255.0).square() / self.signal_variance


class FixedLambda(_Strict):
    """A constant ``λ``."""

    rule: Literal["fixed"] = "fixed"
    value: float = Field(gt=0)

    def __call__(self, sigma: torch.Tensor) -> torch.Tensor:
        return torch.full_like(sigma, self.value)


LambdaRule = Annotated[NoiseLambda | FixedLambda, Field(discriminator="rule")]

Mean = Literal["none", "global", "local", "normalized_convolution", "interpolated"]


#: each part of a spec that only some models read (``ModelSpecBase.extras``): what a model without it
#: does instead, and the spec's setting that asks for it
EXTRAS = {
    "chroma": ("solve every channel", "chroma 'prior_mean'"),
    "refine": ("read no refined pilot", "refine"),
}


class ModelSpecBase(_Strict):
    """A model's specification as far as it concerns the model alone: what ``kdeq init`` needs to
    build a kGLM-initialised checkpoint, checked without the task registry
    (``kdeq.models.checkpoint.ModelSpec`` adds the rules of its task).

    Attributes:
        name, version: the repository path ``models/<name>/<version>``.
        task: a registered task (``kdeq.registry.TASKS``), which fixes the family and the rules the rest
            of the spec obeys (its predictor's ``Predictor.check_spec``, and ``Task.check_spec``).
        architecture: ``conv`` (stationary) or ``guided`` (adaptive: denoise, deblur), either with a
            learned network (``kdeq.maths.guidenet``): the guided denoiser's guide, the inpainter's or the
            segmenter's mean; or ``pnp``, a denoiser plugged into the task's operator (deblur). Each
            task's predictor says which it takes (``Predictor.architectures``).
        lam: the ``λ`` rule (``noise`` needs a noise level: denoise, deblur).
        mean: Appendix H mean ``m``: ``none``; ``global`` (per-channel image mean);
            ``local`` (the kernel's own normalised average ``D⁻¹K y``, guided only);
            ``normalized_convolution`` (Gaussian-weighted mean of the observed pixels);
            ``interpolated`` (the bicubic interpolation of the observations, super-resolve only).
        mean_smoothing: std (pixels) of the ``normalized_convolution`` mean.
        presmooth: std (pixels) of the smoothing applied before segmentation's threshold.
        solver: default solver settings.
    """

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")
    version: int = Field(1, ge=1)
    task: str = Field(description="a registered task (kdeq.registry.TASKS), which fixes the family")
    description: str = ""
    architecture: Architecture
    lam: LambdaRule
    mean: Mean = "global"
    mean_smoothing: float = Field(2.0, gt=0)
    presmooth: float = Field(0.0, ge=0)
    solver: SolverConfig = SolverConfig()

    def extras(self) -> frozenset[str]:
        """The parts of this spec that only some models read (``Predictor.extras``, ``EXTRAS``):
        ``chroma``, a guided kernel's colour differences left at the prior mean
        (``GuidedArchitecture.chroma``), and ``refine``, a network's pilot refined by non-local means
        (``kdeq.maths.guidenet.GuideNet.refine``)."""
        arch, used = self.architecture, set()
        if getattr(arch, "chroma", "solved") != "solved":
            used.add("chroma")
        if arch.net is not None and arch.net.refine is not None:
            used.add("refine")
        return frozenset(used)

    @model_validator(mode="after")
    def _local_mean_is_guided(self) -> ModelSpecBase:
        if self.mean == "local" and self.architecture.kind != "guided":
            raise ValueError(
                "mean 'local' is the guided kernel's own average; use it with a guided architecture"
            )
        return self


PlugAndPlayArchitecture.model_rebuild()


class Provenance(_Strict):
    """Where the weights came from: ``init`` scheme, training data, epochs, metrics."""

    init: Literal["kglm", "random"] = "kglm"
    data: tuple[str, ...] = ()
    epochs: int = Field(0, ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)
    notes: str = ""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint: its config, its float32 tensors on the CPU, and where it came from."""

    config: ModelSpecBase
    tensors: dict[str, torch.Tensor]
    path: Path


def expected_tensors(spec: ModelSpecBase) -> dict[str, tuple[int, ...] | None]:
    """Tensor names with their shapes (``None``: a 1-D tensor of odd length) for ``spec``'s architecture."""
    arch = spec.architecture
    out: dict[str, tuple[int, ...] | None]
    if isinstance(arch, PlugAndPlayArchitecture):
        return embed_prior(expected_tensors(arch.prior))
    if isinstance(arch, ConvArchitecture):
        c, k = arch.kernel.channels, 2 * arch.kernel.radius + 1
        out = {name: (c, c, k, k) for name in ("w1", "w2", "v1", "v2")}
    else:
        k = 2 * arch.kernel.spatial.radius + 1
        out = {"spatial": (k, k), "smoothing": None}
    if arch.net is not None:
        out.update(arch.net.shapes())
    return out


#: the prefix of a plug-and-play checkpoint's prior tensors
PRIOR = "prior."

T = TypeVar("T")


def embed_prior(tensors: dict[str, T]) -> dict[str, T]:
    """A denoiser's tensors (or their shapes) named as a plug-and-play checkpoint holds them."""
    return {PRIOR + name: t for name, t in tensors.items()}


def _embedded_prior(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The prior's tensors of a plug-and-play checkpoint's ``tensors``, under their own names."""
    return {k.removeprefix(PRIOR): v for k, v in tensors.items() if k.startswith(PRIOR)}


def prior_checkpoint(checkpoint: Checkpoint) -> Checkpoint:
    """The denoiser embedded in a plug-and-play ``checkpoint``: its spec, its tensors (the prefix
    ``prior.`` dropped) and the sha256 they would have as a checkpoint of their own; its path is
    ``<checkpoint>/prior``, which names it in errors and is never read."""
    config = checkpoint.config
    arch = config.architecture
    if not isinstance(arch, PlugAndPlayArchitecture):
        raise ValueError(f"{checkpoint.path}: a {arch.kind} model embeds no prior")
    tensors = _embedded_prior(checkpoint.tensors)
    blob = save_safetensors({k: v.contiguous() for k, v in sorted(tensors.items())})
    # the config's own class (``kdeq.models.checkpoint.ModelConfig``), and its family: the prior is a
    # Gaussian denoiser, as every plug-and-play model is Gaussian
    prior = type(config)(
        **arch.prior.model_dump(),
        format_version=config.format_version,
        family=config.family,
        weights_sha256=hashlib.sha256(blob).hexdigest(),
    )
    return Checkpoint(prior, tensors, checkpoint.path / "prior")


def check_tensors(spec: ModelSpecBase, tensors: dict[str, torch.Tensor], where: Path) -> None:
    expected = expected_tensors(spec)
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"{where}: tensors do not match the architecture: missing {missing}, extra {extra}"
        )
    for name, shape in expected.items():
        t = tensors[name]
        if t.dtype != torch.float32:
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {t.dtype}, expected float32")
        if shape is None:
            if t.dim() != 1 or t.shape[0] % 2 == 0:
                raise CheckpointError(
                    f"{where}: tensor {name!r} must be 1-D of odd length, got {tuple(t.shape)}"
                )
        elif tuple(t.shape) != shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{where}: tensor {name!r} has non-finite values")
    _check_kernels(spec, tensors, where)


def _symmetric(bank: torch.Tensor) -> bool:
    """``C[o, i, n] = C[i, o, −n]``: the convolution is a symmetric operator."""
    mirrored = bank.flip(-1, -2).transpose(0, 1)
    return bool(torch.allclose(bank, mirrored, rtol=1e-5, atol=1e-7 * float(bank.abs().max())))


def _check_kernels(spec: ModelSpecBase, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Symmetric PSD kernels where the theory or the solver relies on them."""
    if isinstance(spec.architecture, PlugAndPlayArchitecture):
        _check_kernels(spec.architecture.prior, _embedded_prior(tensors), where)
        return
    if isinstance(spec.architecture, GuidedArchitecture):
        spatial = tensors["spatial"]
        if not torch.equal(spatial, spatial.flip(0, 1)):
            raise CheckpointError(f"{where}: tensor 'spatial' must be point-symmetric (k_s(o) = k_s(−o))")
        _require_psd(spatial, "'spatial'", where)
        return
    # CG's premise: I − ∂f = I + w1/λ is symmetric positive definite
    if spec.solver.method == "cg":
        w1 = tensors["w1"]
        if not _symmetric(w1):
            raise CheckpointError(
                f"{where}: tensor 'w1' is not a symmetric kernel, which the CG solver needs"
            )
        _require_psd(w1, "'w1'", where)


def _require_psd(bank: torch.Tensor, what: str, where: Path) -> None:
    try:
        require_psd_filter(bank, what, 1e-6)
    except NotPSDError as err:
        raise CheckpointError(f"{where}: {err}") from None
