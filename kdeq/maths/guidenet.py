"""The learned guide of an adaptive denoiser: a small CNN whose pilot image ``p`` is the guide ``g``.

The adaptive kernel ``k_s(x − x')·exp(−‖g(x) − g(x')‖²/2h²)`` is PSD for any
guide image (DESIGN §2.5), so a learned guide keeps the layer a kernel GLM. The
pilot of a noisy image ``y`` ``(B, c, H, W)`` at noise level ``σ`` ``(B,)`` is

    p = b + a·(y − b) + N_θ(y, σ),      b = G∗y (the guide's pre-smoothing),

with ``a`` a learned scalar and ``N_θ`` a ReLU CNN on the 2×2 pixel-unshuffled
image (four sub-images and a constant ``σ`` map in, ``depth`` 3×3 convolutions of
``channels`` features, four sub-images out, shuffled back: FFDNet's layout, a
receptive field of ``4·depth + 2`` pixels at a quarter of the cost). At the
kGLM start ``a = 0`` and ``N_θ``'s last layer is zero, so ``p = b``: the model is
the closed-form kGLM denoiser exactly, and training moves it from there.

Each channel is denoised on its own, in the orthonormal opponent basis of the
image's channels for colour (luminance and two colour differences, where noise
stays i.i.d. with the same ``σ``), with its mean removed: one grey network
serves grey and colour images alike. A denoiser may also have a joint colour
network ``N_θ^c`` (``GuideNet.colour_channels``): a colour image's three opponent
channels then go through it together (twelve sub-images and the ``σ`` map in,
twelve out), one pass where the grey network takes three, with a skip ``a_c`` of
its own,

    p = b + a_c·(y − b) + N_θ^c(y, σ)      (in the opponent basis),

so that it can read the colour differences against the luminance's edges; grey
images keep the grey network. At its kGLM start ``a_c = 0`` and its last layer is
zero, so a colour image's pilot is ``b``.

The inpainter's network (``condition = "mask"``) is the same CNN with the
unshuffled observed mask ``M`` in place of the ``σ`` map. Its pilot of an image
``y`` observed on ``M``,

    p = b + N_θ(M·(y − ȳ_O), M),      b = the normalised-convolution mean of y_O,

is the kGLM inpainter's prior mean ``m`` (``kdeq.predictors.inpaint``): at a missing pixel
the output is ``p + K_{·O}(K_OO + λI)⁻¹(y_O − p_O)``, the pilot corrected by the
kernel-ridge interpolation of its residual on the observed pixels. At the kGLM
start ``p = b`` and the model is the closed-form inpainter.

The segmenter's network (``condition = "image"``) reads the luminance ``x``
against its threshold ``τ`` and the labels ``t = [x̄ > τ]`` (``kdeq.predictors.segment``):

    m = N_θ(x − τ, t),

the logit prior mean of kernel logistic regression, ``z = logistic((K/λ)(t − z) + m)``.
At the kGLM start ``m = 0`` and the model is the closed-form segmenter.

The deblurrer's network (``condition = "sigma"``) is the denoiser's, applied to the first,
stationary solve ``f₀`` (``kdeq.tasks.deblur``) in place of ``y``: it learns to remove what the
deconvolution left (amplified, coloured noise and ringing), and its pilot is the second solve's guide
and, mixed by ``β``, its mean.

The super-resolver's network (``condition = "scale"``) reads the bicubic interpolation ``u`` of the
low-resolution image, with a constant ``1/s`` map for the scale ``s`` in place of the ``σ`` map:

    p = u + N_θ(u − ū, 1/s),

the prior mean of kernel ridge regression through the degradation (``kdeq.tasks.super_resolve``):
the output ``p + K Aᵀ(A K Aᵀ + λI)⁻¹(y − A p)`` is the pilot corrected until its degradation
reproduces ``y`` up to ``λ``. At the kGLM start ``p = u`` and the model is the closed-form
super-resolver.

Any of these networks may be averaged over the symmetries of the square (``GuideNet.ensemble``,
``dihedral_mean``), the test-time self-ensemble: the denoiser's pilot is then

    p = b + a·(y − b) + (1/n)·Σ_g g⁻¹ N_θ(g y, σ),

over the first ``n`` of ``DIHEDRAL``'s turns and mirrors ``g``; the others' likewise. It is still a
function of ``y`` alone, so the kernel it guides stays PSD and the mean it gives is a prior mean
(DESIGN §2.5, §2.6); it costs ``n`` passes of the network.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from kdeq.maths import collab
from kdeq.runtime import netprecision


class Refine(BaseModel):
    """Shape of the denoiser's non-local refinement ``H_φ`` (``kdeq.maths.refine``): ``depth`` 3×3
    convolutions of ``channels`` features on the 2×2-unshuffled maps ``((ν − p)/σ, (y − p)/σ, log(1 + Σu/c))``
    and a ``σ`` map (13 channels in, 4 out: one weight per pixel), and the power ``κ`` (``sharpness``) that
    turns the guided kernel's weights into non-local means' at the bandwidth ``h/√κ``. ``aggregate`` is how
    ``ν`` gathers the matches (``GuidedOperator.nonlocal_mean``): each pixel's own (``pixel``, the default,
    left out of the written config) or each covering patch's group (``patch``). Its tensors:
    ``net_refine_<i>_weight`` ``(out, in, 3, 3)`` and ``net_refine_<i>_bias`` ``(out,)``.
    ``colour_channels`` adds ``H_φ^c``, which refines a colour image's pilot (without it a colour
    pilot is left as it is): the same maps in the opponent basis, three channels each (29 channels
    in, 12 out: a weight per opponent channel and pixel), ``colour_channels`` features, ``depth``
    layers; tensors ``net_refine_colour_<i>_*``. ``None``, the default, is left out of the written
    config. ``estimate`` is what a grey image's ``ν`` is: the kernel's non-local mean (``nonlocal``,
    the default, left out of the written config) or the collaborative filter of its matched patches
    (``collaborative``, ``kdeq.maths.collab``); a colour image's ``ν`` is the non-local mean either way.
    ``search_radius`` (``collaborative`` only) is the filter's ``R``: patches matched in a
    ``(2R + 1)²`` window (7, the default, left out of the written config); ``patch_radius``
    (``collaborative`` only) its ``p``: patches of ``(2p + 1)²`` pixels (3, the default, left out of the
    written config). ``first_stage`` (``collaborative`` only) is the filter's first stage: the DCT's
    (``dct``, the default, left out of the written config) or its mean with the biorthogonal
    wavelets' on ``2p``-pixel patches (``dct+biorthogonal``, ``2p`` a power of two: ``p`` = 1, 2 or 4).
    ``blend`` (``collaborative`` only) is what follows for a grey image: ``p'`` as it
    is (``none``, the default, left out of the written config), or ``p' + b·(ν − p')`` with each
    image's ``b ∈ [0, 1]`` least in Stein's unbiased risk estimate (``sure``, ``kdeq.maths.sure``: the
    refinement then runs twice, once on a probe of the image)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    depth: int = Field(4, ge=2, le=16)
    channels: int = Field(16, ge=4, le=128)
    sharpness: int = Field(3, ge=1, le=8)
    aggregate: Literal["pixel", "patch"] = "pixel"
    colour_channels: int | None = Field(None, ge=4, le=128)
    estimate: Literal["nonlocal", "collaborative"] = "nonlocal"
    search_radius: int = Field(collab.SEARCH_RADIUS, ge=2, le=19)
    patch_radius: int = Field(collab.PATCH_RADIUS, ge=1, le=6)
    first_stage: collab.FirstStage = "dct"
    blend: Literal["none", "sure"] = "none"

    @model_validator(mode="after")
    def _filter_options_are_collaborative(self) -> Refine:
        if self.estimate != "collaborative":
            whose = f"the collaborative estimate's, not {self.estimate!r}'s"
            if self.blend != "none":
                raise ValueError(f"blend {self.blend!r} is {whose}")
            if self.search_radius != collab.SEARCH_RADIUS:
                raise ValueError(f"a search radius is {whose}")
            if self.patch_radius != collab.PATCH_RADIUS:
                raise ValueError(f"a patch radius is {whose}")
            if self.first_stage != "dct":
                raise ValueError(f"the first stage {self.first_stage!r} is {whose}")
        side = 2 * self.patch_radius
        if self.first_stage == "dct+biorthogonal" and side & (side - 1):
            raise ValueError(f"the biorthogonal stage needs 2p a power of two; p is {self.patch_radius}")
        return self

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict:
        # the pixel-wise, grey-only refinement is written as before: version 7's config stays
        # byte-identical
        data = handler(self)
        if self.aggregate == "pixel":
            data.pop("aggregate", None)
        if self.colour_channels is None:
            data.pop("colour_channels", None)
        if self.estimate == "nonlocal":
            data.pop("estimate", None)
        if self.search_radius == collab.SEARCH_RADIUS:
            data.pop("search_radius", None)
        if self.patch_radius == collab.PATCH_RADIUS:
            data.pop("patch_radius", None)
        if self.first_stage == "dct":
            data.pop("first_stage", None)
        if self.blend == "none":
            data.pop("blend", None)
        return data


