"""Checkpoints: ``<dir>/config.json`` (typed schema) and ``<dir>/weights.safetensors``.

A checkpoint is a model *specification* (``ModelSpec``: task, architecture
with the kernel hyperparameters it was initialised from, the ``λ`` rule, the
mean function, solver defaults) plus the format version, provenance and the
sha256 of the weights file (``ModelConfig``). The tensors a model needs follow
from its architecture (``expected_tensors``).

Loading never unpickles anything (safetensors only) and refuses, naming the
file and the problem: malformed JSON, an unknown format version, an unknown
architecture or task, unknown keys, a sha256 mismatch, missing or extra
tensors, wrong shapes or dtypes, non-finite values, and kernels that are not
symmetric positive semi-definite where the model relies on it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar, Literal, TypeVar

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from kdeq.adaptive import GuidedKernel
from kdeq.atomic import write_files
from kdeq.conv import Padding
from kdeq.guidenet import GuideNet
from kdeq.kernels import Coregional, NotPSDError, require_psd_filter
from kdeq.solvers import SolverConfig

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"


def task_family(task: str) -> str:
    """The family of ``task``'s models; ``ValueError`` for a task that is not registered."""
    # imported here: the tasks import their predictors, which import this module
    from kdeq.tasks import TASKS

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {sorted(TASKS)}")
    return TASKS[task].family


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
    (inpaint, segment) the prior mean is learned (``kdeq.guidenet``)."""

    kind: Literal["conv"] = "conv"
    kernel: Coregional
    padding: Padding = "zeros"
    net: GuideNet | None = None


class GuidedArchitecture(_MayHaveNet):
    """Adaptive kernel on ``(position, guide patch)`` (DESIGN §2.5): tensors ``spatial`` ``(2R+1, 2R+1)``
    (the taps of ``k_s``) and ``smoothing`` ``(L,)`` (1-D taps pre-smoothing the guide, ``L`` odd).
    With ``net`` the guide is a learned pilot image (``kdeq.guidenet``), with the network's tensors."""

    kind: Literal["guided"] = "guided"
    kernel: GuidedKernel
    smoothing: float = Field(0.7, ge=0)
    net: GuideNet | None = None
    #: a colour image's two colour-difference channels in the opponent basis (``kdeq.guidenet.opponent``):
    #: ``solved`` like the luminance, or ``prior_mean``: left at the prior mean ``m``, their ``λ``
    #: infinite, so that only the luminance is solved (``kdeq.denoise``; the denoise task's alone)
    chroma: Literal["solved", "prior_mean"] = "solved"

    _unless_default: ClassVar[tuple[str, ...]] = ("chroma",)


class PlugAndPlayArchitecture(_Strict):
    """Plug-and-play half-quadratic splitting (``kdeq.pnp``): ``steps`` alternations of the data step,
    the kGLM with the white kernel ``K = I`` observed through the task's operator around the last
    denoised image, and the embedded denoiser ``prior`` at noise levels ``σ_k`` geometric from
    ``start_sigma`` (0–255) down to the observations' ``σ``. Tensors: the prior's, each named
    ``prior.<name>``, so that the checkpoint is whole in itself."""

    kind: Literal["pnp"] = "pnp"
    prior: ModelSpec
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


class ModelSpec(_Strict):
    """What ``kdeq init`` needs to build a kGLM-initialised checkpoint.

    Attributes:
        name, version: the repository path ``models/<name>/<version>``.
        task: a registered task (``kdeq.tasks.TASKS``), which fixes the family and the rules the rest
            of the spec obeys (``Task.check_spec``).
        architecture: ``conv`` (stationary) or ``guided`` (adaptive: denoise, deblur), either with a
            learned network (``kdeq.guidenet``): the guided denoiser's guide, the inpainter's or the
            segmenter's mean; or ``pnp``, a denoiser plugged into the task's operator (deblur). Each
            task says which it takes (``Task.check_spec``).
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
    task: str = Field(description="a registered task (kdeq.tasks.TASKS), which fixes the family")
    description: str = ""
    architecture: Architecture
    lam: LambdaRule
    mean: Mean = "global"
    mean_smoothing: float = Field(2.0, gt=0)
    presmooth: float = Field(0.0, ge=0)
    solver: SolverConfig = SolverConfig()

    @model_validator(mode="after")
    def _compatible(self) -> ModelSpec:
        from kdeq.tasks import TASKS

        family = task_family(self.task)
        if self.mean == "local" and self.architecture.kind != "guided":
            raise ValueError(
                "mean 'local' is the guided kernel's own average; use it with a guided architecture"
            )
        TASKS[self.task].check_spec(self)
        if self.solver.method == "cg" and family != "gaussian":
            raise ValueError(f"CG needs an affine equilibrium map; the {family} family is not affine")
        return self


PlugAndPlayArchitecture.model_rebuild()
ModelSpec.model_rebuild()


class Provenance(_Strict):
    """Where the weights came from: ``init`` scheme, training data, epochs, metrics."""

    init: Literal["kglm", "random"] = "kglm"
    data: tuple[str, ...] = ()
    epochs: int = Field(0, ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)
    notes: str = ""


class ModelConfig(ModelSpec):
    """The contents of ``config.json``."""

    format_version: int
    family: Literal["gaussian", "bernoulli", "poisson"]
    provenance: Provenance = Provenance()
    weights_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @model_validator(mode="after")
    def _family_matches(self) -> ModelConfig:
        if self.family != task_family(self.task):
            raise ValueError(f"task {self.task} uses the {task_family(self.task)} family, not {self.family}")
        return self

    def spec(self) -> ModelSpec:
        """The ``ModelSpec`` part alone: without the format, family, provenance and weights' hash."""
        return ModelSpec.model_validate(self.model_dump(include=set(ModelSpec.model_fields)))


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint: its config, its float32 tensors on the CPU, and where it came from."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    path: Path


