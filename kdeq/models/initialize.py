"""``kdeq init``: kGLM-initialised checkpoints in closed form from a ``ModelSpec``, and the shipped defaults.

The initialisation (Theorem 3 / Corollary 11) needs no data: every map is the
kernel itself, ``w1 = w2 = v1 = v2 = K`` (conv) or the taps of ``k_s`` and of
the guide's smoothing (guided); ``λ`` enters per request. Tensors are computed
in float64 and rounded once to float32, so a rebuild reproduces the files bit
for bit.

A plug-and-play spec (``kdeq.maths.pnp``) embeds a denoiser: its kGLM start is its prior's, and
``compose_checkpoint`` builds it around a denoiser checkpoint instead (a fine-tuned one), whose spec
and tensors it takes whole.

The defaults' hyperparameters were chosen on Train400 (never on the test sets): see
``docs/log/benchmarks-2026-11-21-to-2026-11-28.md``, "Quality of the default models against classical
baselines".
"""

from __future__ import annotations

from pathlib import Path

import torch

from kdeq.maths.adaptive import GuidedKernel
from kdeq.maths.filters import gaussian_taps
from kdeq.maths.guidenet import GuideNet
from kdeq.maths.kernels import Coregional, Kernel, require_psd_filter
from kdeq.maths.solvers import SolverConfig
from kdeq.models.checkpoint import (
    Checkpoint,
    ConvArchitecture,
    FixedLambda,
    GuidedArchitecture,
    ModelConfig,
    ModelSpec,
    NoiseLambda,
    PlugAndPlayArchitecture,
    Provenance,
    embed_prior,
    save_checkpoint,
)
from kdeq.registry import TASKS

KGLM_PROVENANCE = Provenance(
    init="kglm", notes="closed-form kGLM initialisation (kdeq init); no training data"
)