class GuideNet(BaseModel):
    """Shape of ``N_θ``: ``depth`` convolutions (``depth − 1`` followed by ReLU) of ``channels`` features,
    conditioned on the noise level (``sigma``: the denoiser's and deblurrer's guide), the observed
    mask (``mask``: the inpainter's mean), the labels (``image``: the segmenter's logit mean) or the
    scale (``scale``: the super-resolver's mean).

    Its tensors: ``net_<i>_weight`` ``(out, in, 3, 3)`` and ``net_<i>_bias`` ``(out,)`` for
    ``i < depth`` (``in = 5`` first for ``sigma`` and ``scale``, ``8`` otherwise; ``out = 4`` last); for
    ``sigma`` also ``net_skip`` ``(1,)`` (``a``) and ``net_mean_mix`` ``(1,)``: the denoiser's mean is
    ``(1 − β)·D⁻¹K y + β·p`` (``kdeq.predictors.denoise``). ``colour_channels`` (``sigma`` only) adds the
    joint colour network ``N_θ^c`` of that many features and the same depth (``shapes``); ``None``, the
    default, has none and is left out of the written config. ``luminance`` (``sigma`` only, without
    ``N_θ^c``) is how ``N_θ`` reads a colour image's luminance ``y₀ = (R + G + B)/√3``: as it is
    (``opponent``, the default, left out of the written config), or at a grey image's scale
    (``mean``): ``√3·N_θ(y₀/√3, σ/√3)``, the channel mean ``(R + G + B)/3`` at the noise level it has.
    ``refine`` (``sigma`` only) adds the denoiser's non-local refinement of the pilot (``Refine``);
    ``None``, the default, is left out of the written config. ``ensemble`` is how many of the eight
    symmetries of the square ``N_θ`` is averaged over (``dihedral_mean``): 1, the default, left out of
    the written config, reads the image as it is; 2 adds its mirror image, 4 its half turn and that
    turn's mirror, 8 the quarter turns (the test-time self-ensemble: ``n`` times the network's cost).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    depth: int = Field(10, ge=2, le=32)
    channels: int = Field(64, ge=4, le=256)
    condition: Literal["sigma", "mask", "image", "scale"] = "sigma"
    colour_channels: int | None = Field(None, ge=4, le=256)
    luminance: Literal["opponent", "mean"] = "opponent"
    refine: Refine | None = None
    ensemble: Literal[1, 2, 4, 8] = 1

    @model_validator(mode="after")
    def _colour_is_sigma(self) -> GuideNet:
        if self.colour_channels is not None and self.condition != "sigma":
            raise ValueError(f"a joint colour network is the σ-conditioned guide's, not {self.condition!r}'s")
        if self.luminance == "mean" and (self.condition != "sigma" or self.colour_channels is not None):
            raise ValueError("luminance 'mean' is the σ-conditioned grey network's, without a colour network")
        if self.refine is not None and self.condition != "sigma":
            raise ValueError(f"the non-local refinement is the σ-conditioned net's, not {self.condition!r}'s")
        return self

    @model_serializer(mode="wrap")
    def _omit_absent_colour(self, handler: SerializerFunctionWrapHandler) -> dict:
        # without a colour network, and reading the luminance as before, the config is written as
        # before, so rebuilt specs stay byte-identical
        data = handler(self)
        if self.colour_channels is None:
            data.pop("colour_channels", None)
        if self.luminance == "opponent":
            data.pop("luminance", None)
        if self.refine is None:
            data.pop("refine", None)
        if self.ensemble == 1:
            data.pop("ensemble", None)
        return data

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor names and shapes, in layer order: the grey network's, then the colour network's
        (``net_colour_<i>_weight`` ``(out, in, 3, 3)`` with ``in = 13`` first and ``out = 12`` last,
        ``net_colour_<i>_bias``, ``net_colour_skip`` ``(1,)``: ``a_c``) where there is one, then the
        refinement's (``Refine``)."""
        cin = 5 if self.condition in ("sigma", "scale") else 8
        out = _conv_shapes("net", self.depth, cin, self.channels, 4)
        if self.condition == "sigma":
            out["net_skip"] = (1,)
            out["net_mean_mix"] = (1,)
        if self.colour_channels is not None:
            out |= _conv_shapes("net_colour", self.depth, 13, self.colour_channels, 12)
            out["net_colour_skip"] = (1,)
        if self.refine is not None:
            out |= _conv_shapes(REFINE, self.refine.depth, 13, self.refine.channels, 4)
            if self.refine.colour_channels is not None:
                out |= _conv_shapes(REFINE_COLOUR, self.refine.depth, 29, self.refine.colour_channels, 12)
        return out

    def last_layers(self) -> set[str]:
        """The weights of each network's last layer, zero at the kGLM start."""
        last = {f"net_{self.depth - 1}_weight"}
        if self.colour_channels is not None:
            last.add(f"net_colour_{self.depth - 1}_weight")
        if self.refine is not None:
            last.add(f"{REFINE}_{self.refine.depth - 1}_weight")
            if self.refine.colour_channels is not None:
                last.add(f"{REFINE_COLOUR}_{self.refine.depth - 1}_weight")
        return last

    def kglm_start(self, seed: int = 0) -> dict[str, torch.Tensor]:
        """Tensors at the kGLM start (``p = b``): He-normal hidden layers (seeded, so a rebuild is
        identical), zero biases, zero last layers and ``a = β = a_c = 0``."""
        gen = torch.Generator().manual_seed(seed)
        out = {}
        last = self.last_layers()
        for name, shape in self.shapes().items():
            if name.endswith("_weight") and name not in last:
                fan_in = shape[1] * shape[2] * shape[3]
                w = torch.randn(shape, generator=gen, dtype=torch.float64) * math.sqrt(2.0 / fan_in)
                out[name] = w.to(torch.float32)
            else:
                out[name] = torch.zeros(shape)
        return out

    def random_start(self, seed: int) -> dict[str, torch.Tensor]:
        """Tensors drawn at random, the last layer included (He-normal), and ``a, β ~ U[0, 1]``."""
        gen = torch.Generator().manual_seed(seed)
        out = {}
        for name, shape in self.shapes().items():
            if name.endswith("_weight"):
                fan_in = shape[1] * shape[2] * shape[3]
                out[name] = (
                    torch.randn(shape, generator=gen, dtype=torch.float64) * math.sqrt(2.0 / fan_in)
                ).float()
            elif name in ("net_skip", "net_mean_mix", "net_colour_skip"):
                out[name] = torch.rand(shape, generator=gen, dtype=torch.float64).float()
            else:
                out[name] = torch.zeros(shape)
        return out