def expected_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...] | None]:
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
    prior = ModelConfig(
        **arch.prior.model_dump(),
        format_version=config.format_version,
        family=task_family(arch.prior.task),
        weights_sha256=hashlib.sha256(blob).hexdigest(),
    )
    return Checkpoint(prior, tensors, checkpoint.path / "prior")


def _check_tensors(spec: ModelSpec, tensors: dict[str, torch.Tensor], where: Path) -> None:
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


def _check_kernels(spec: ModelSpec, tensors: dict[str, torch.Tensor], where: Path) -> None:
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


def checkpoint_files(
    spec: ModelSpec,
    tensors: dict[str, torch.Tensor],
    provenance: Provenance | None = None,
    where: Path = Path("checkpoint"),
) -> tuple[ModelConfig, dict[str, bytes]]:
    """The config of a checkpoint of ``spec`` and ``tensors``, and the bytes of its files by name in
    the order they are written (``config.json``, naming the weights' sha256, last), checked as
    ``load_checkpoint`` checks them (errors name ``where``); nothing is written.

    The bytes depend only on the arguments, so rebuilding a checkpoint reproduces it exactly.
    """
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sorted(tensors.items())}
    _check_tensors(spec, tensors, where)
    blob = save_safetensors(tensors)
    config = ModelConfig(
        **spec.model_dump(),
        format_version=FORMAT_VERSION,
        family=task_family(spec.task),
        provenance=provenance or Provenance(),
        weights_sha256=hashlib.sha256(blob).hexdigest(),
    )
    return config, {WEIGHTS_FILE: blob, CONFIG_FILE: (config.model_dump_json(indent=2) + "\n").encode()}


def save_checkpoint(
    directory: Path, spec: ModelSpec, tensors: dict[str, torch.Tensor], provenance: Provenance | None = None
) -> ModelConfig:
    """Write ``checkpoint_files`` (``weights.safetensors``, ``config.json``) into ``directory``.

    Written as one set (``kdeq.atomic.write_files``): a crash or Ctrl-C leaves the checkpoint the
    folder held before, or none (no ``config.json``), never new weights beside an old config or a
    file cut short.
    """
    config, files = checkpoint_files(spec, tensors, provenance, directory)
    write_files(directory, files)
    return config


def read_config(directory: Path) -> ModelConfig:
    """Parse and validate ``directory/config.json``; raises ``CheckpointError``."""
    path = directory / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as err:  # unreadable: permissions, a directory, an I/O error
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: unknown format version {version!r} (this kdeq reads {FORMAT_VERSION})"
        )
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in err.errors())
        raise CheckpointError(f"{path}: {problems}") from None


# the first bytes of a pickle (protocols 2–5) and of torch.save's zip container; a safetensors file
# starts with its 8-byte header length and then the header's "{", which tells the two apart
PICKLE_MAGIC = tuple(bytes([0x80, p]) for p in range(2, 6))


def load_checkpoint(directory: str | Path) -> Checkpoint:
    """Read and validate a checkpoint directory; raises ``CheckpointError`` naming the file and problem."""
    directory = Path(directory)
    config = read_config(directory)
    path = directory / WEIGHTS_FILE
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    if blob[8:9] != b"{" and (blob[:2] in PICKLE_MAGIC or blob[:4] == b"PK\x03\x04"):
        raise CheckpointError(f"{path}: a pickle (torch.save) file, not safetensors; it is never unpickled")
    digest = hashlib.sha256(blob).hexdigest()
    if digest != config.weights_sha256:
        raise CheckpointError(f"{path}: sha256 {digest} does not match config.json's {config.weights_sha256}")
    try:
        tensors = load_safetensors(blob)
    except (SafetensorError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None
    _check_tensors(config, tensors, path)
    return Checkpoint(config, tensors, directory)