def init_tensors(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The kGLM-initialised tensors of ``spec`` (float32), checked PSD; a plug-and-play spec's are
    its prior's, named ``prior.<name>``."""
    arch = spec.architecture
    if isinstance(arch, PlugAndPlayArchitecture):
        return embed_prior(init_tensors(arch.prior))
    if isinstance(arch, ConvArchitecture):
        bank = arch.kernel.filter_bank(torch.float64)
        require_psd_filter(bank, "the kernel's filter bank", 1e-9)
        bank = bank.to(torch.float32)
        out = {name: bank.clone() for name in ("w1", "w2", "v1", "v2")}
    else:
        spatial = arch.kernel.spatial.filter(torch.float64)
        require_psd_filter(spatial, "the spatial kernel", 1e-9)
        out = {
            "spatial": spatial.to(torch.float32),
            "smoothing": gaussian_taps(arch.smoothing, torch.float64).float(),
        }
    if arch.net is not None:
        out.update(arch.net.kglm_start())
    return out


def init_checkpoint(spec: ModelSpec, root: Path) -> tuple[Path, ModelConfig]:
    """Write ``spec``'s kGLM checkpoint to ``root/<name>/<version>``; returns the folder and config."""
    directory = root / spec.name / str(spec.version)
    return directory, save_checkpoint(directory, spec, init_tensors(spec), KGLM_PROVENANCE)


def _built_from(own: ModelConfig, how: str) -> Provenance:
    """The provenance of a model built from the checkpoint ``own``: its training's (init, data,
    epochs), with notes ``how`` followed by its own notes."""
    origin = own.provenance
    return Provenance(init=origin.init, data=origin.data, epochs=origin.epochs, notes=f"{how} {origin.notes}")


def compose_checkpoint(spec: ModelSpec, prior: Checkpoint, root: Path) -> tuple[Path, ModelConfig]:
    """Write the plug-and-play ``spec`` around the denoiser checkpoint ``prior`` to
    ``root/<name>/<version>``: ``prior``'s spec replaces ``spec``'s and its tensors are embedded (a
    rebuild reproduces the files bit for bit); the provenance is the prior's training, named.
    Returns the folder and config."""
    if not isinstance(spec.architecture, PlugAndPlayArchitecture):
        kind = spec.architecture.kind
        raise ValueError(f"{spec.name}:{spec.version} is a {kind} spec, not a plug-and-play one")
    own = prior.config
    data = spec.model_dump()
    data["architecture"]["prior"] = own.spec().model_dump()
    spec = ModelSpec.model_validate(data)
    provenance = _built_from(
        own, f"plug-and-play around {own.name}:{own.version} (kdeq init --prior); the prior:"
    )
    directory = root / spec.name / str(spec.version)
    return directory, save_checkpoint(directory, spec, embed_prior(prior.tensors), provenance)


def retasked(spec: ModelSpec, name: str, version: int, task: str, description: str) -> ModelSpec:
    """``spec`` (a ``ModelSpec`` or a checkpoint's config) as a model of another task: the same kernel,
    network, ``λ`` rule, mean and solver under a new ``name``, ``version``, ``task`` and
    ``description``, validated for that task. A task that solves every channel takes no ``chroma``
    option (``GuidedArchitecture``): its models solve the colour differences too."""
    own = spec.model_dump(include=set(ModelSpec.model_fields))
    if task in TASKS and "chroma" not in TASKS[task].predictor.extras:
        own["architecture"].pop("chroma", None)
    return ModelSpec.model_validate(
        own | {"name": name, "version": version, "task": task, "description": description}
    )


def retask_checkpoint(
    name: str, version: int, task: str, description: str, prior: Checkpoint, root: Path
) -> tuple[Path, ModelConfig]:
    """Write ``prior``'s spec and tensors, unchanged but for its ``name``, ``version``, ``task`` and
    ``description``, to ``root/<name>/<version>``: a model of another task that solves with the same
    kernel and network (``RETASKED``; a rebuild reproduces the files bit for bit). Returns the folder
    and config."""
    own = prior.config
    spec = retasked(own, name, version, task, description)
    provenance = _built_from(
        own, f"{own.name}:{own.version}'s kernel and network for {task} (kdeq init --prior);"
    )
    directory = root / name / str(version)
    return directory, save_checkpoint(directory, spec, prior.tensors, provenance)


#: models written around a denoiser checkpoint by ``kdeq init --prior DIR`` beside the plug-and-play
#: ones, its spec and tensors as they are (``retask_checkpoint``): name, version, task, description
RETASKED: tuple[tuple[str, int, str, str], ...] = (
    (
        "denoise-impulse-kglm",
        2,
        "denoise-impulse",
        "Robust denoiser for Gaussian noise plus salt-and-pepper impulses: the learned guided denoiser's "
        "kernel and network, the impulses left unobserved and the rest fitted under a Welsch (KerDEQ) "
        "data term; σ given or estimated on the impulse-free pixels.",
    ),
)


#: the adaptive kernel of the closed-form denoisers (Gaussian and photon-count)
GUIDED_DENOISER = GuidedArchitecture(
    kernel=GuidedKernel(
        spatial=Kernel(profile="se", lengthscale=6.0, radius=7), patch_radius=3, bandwidth=0.9
    ),
    smoothing=0.7,
)

#: the closed-form adaptive denoiser, ``denoise-kglm:1``
DENOISER = ModelSpec(
    name="denoise-kglm",
    task="denoise",
    description="Adaptive-kernel kGLM denoiser (grey or colour, any size); σ given or estimated.",
    architecture=GUIDED_DENOISER,
    lam=NoiseLambda(signal_variance=0.005),
    mean="local",
    solver=SolverConfig(method="cg", tol=1e-4, max_iter=100),
)

DEFAULT_SPECS: tuple[ModelSpec, ...] = (
    DENOISER,
    ModelSpec(
        name="denoise-stationary-kglm",
        task="denoise",
        description="Stationary-kernel kGLM denoiser (Corollary 11): fast, Gaussian-filter quality.",
        architecture=ConvArchitecture(
            kernel=Coregional.single(Kernel(profile="se", lengthscale=1.5, radius=5))
        ),
        lam=NoiseLambda(signal_variance=0.005),
        mean="global",
        solver=SolverConfig(method="cg", tol=1e-4, max_iter=200),
    ),
    ModelSpec(
        name="inpaint-kglm",
        task="inpaint",
        description="Kernel-ridge inpainting on the observed pixels (Matérn 5/2), known pixels kept.",
        architecture=ConvArchitecture(
            kernel=Coregional.single(Kernel(profile="matern52", lengthscale=1.5, radius=4))
        ),
        lam=FixedLambda(value=0.01),
        mean="normalized_convolution",
        mean_smoothing=2.0,
        solver=SolverConfig(method="cg", tol=1e-4, max_iter=300),
    ),
    ModelSpec(
        name="segment-kglm",
        task="segment",
        description="Kernel logistic regression on the Otsu-binarised, smoothed image.",
        architecture=ConvArchitecture(
            kernel=Coregional.single(Kernel(profile="se", lengthscale=3.0, radius=8))
        ),
        lam=FixedLambda(value=15.0),
        mean="none",
        presmooth=2.0,
        solver=SolverConfig(method="anderson", tol=1e-4, max_iter=100),
    ),
    ModelSpec(
        name="deblur-kglm",
        task="deblur",
        description="Kernel ridge regression through a known blur (Matérn 3/2 prior); σ given or estimated.",
        architecture=ConvArchitecture(
            kernel=Coregional.single(Kernel(profile="matern32", lengthscale=4.0, radius=12)),
            padding="symmetric",
        ),
        # a floor of σ = 1 (0.4 %): at the default 0.5 an oblique PSF's CG needs ~2× the iterations on a
        # noise-free image for no visible gain
        lam=NoiseLambda(signal_variance=0.003, min_sigma=1.0),
        mean="global",
        solver=SolverConfig(method="cg", tol=1e-4, max_iter=500),
    ),
    ModelSpec(
        name="deblur-kglm",
        version=2,
        task="deblur",
        description="Adaptive-kernel kGLM deblurrer: kernel ridge regression through a known blur with a "
        "kernel that follows the edges of a stationary first pass; σ given or estimated.",
        architecture=GuidedArchitecture(
            kernel=GuidedKernel(
                spatial=Kernel(profile="se", lengthscale=3.0, radius=7), patch_radius=1, bandwidth=12.0
            ),
            smoothing=0.0,
        ),
        lam=NoiseLambda(signal_variance=0.05, min_sigma=1.0),
        mean="local",
        solver=SolverConfig(method="cg", tol=1e-4, max_iter=500),
    ),
    ModelSpec(
        name="super-resolve-kglm",
        task="super-resolve",
        description="Kernel ridge regression through the bicubic degradation, from bicubic interpolation.",
        architecture=ConvArchitecture(
            kernel=Coregional.single(Kernel(profile="matern52", lengthscale=1.5, radius=6)),
            padding="symmetric",
        ),
        lam=FixedLambda(value=1e-3),
        mean="interpolated",
        solver=SolverConfig(method="cg", tol=1e-4, max_iter=300),
    ),
    ModelSpec(
        name="denoise-poisson-kglm",
        task="denoise-poisson",
        description="Poisson kGLM denoiser of photon counts (8- or 16-bit, grey or colour): the exact "
        "Poisson likelihood with the adaptive kernel of the variance-stabilised image.",
        architecture=GUIDED_DENOISER,
        # the prior's precision on the log-rate, chosen on Train400 (issue 25;
        # docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "Photon-limited denoising")
        lam=FixedLambda(value=25.0),
        mean="local",
        solver=SolverConfig(method="anderson", tol=1e-4, max_iter=100),
    ),
    retasked(
        DENOISER,
        "denoise-impulse-kglm",
        1,
        "denoise-impulse",
        "Robust adaptive-kernel kGLM denoiser for Gaussian noise plus salt-and-pepper impulses: the "
        "impulses left unobserved, the rest fitted under a Welsch (KerDEQ) data term; σ given or "
        "estimated on the impulse-free pixels.",
    ),
    ModelSpec(
        name="demosaic-kglm",
        task="demosaic",
        description="Kernel-ridge demosaicking of a Bayer mosaic: a coregional Matérn 5/2 prior whose "
        "shared (luminance) part varies at 1 pixel and whose colour differences vary at 3 pixels with "
        "3 % of its variance, so green's samples inform red and blue; observed samples kept. Chosen on "
        "five CBSD432 crops (128², RGGB): 38.4 dB against bilinear's 29.7.",
        architecture=ConvArchitecture(
            kernel=Coregional(
                kernels=(
                    Kernel(profile="matern52", lengthscale=1.0, radius=5),
                    Kernel(profile="matern52", lengthscale=3.0, radius=5),
                ),
                # B₁ = 11ᵀ/3 (the channels' common part), B₂ = 0.03·(I − 11ᵀ/3) (their differences)
                mixing=(
                    tuple(tuple(1 / 3 for _ in range(3)) for _ in range(3)),
                    tuple(tuple(0.03 * ((i == j) - 1 / 3) for j in range(3)) for i in range(3)),
                ),
            )
        ),
        lam=FixedLambda(value=1e-3),
        mean="normalized_convolution",
        mean_smoothing=2.0,
        solver=SolverConfig(method="cg", tol=1e-4, max_iter=300),
    ),
)


def _default(name: str) -> ModelSpec:
    """The latest default spec called ``name``."""
    return max((spec for spec in DEFAULT_SPECS if spec.name == name), key=lambda spec: spec.version)


def _grown(base: str, description: str, net: GuideNet) -> ModelSpec:
    """The latest default ``base`` with the network ``net`` added, named ``<base>-net``."""
    spec = _default(base)
    data = spec.model_dump()
    data.update(name=f"{base}-net", description=description)
    data["architecture"]["net"] = net.model_dump()
    return ModelSpec.model_validate(data)


#: grown architectures (``kdeq.maths.guidenet``), trained from their kGLM start with
#: ``kdeq train --spec NAME``
GROWN_SPECS: tuple[ModelSpec, ...] = (
    _grown(
        "denoise-kglm",
        "Adaptive-kernel kGLM denoiser whose guide and mean come from a small learned network (grey or "
        "colour, any size); σ given or estimated.",
        GuideNet(),
    ),
    _grown(
        "inpaint-kglm",
        "Kernel-ridge inpainting on the observed pixels (Matérn 5/2) around a mean from a small learned "
        "network, known pixels kept.",
        GuideNet(condition="mask"),
    ),
    _grown(
        "segment-kglm",
        "Kernel logistic regression on the Otsu-binarised, smoothed image around a logit mean from a "
        "small learned network that also reads the grey levels.",
        GuideNet(condition="image"),
    ),
    _grown(
        "deblur-kglm",
        "Adaptive-kernel kGLM deblurring whose guide and mean come from a small learned network on the "
        "first, stationary solve (grey or colour); σ given or estimated.",
        GuideNet(),
    ),
    _grown(
        "denoise-poisson-kglm",
        "Poisson kGLM denoiser of photon counts whose guide and mean come from a small learned network "
        "on the variance-stabilised image (8- or 16-bit, grey or colour).",
        GuideNet(),
    ),
    _grown(
        "super-resolve-kglm",
        "Kernel ridge regression through the bicubic degradation around a mean from a small learned "
        "network on the bicubic interpolation (×2, ×3, ×4).",
        GuideNet(condition="scale"),
    ),
)


#: plug-and-play models (``kdeq.maths.pnp``), composed around a denoiser checkpoint by ``kdeq init --prior
#: DIR`` (the prior here is the closed-form default's, which the composition replaces); the schedule and ``λ``
#: rule were chosen on Train400 validation images (``docs/log/benchmarks-2026-11-21-to-2026-11-28.md``,
#: "Plug-and-play deblurring")
PLUG_AND_PLAY_SPECS: tuple[ModelSpec, ...] = (
    ModelSpec(
        name="deblur-kglm",
        version=3,
        task="deblur",
        description="Plug-and-play deblurring: six half-quadratic splitting steps alternating kernel "
        "ridge regression through the blur and the embedded learned denoiser; σ given or estimated.",
        architecture=PlugAndPlayArchitecture(prior=_default("denoise-kglm"), steps=6, start_sigma=49.0),
        lam=NoiseLambda(signal_variance=1 / 0.23, min_sigma=1.0),
        mean="none",
        solver=SolverConfig(method="cg", tol=1e-4, max_iter=500),
    ),
)


def write_defaults(root: Path) -> list[Path]:
    """(Re)build every default checkpoint under ``root``; returns their folders."""
    return [init_checkpoint(spec, root)[0] for spec in DEFAULT_SPECS]