#: the prefixes of the refinement's tensors (``Refine``): ``H_φ``'s, and ``H_φ^c``'s for colour
REFINE = "net_refine"
REFINE_COLOUR = "net_refine_colour"


def _conv_shapes(prefix: str, depth: int, cin: int, features: int, cout: int) -> dict[str, tuple[int, ...]]:
    """``depth`` 3×3 layers ``<prefix>_<i>_weight``, ``<prefix>_<i>_bias`` from ``cin`` channels through
    ``features`` to ``cout``."""
    out: dict[str, tuple[int, ...]] = {}
    for i in range(depth):
        cout_i = cout if i == depth - 1 else features
        out[f"{prefix}_{i}_weight"] = (cout_i, cin if i == 0 else features, 3, 3)
        out[f"{prefix}_{i}_bias"] = (cout_i,)
    return out


def opponent(c: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An orthonormal ``(c, c)`` basis whose first row is the normalised channel sum (luminance); the
    others are differences: ``[1,1,1]/√3, [1,0,−1]/√2, [1,−2,1]/√6`` for ``c = 3``."""
    if c == 1:
        return torch.ones(1, 1, dtype=dtype)
    if c != 3:
        raise ValueError(f"the guide network takes grey or colour (3-channel) images, got {c} channels")
    t = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, -1.0], [1.0, -2.0, 1.0]], dtype=torch.float64)
    return (t / t.norm(dim=1, keepdim=True)).to(dtype)


@functools.lru_cache(maxsize=64)
def _opponent_on(c: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``opponent(c, dtype)`` on ``device``, made once: on a GPU each new one is a copy from host memory.
    Made outside inference mode, so that a training step may use it too; never written."""
    with torch.inference_mode(False):
        return opponent(c, dtype).to(device)


def to_opponent(x: torch.Tensor) -> torch.Tensor:
    """``Q x`` at each pixel: ``x`` ``(B, c, H, W)`` in the opponent basis ``Q`` of its channels."""
    return torch.einsum("dc,bchw->bdhw", _opponent_on(x.shape[1], x.dtype, x.device), x)


def from_opponent(u: torch.Tensor) -> torch.Tensor:
    """``Qᵀ u`` at each pixel, ``to_opponent``'s inverse (``Q`` is orthonormal): ``(B, c, H, W)``."""
    return torch.einsum("dc,bdhw->bchw", _opponent_on(u.shape[1], u.dtype, u.device), u)


#: the eight symmetries ``g`` of the square as (quarter turns, mirrored first), in the order
#: ``GuideNet.ensemble`` takes its first ``n``: the four that keep an image's shape first
DIHEDRAL = ((0, False), (0, True), (2, False), (2, True), (1, False), (1, True), (3, False), (3, True))


def _apply(x: torch.Tensor, turns: int, mirrored: bool) -> torch.Tensor:
    """``g x`` for ``x`` ``(N, k, H, W)``: mirrored left to right, then turned ``turns`` quarter turns."""
    x = x.flip(-1) if mirrored else x
    return torch.rot90(x, turns, (-2, -1)) if turns else x


def _undo(x: torch.Tensor, turns: int, mirrored: bool) -> torch.Tensor:
    """``g⁻¹ x``, ``_apply``'s inverse."""
    x = torch.rot90(x, -turns, (-2, -1)) if turns else x
    return x.flip(-1) if mirrored else x


def dihedral_mean(fn: Callable[..., torch.Tensor], images: tuple[torch.Tensor, ...], n: int) -> torch.Tensor:
    """``(1/n)·Σ_g g⁻¹ fn(g x₁, g x₂, …)`` over the first ``n`` symmetries ``g`` of ``DIHEDRAL``
    (``n`` = 1, 2, 4 or 8), for images ``x_i`` ``(N, k_i, H, W)`` and an ``fn`` that maps them to
    ``(N, k, H, W)``: the self-ensemble of a network on images, D₄-equivariant for ``n = 8``.
    ``n = 1`` is ``fn(x₁, …)`` itself. Otherwise odd sides are first extended by replicating the last
    row or column, so that every ``g`` keeps the 2×2 unshuffle's blocks where the image's own are (a
    tile's included, ``kdeq.serving.tiling``); the mean is cropped back to ``(H, W)``."""
    if n == 1:
        return fn(*images)
    height, width = images[0].shape[-2:]
    ph, pw = height % 2, width % 2
    if ph or pw:
        images = tuple(F.pad(x, (0, pw, 0, ph), mode="replicate") for x in images)
    total = None
    for g in DIHEDRAL[:n]:
        out = _undo(fn(*(_apply(x, *g) for x in images)), *g)
        total = out if total is None else total + out
    return (total / n)[..., :height, :width]


def unshuffle(v: torch.Tensor) -> torch.Tensor:
    """``(N, k, H, W)`` → ``(N, 4k, ⌈H/2⌉, ⌈W/2⌉)``; odd sizes are extended by replicating one row or
    column so that the 2×2 unshuffle tiles the image."""
    ph, pw = v.shape[-2] % 2, v.shape[-1] % 2
    return F.pixel_unshuffle(F.pad(v, (0, pw, 0, ph), mode="replicate") if ph or pw else v, 2)


#: on a CPU, the most activation bytes (``N·channels·H'·W'·4``) one call of ``N_θ`` runs on: beyond it a
#: sample cost up to 1.5× what it costs alone (three 256² half-resolution samples, a 512² colour image's
#: opponent channels: 327 against 220 ms each on this project's 2-core AVX2 CPU). On the Zen 5 one, with the C
#: heap's thresholds of ``kdeq.runtime.heap``, a batch within this bound costs what its samples cost alone,
#: and those three samples in float32 (38 MiB of activations, above the heap's 32 MiB blocks) 1.34× as much
#: (docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "the C heap kept for the next tensor")
CPU_CALL_BYTES = 16 << 20


def _network(
    h: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    net: GuideNet,
    size: tuple[int, int],
    colour: bool = False,
) -> torch.Tensor:
    """``N_θ`` (``N_θ^c`` with ``colour``) on its unshuffled input ``h`` ``(N, 5, 8 or 13, H', W')``,
    shuffled back and cropped to ``size``: ``(N, 1 or 3, H, W)`` (``conv_stack``)."""
    prefix, features = ("net_colour", net.colour_channels) if colour else ("net", net.channels)
    assert features is not None, "a colour pass needs the colour network"
    return conv_stack(h, tensors, prefix, features, net.depth, size)


def conv_stack(
    h: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    prefix: str,
    features: int,
    depth: int,
    size: tuple[int, int],
) -> torch.Tensor:
    """The ``depth`` 3×3 layers ``<prefix>_<i>`` of ``features`` features (ReLU between) on an unshuffled
    input ``h`` ``(N, k, H', W')``, shuffled back and cropped to ``size``: ``(N, out/4, H, W)`` in ``h``'s
    dtype; computed in the dtype ``kdeq.runtime.netprecision`` chooses, and on a CPU in calls of as many
    samples as ``CPU_CALL_BYTES`` allows (at least one: the samples are independent)."""
    names = [f"{prefix}_{i}_{part}" for i in range(depth) for part in ("weight", "bias")]
    grad = torch.is_grad_enabled() and (h.requires_grad or any(tensors[n].requires_grad for n in names))
    dtype = netprecision.dtype_for(h, features, grad)
    per_sample = features * h.shape[-2] * h.shape[-1] * h.element_size()
    step = max(1, CPU_CALL_BYTES // per_sample)
    if h.device.type == "cpu" and h.shape[0] > step:
        calls = range(0, h.shape[0], step)
        return torch.cat([_layers(h[i : i + step], tensors, prefix, depth, size, dtype) for i in calls])
    return _layers(h, tensors, prefix, depth, size, dtype)


def _layers(
    h: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    prefix: str,
    depth: int,
    size: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """``_network``'s one call, through the layers ``<prefix>_<i>``, computed in ``dtype``."""
    # channels-last from the first layer to the last: oneDNN then runs the 3×3 convolutions on 64 features
    # without reordering their input and output at every layer (the default denoiser's solve 1.05–1.33× faster
    # on this project's CPU; docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "the default denoiser against
    # non-local means and BM3D")
    last = torch.channels_last
    out_dtype = h.dtype
    h = h.to(dtype).contiguous(memory_format=last)
    for i in range(depth):
        weight = _converted(tensors[f"{prefix}_{i}_weight"], dtype, last)
        h = F.conv2d(h, weight, _converted(tensors[f"{prefix}_{i}_bias"], dtype), padding=1)
        if i < depth - 1:
            h = F.relu_(h)
    return F.pixel_shuffle(h.to(out_dtype).contiguous(), 2)[..., : size[0], : size[1]]


#: per parameter, by ``id``: the parameter (weakly), and its conversions ``(dtype, memory format) →
#: (its version then, the converted tensor)``; an entry leaves with its parameter
_conversions: dict[int, tuple[weakref.ref, dict]] = {}


def _converted(
    t: torch.Tensor, dtype: torch.dtype, layout: torch.memory_format = torch.contiguous_format
) -> torch.Tensor:
    """``t.to(dtype).contiguous(memory_format=layout)``, kept while ``t`` is not written: a network's
    parameters are converted once rather than at each call (on a GPU a copy kernel each). Not kept
    where autograd records the conversion (training), nor for an inference tensor (it keeps no count of
    its writes)."""
    if (torch.is_grad_enabled() and t.requires_grad) or t.is_inference():
        return t.to(dtype).contiguous(memory_format=layout)
    entry = _conversions.get(id(t))
    if entry is None or entry[0]() is not t:
        entry = (weakref.ref(t), {})
        _conversions[id(t)] = entry
        weakref.finalize(t, _conversions.pop, id(t), None)
    version, out = entry[1].get((dtype, layout), (None, None))
    if version != t._version:
        with torch.inference_mode(False):  # usable outside inference mode too
            out = t.to(dtype).contiguous(memory_format=layout)
        if out is t:  # nothing to convert
            return t
        entry[1][(dtype, layout)] = (t._version, out)
    return out


def _per_opponent_channel(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], y: torch.Tensor, base: torch.Tensor
) -> torch.Tensor:
    """``fn(u, u_b)`` on ``y`` and ``base`` ``(B, c, H, W)`` in the opponent basis ``Q`` of their
    channels, one channel per sample (``(B·c, 1, H, W)``, sample-major), mapped back by ``Qᵀ``:
    ``(B, c, H, W)``."""
    bsz, c, height, width = y.shape

    def split(x: torch.Tensor) -> torch.Tensor:
        return to_opponent(x).reshape(bsz * c, 1, height, width)

    return from_opponent(fn(split(y), split(base)).reshape(bsz, c, height, width))


def _per_opponent_level(level: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor | None:
    """The channel means ``level`` ``(B, c)`` of images like ``y`` ``(B, c, H, W)`` in the opponent
    basis, as ``_per_opponent_channel`` hands its channels to ``fn``: one value per (sample, channel),
    sample-major, ``(B·c, 1, 1, 1)``; ``None`` stays ``None``."""
    if level is None:
        return None
    return (level.to(y.dtype) @ _opponent_on(y.shape[1], y.dtype, y.device).T).reshape(-1, 1, 1, 1)


def network_input(u: torch.Tensor, sigma: torch.Tensor, level: torch.Tensor | None = None) -> torch.Tensor:
    """The denoiser's network input ``(N, 4k + 1, ⌈H/2⌉, ⌈W/2⌉)`` for images ``u`` ``(N, k, H, W)`` at
    noise levels ``σ`` ``(N,)`` or ``(N, 1, 1, 1)`` in [0, 1] units: each channel of ``u`` less its mean
    (``level`` ``(N, k, 1, 1)`` when given), unshuffled together (channel-major), and a constant ``σ``
    map. ``N_θ`` reads one channel (``k = 1``), ``N_θ^c`` the three opponent channels (``k = 3``)."""
    h = unshuffle(u - (u.mean(dim=(2, 3), keepdim=True) if level is None else level))
    return torch.cat([h, sigma.to(h.dtype).reshape(-1, 1, 1, 1).expand(-1, 1, *h.shape[-2:])], dim=1)


def pilot(
    y: torch.Tensor,
    base: torch.Tensor,
    sigma: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    net: GuideNet,
    level: torch.Tensor | None = None,
) -> torch.Tensor:
    """The denoiser's ``p = b + a·(y − b) + N_θ(y, σ)`` ``(B, c, H, W)`` for ``y`` and ``b``
    ``(B, c, H, W)``, ``σ`` ``(B,)`` in [0, 1] units; see the module docstring. ``N_θ`` reads each
    channel less its mean, ``level`` ``(B, c)`` when given (a tile's whole image's, ``kdeq.serving.tiling``),
    else ``y``'s own; a colour image's luminance at a grey image's scale where ``net.luminance`` is
    ``mean`` (``GuideNet``). Colour images go through the colour network where ``net`` has one."""
    if net.colour_channels is not None and y.shape[1] == 3:
        return _colour_pilot(y, base, sigma, tensors, net, level)
    s = sigma.to(y.dtype).repeat_interleave(y.shape[1]).reshape(-1, 1, 1, 1)
    level = _per_opponent_level(level, y)
    if net.luminance == "mean" and y.shape[1] == 3:
        # the luminance's gain g = √3 per sample, 1 for the colour differences: N_θ reads u/g at σ/g
        # and its output is scaled back by g, so a colour image's luminance looks like a grey image
        gain: torch.Tensor | float = (
            y.new_tensor([math.sqrt(3.0), 1.0, 1.0]).repeat(y.shape[0]).reshape(-1, 1, 1, 1)
        )
    else:
        gain = 1.0  # exact: u/1 and 1·N_θ are N_θ's input and output bit for bit

    def one(u: torch.Tensor, ub: torch.Tensor) -> torch.Tensor:
        scaled = u / gain
        centre = scaled.mean(dim=(2, 3), keepdim=True) if level is None else level / gain

        def correction(v: torch.Tensor) -> torch.Tensor:
            return gain * _network(network_input(v, s / gain, centre), tensors, net, tuple(v.shape[-2:]))

        return ub + tensors["net_skip"] * (u - ub) + dihedral_mean(correction, (scaled,), net.ensemble)

    return _per_opponent_channel(one, y, base)


def _colour_pilot(
    y: torch.Tensor,
    base: torch.Tensor,
    sigma: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    net: GuideNet,
    level: torch.Tensor | None,
) -> torch.Tensor:
    """``pilot`` for colour ``y`` and ``b`` ``(B, 3, H, W)`` through the joint colour network: in the
    opponent basis ``Q``, ``p = b + a_c·(y − b) + N_θ^c`` of the three channels less their means
    (``level`` ``(B, 3)`` when given), unshuffled together beside the ``σ`` map; mapped back by ``Qᵀ``."""
    q = _opponent_on(3, y.dtype, y.device)
    u, ub = to_opponent(y), to_opponent(base)
    centre = u.mean(dim=(2, 3), keepdim=True) if level is None else (level.to(y.dtype) @ q.T)[..., None, None]

    def correction(v: torch.Tensor) -> torch.Tensor:
        return _network(network_input(v, sigma, centre), tensors, net, tuple(v.shape[-2:]), colour=True)

    correction_mean = dihedral_mean(correction, (u,), net.ensemble)
    return from_opponent(ub + tensors["net_colour_skip"] * (u - ub) + correction_mean)


def upscale_pilot(
    u: torch.Tensor,
    scale: int,
    tensors: dict[str, torch.Tensor],
    net: GuideNet,
    level: torch.Tensor | None = None,
) -> torch.Tensor:
    """The super-resolver's ``p = u + N_θ(u − ū, 1/s)`` ``(B, c, H, W)`` for the interpolated image
    ``u`` ``(B, c, H, W)`` and the scale ``s``; see the module docstring. ``ū`` is each channel's
    mean, or ``level`` ``(B, c)`` when given (a tile's whole image's, ``kdeq.serving.tiling``)."""
    level = _per_opponent_level(level, u)

    def one(v: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        centre = v.mean(dim=(2, 3), keepdim=True) if level is None else level

        def correction(x: torch.Tensor) -> torch.Tensor:
            h = unshuffle(x - centre)
            h = torch.cat([h, torch.full_like(h[:, :1], 1.0 / scale)], dim=1)
            return _network(h, tensors, net, tuple(x.shape[-2:]))

        return v + dihedral_mean(correction, (v,), net.ensemble)

    return _per_opponent_channel(one, u, u)


def inpaint_pilot(
    y: torch.Tensor,
    observed: torch.Tensor,
    base: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    net: GuideNet,
    level: torch.Tensor | None = None,
) -> torch.Tensor:
    """The inpainter's ``p = b + N_θ(M·(y − ȳ_O), M)`` ``(B, c, H, W)`` for ``y`` and ``b``
    ``(B, c, H, W)`` and the observed mask ``M`` ``(B, 1, H, W)`` (1 observed, 0 missing); ``ȳ_O`` is
    each channel's mean over ``M`` (every image then needs an observed pixel), or ``level`` ``(B, c)``
    when given (a tile's whole image's, ``kdeq.serving.tiling``)."""
    m = observed.to(y.dtype).repeat_interleave(y.shape[1], dim=0)
    level = _per_opponent_level(level, y)

    def one(u: torch.Tensor, ub: torch.Tensor) -> torch.Tensor:
        centre = level
        if centre is None:
            centre = (u * m).sum(dim=(2, 3), keepdim=True) / m.sum(dim=(2, 3), keepdim=True)

        def mean(x: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
            h = torch.cat([unshuffle(mx * (x - centre)), unshuffle(mx)], dim=1)
            return _network(h, tensors, net, tuple(x.shape[-2:]))

        return ub + dihedral_mean(mean, (u, m), net.ensemble)

    return _per_opponent_channel(one, y, base)


def segment_mean(
    grey: torch.Tensor,
    tau: torch.Tensor,
    labels: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    net: GuideNet,
) -> torch.Tensor:
    """The segmenter's logit mean ``m = N_θ(x − τ, t)`` ``(B, 1, H, W)`` for the luminance ``x`` and
    labels ``t`` ``(B, 1, H, W)`` and the thresholds ``τ`` ``(B,)``."""

    def mean(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = torch.cat([unshuffle(x - tau.reshape(-1, 1, 1, 1)), unshuffle(t)], dim=1)
        return _network(h, tensors, net, tuple(x.shape[-2:]))

    return dihedral_mean(mean, (grey, labels), net.ensemble)
