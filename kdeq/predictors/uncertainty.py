"""Per-pixel posterior uncertainty of the Gaussian tasks (DESIGN §2 facts 6, 8 and 9), and of the
segmenter's latent by Laplace's approximation.

For a Gaussian task the model's output is the posterior mean of ``f ~ GP(m, s² K)`` observed as
``y = A f + ε``, ``ε ~ N(0, λ s² I)`` (``λ = σ²/s²``, fact 6). Its posterior covariance is

    Σ = s² (K − K Aᵀ (A K Aᵀ + λI)⁻¹ A K),

an ``N × N`` matrix over the output's pixels (the same for every channel: every Gaussian task
applies one single-channel kernel and one single-channel operator to each channel alike). This
module returns ``sqrt(diag Σ)`` on the output's [0, 1] scale, shape ``(B, c, H, W)``:

- **exactly** where one orthonormal transform ``U`` diagonalises both ``K`` and ``A``: ``A = I``
  with a stationary kernel under a ``circular`` border (the DFT) or a ``symmetric`` border with a
  filter even in each axis (the DCT-II), and ``A = H`` a ``symmetric``-border blur by a PSF even in
  each axis with such a kernel (``kdeq.maths.operators.Sandwich.stationary``'s case). With ``k̂_f``,
  ``ĥ_f`` the symbols (``ĥ = 1`` for ``A = I``), ``Σ = U diag(g) Uᵀ`` with
  ``g_f = s² k̂_f λ/(ĥ_f² k̂_f + λ)``, so ``Σ_ii = Σ_f |U_if|² g_f``: for the DFT ``|U_if|² = 1/N``
  (the variance is the same at every pixel); for the DCT-II it is ``(C_H²)ᵀ G C_W²`` with the 1-D
  DCT matrices squared entrywise, which varies near the border.
- **stochastically** otherwise (zero borders, the adaptive kernel, inpainting's mask, the
  super-resolver's subsampling, an asymmetric PSF), by probing with Rademacher signs
  (Hutchinson's diagonal estimator, Bekas, Kokiopoulou and Saad 2007) on a colouring of the grid.

The stochastic estimator and its accuracy rule. Colour pixel ``(i₁, i₂)`` by
``(i₁ mod d, i₂ mod d)`` (``d = spacing``, ``d²`` colours) and draw ``R = rounds`` independent
Rademacher fields ``ε_r``. The probes are ``v_{r,q} = ε_r ⊙ 1[colour = q]``, ``P = R d²`` of them,
and

    diag(Σ)_i ≈ (1/R) Σ_r Σ_q v_{r,q,i} (Σ v_{r,q})_i = Σ_ii + (1/R) Σ_r Σ_{j≠i, j~i} ε_{r,i} ε_{r,j} Σ_ij,

``j ~ i`` meaning the same colour: unbiased (``E[ε_i ε_j] = 0``), with variance
``(1/R) Σ_{j≠i, j~i} Σ_ij²``. Plain Hutchinson (``d = 1``) has ``(1/n) Σ_{j≠i} Σ_ij²`` for
``n`` probes; the colouring removes every pair closer than ``d`` pixels in either axis, which is
where a posterior covariance keeps nearly all of its mass. With ``ρ_i² = Σ_{j≠i, j~i} Σ_ij²/Σ_ii²``
the relative standard error of the variance is ``ρ_i/√R`` and that of the standard deviation half of
it (``δ√v = δv/(2√v)``), so the mean absolute relative error of the std map is about
``√(2/π)·ρ̄/(2√R)``; a target ``ε`` needs ``R ≥ (2/π)·ρ̄²/(4ε²)``.

The default period is ``d = R_K + 1`` for a kernel of support radius ``R_K`` (at most 9, and a
multiple of a subsampling factor; ``probe_spacing``): no two pixels of one colour lie within the
kernel's support, so ``K`` itself never enters the error, only the posterior's correction
``K Aᵀ G⁻¹ A K``, which decays beyond it. Measured mean ``ρ²`` on dense ``Σ`` of the shipped models
(24×24 to 36×36 images): stationary denoiser, inpainter < 10⁻⁴; adaptive denoiser (``d = 8``) ≤ 0.0013
at σ = 50; deblurrer ≤ 0.0007 (``d = 9``, motion PSF, σ = 2…50); super-resolver 0.0009, 0.0024,
0.0043 at ×2, ×3, ×4. With ``R = 2`` rounds the worst (×4) gives ``√(2/π)·√(0.0043/2)/2 ≈ 2 %`` mean
relative error of the std map, the others well under 1 %; a period inside the kernel's support is
much worse (the adaptive denoiser at ``d = 6 < R_K + 1``: 6 % on a 96×96 image, 0.3 % at ``d = 8``).
``P = R·d²`` probes: 50 (inpaint) to 162. The rounds also estimate the error themselves
(``Uncertainty.error``: the mean over pixels of the between-round standard error, halved for the
std; with two rounds its expectation is the expected mean absolute error under normality).

Every probe's inner solve ``(A K Aᵀ + λI) u = A K v`` is one system per probe; the probes are
stacked as channels, so all of them are ONE batch of CG solves (``kdeq.maths.linear.solve_affine``, with
its preconditioners), in float64: the variance is a difference ``K v − K Aᵀ u`` that cancels by a
factor up to ``1/λ``.

Prior amplitude ``s²``: ``σ²/λ`` with the noise level the solve used (``λ``'s rule floors ``σ``, so
``max(σ, σ_min)²/λ``, i.e. the rule's ``signal_variance`` for the ``noise`` rule) where the task has
one (denoise, deblur); for a task without a noise level (inpaint, super-resolve: a fixed ``λ``) the
maximum-likelihood amplitude ``s² = (y − A m)ᵀ (A K Aᵀ + λI)⁻¹ (y − A m)/n`` over the ``n``
observed values (with the model's own mean ``m``), solved in the same batch as the probes. A
caller may give ``amplitude`` instead.

What is modelled, per task: the equilibrium's kernel ``K₁`` (the ``w1`` bank; a fine-tuned model
whose readout banks differ from it is a GP posterior mean only approximately), the adaptive kernel of
the image's own guide taken as given (for the guided deblurrer: given the first solve ``f₀``), and
``diag Σ`` at every pixel: the inpainter returns its known pixels unchanged, yet the map there is
the posterior of ``f`` given the noisy observation (below the noise's ``√(λ s²)``), which a caller may
zero.

The Bernoulli segmenter's latent ``η`` (``kdeq.predictors.segment``: ``η ~ GP(m, K/λ)``, labels
``t ~ Bernoulli(σ(η))``) has no Gaussian posterior, but its equilibrium ``η̂ = (K/λ)(t − π) + m``,
``π = σ(η̂)``, is the posterior's mode, and Laplace's approximation there (Rasmussen and Williams
2006, §3.4) is Gaussian with covariance ``(λK⁻¹ + W)⁻¹``, ``W = diag(π(1 − π))``. By Woodbury that is
``Σ`` above with ``A = W^{1/2}`` and ``s² = 1/λ``, so the same estimators give the latent's std;
the returned map is the probability's, ``π(1 − π)·std(η)`` (the delta method: ``dπ/dη = π(1 − π)``),
with the latent's in ``Uncertainty.latent``. It is approximate twice over: Laplace's Gaussian for a
skewed posterior, and the linearised probability, which is tight near ``π = ½`` and small where the
model is sure.

Each model builds its own ``GaussianPosterior`` (both in ``kdeq.predictors.base``:
``Predictor.gaussian_posterior``, overridden by the predictor classes that have one, with the helpers
here: ``conv_kernel``, ``guided_kernel``, ``noise_amplitude``, ``probe_spacing``); this module holds
the estimators. The plug-and-play deblurrer and the impulse denoiser have no Gaussian posterior and
are refused.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch

from kdeq.maths.adaptive import GuidedOperator
from kdeq.maths.conv import Stationary
from kdeq.maths.linear import Negated, solve_affine
from kdeq.maths.operators import (
    Blur,
    Identity,
    KernelMap,
    Restriction,
    Sandwich,
)
from kdeq.maths.solvers import SolverConfig
from kdeq.maths.transforms import dct_symbol, is_axis_even
from kdeq.predictors.base import GaussianPosterior, Predictor, no_posterior
from kdeq.predictors.spec import GuidedArchitecture, NoiseLambda

#: the inner CG's settings, in float64 (the variance is a difference that cancels by up to 1/λ): at a
#: relative residual of 1e-6 the maps of the default denoisers at 256², σ = 25, are within 5·10⁻⁷ of
#: those at 1e-10 (relative, every pixel), in a quarter to three quarters of the time
INNER_SOLVER = SolverConfig(method="cg", tol=1e-6, max_iter=2000, atol=1e-30)


#: the largest default colouring period: 81 colours, 162 probes at two rounds
MAX_SPACING = 9


def probe_spacing(radius: int, period: int = 1) -> int:
    """The default colouring period ``d`` for a kernel of support radius ``radius`` (``K_ij = 0`` beyond
    it) seen through an operator that subsamples by ``period``: ``radius + 1`` (no two pixels of one
    colour within the kernel's support, so only the posterior's correction ``K Aᵀ G⁻¹ A K``, which
    decays beyond it, enters the error), at most ``MAX_SPACING``, then rounded up to a multiple of
    ``period`` (a period that beats against the observation lattice leaves correlated pairs)."""
    d = min(radius + 1, MAX_SPACING)
    return -(-d // period) * period


@dataclass(frozen=True)
class Uncertainty:
    """Posterior standard deviations of a batch.

    Attributes:
        std: ``sqrt(diag Σ)`` ``(B, c, H, W)`` float32, on the output's [0, 1] scale.
        amplitude: ``s²`` used per sample ``(B,)``.
        exact: whether a transform gave the diagonal exactly (else the probing estimate).
        probes: probes used (0 when exact).
        error: the probing estimate's own estimate of the mean relative error of ``std`` per sample
            ``(B,)`` (from the spread between rounds), or ``None`` (exact, or a single round).
        latent: where the output is a function of the Gaussian (``GaussianPosterior.scale``), the
            Gaussian's own ``sqrt(diag Σ)`` ``(B, c, H, W)`` float32 (the segmenter's logit); else
            ``None``.
    """

    std: torch.Tensor
    amplitude: torch.Tensor
    exact: bool
    probes: int
    error: torch.Tensor | None = None
    latent: torch.Tensor | None = None


def unsupported(predictor: Predictor) -> str | None:
    """Why ``predictor`` has no posterior standard deviation here, or ``None`` where it has one: its
    class has no Gaussian posterior (``Predictor.has_posterior``), it is a plug-and-play deblurrer, or
    its equilibrium kernel is a coregionalised (multi-channel) bank."""
    if not predictor.has_posterior:
        return no_posterior(predictor.task)
    if getattr(predictor, "plug_and_play", False):
        return f"{predictor.name} is a plug-and-play deblurrer, whose output is no Gaussian posterior mean"
    bank = predictor.tensors.get("w1")
    guided = isinstance(predictor.config.architecture, GuidedArchitecture)
    if not guided and bank is not None and bank.shape[:2] != (1, 1):
        return f"{predictor.name}'s kernel is coregionalised (multi-channel), which is not supported"
    return None


def gaussian_posterior(predictor: Predictor, *args: object, **kwargs: object) -> GaussianPosterior:
    """The ``GaussianPosterior`` of ``predictor`` for the inputs of its ``forward`` (same arguments):
    its ``gaussian_posterior``, without autograd; ``ValueError`` for a model without one."""
    with torch.inference_mode():
        return predictor.gaussian_posterior(*args, **kwargs)


def posterior(
    predictor: Predictor,
    *args: object,
    spacing: int | None = None,
    rounds: int = 2,
    generator: torch.Generator | None = None,
    amplitude: float | torch.Tensor | None = None,
    **kwargs: object,
) -> Uncertainty:
    """The posterior standard deviation of ``predictor``'s output for the inputs of its ``forward``
    (``*args``, ``**kwargs``: e.g. ``images, sigma=…``; ``images, missing``; ``images, psf, sigma=…``;
    ``images, scale=…``): exact through a transform where one applies, else probed with
    ``rounds × spacing²`` coloured Rademacher probes (module docstring) drawn from ``generator``;
    ``spacing`` defaults to the model's ``probe_spacing``. ``amplitude`` overrides ``s²`` (scalar or
    ``(B,)``). One image size per batch (no ``sizes``); a ``solver`` override is accepted and ignored
    (the inner solves use ``INNER_SOLVER``). The whole batch shares one draw of probes. Where the
    output is a function of the Gaussian (the segmenter), ``std`` is the output's by the delta method
    and ``latent`` the Gaussian's."""
    if (spacing is not None and spacing < 1) or rounds < 1:
        raise ValueError("spacing and rounds must be at least 1")
    post = gaussian_posterior(predictor, *args, **kwargs)
    with torch.inference_mode():
        if amplitude is not None:
            s2 = torch.as_tensor(amplitude, dtype=torch.float64, device=post.lam.device)
            post = _with_amplitude(post, s2.reshape(-1).expand(post.shape[0]))
        exact = _exact_variance(post)
        if exact is not None:
            if post.amplitude is None:
                post = _with_amplitude(post, _ml_amplitude(post, _solve(post, post.centred)))
            var = _with_prior(post, post.amplitude.reshape(-1, 1, 1, 1) * exact, post.amplitude)
            found = Uncertainty(_std(var, post.shape), post.amplitude.float(), True, 0)
        else:
            found = _probed(post, spacing or post.spacing, rounds, generator)
        if post.scale is None:
            return found
        std = (found.std * post.scale.float()).contiguous()
        return dataclasses.replace(found, std=std, latent=found.std)


def posterior_std(predictor: Predictor, *args: object, **kwargs: object) -> torch.Tensor:
    """``posterior(...).std``: ``sqrt(diag Σ)`` ``(B, c, H, W)`` float32 on the output's [0, 1] scale."""
    return posterior(predictor, *args, **kwargs).std


# --- the two estimators -------------------------------------------------------------------------


def _std(var: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """``sqrt(var)`` ``(B, 1, H, W)`` expanded to the output's channels, float32 (a probed variance
    can come out slightly negative where it is tiny: clamped at 0)."""
    return var.clamp(min=0).sqrt().float().expand(shape).contiguous()


def _with_prior(post: GaussianPosterior, var: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """``var`` ``(B, 1, H, W)`` of the solved part mixed with the prior's ``s² diag K`` by
    ``post.prior_share`` (``GaussianPosterior``); ``var`` itself where nothing is left at the prior."""
    if post.prior_diag is None:
        return var
    share = post.prior_share
    return (1 - share) * var + share * s2.reshape(-1, 1, 1, 1) * post.prior_diag


def _with_amplitude(post: GaussianPosterior, s2: torch.Tensor) -> GaussianPosterior:
    return dataclasses.replace(post, amplitude=s2.to(post.lam))


def _dct_matrix(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The orthonormal DCT-II ``(n, n)``: ``C[k, i] = √(2/n) cos(π(2i + 1)k/2n)``, row 0 times ``1/√2``."""
    k = torch.arange(n, dtype=dtype, device=device)[:, None]
    i = torch.arange(n, dtype=dtype, device=device)[None, :]
    c = math.sqrt(2.0 / n) * torch.cos(math.pi * (2 * i + 1) * k / (2 * n))
    c[0] /= math.sqrt(2.0)
    return c


def _square(taps: torch.Tensor) -> torch.Tensor:
    """Centred taps zero-padded to a square (the symbols take square filters)."""
    kh, kw = taps.shape
    k = max(kh, kw)
    return torch.nn.functional.pad(taps, ((k - kw) // 2, (k - kw) // 2, (k - kh) // 2, (k - kh) // 2))


def _exact_variance(post: GaussianPosterior) -> torch.Tensor | None:
    """``diag Σ / s²`` ``(B, 1, H, W)`` through the transform that diagonalises ``K`` and ``A``, or
    ``None`` when none does (module docstring): ``g_f = k̂_f λ/(ĥ_f² k̂_f + λ)`` summed against
    ``|U_if|²``."""
    inner = post.stationary
    if inner is None or not isinstance(post.op, Identity | Blur):
        return None
    _, _, height, width = post.shape
    lam = post.lam.reshape(-1, 1, 1)
    taps = inner.taps.double()
    radius = taps.shape[-1] // 2
    if inner.padding == "circular" and isinstance(post.op, Identity):
        if taps.shape[-1] > min(height, width):
            return None
        # the full 2-D DFT symbol (real: kernels are point-symmetric); |U_if|² = 1/N at every pixel
        padded = torch.zeros(height, width, dtype=taps.dtype, device=taps.device)
        padded[: taps.shape[0], : taps.shape[1]] = taps
        k_hat = torch.fft.fft2(padded.roll((-radius, -radius), dims=(0, 1))).real
        g = k_hat * lam / (k_hat + lam)
        return g.mean(dim=(-2, -1)).reshape(-1, 1, 1, 1).expand(-1, 1, height, width)
    if inner.padding != "symmetric" or not is_axis_even(taps) or radius > min(height, width):
        return None
    k_hat = dct_symbol(taps, (height, width))
    h2 = torch.ones_like(k_hat)
    if isinstance(post.op, Blur):
        psf = _square(post.op.psf.double())
        if post.op.border != "symmetric" or not is_axis_even(psf) or psf.shape[-1] // 2 > min(height, width):
            return None
        h2 = dct_symbol(psf, (height, width)).square()
    g = k_hat * lam / (h2 * k_hat + lam)  # (B, H, W)
    rows = _dct_matrix(height, taps.dtype, taps.device).square()
    cols = _dct_matrix(width, taps.dtype, taps.device).square()
    return (rows.T @ g @ cols)[:, None]


def _solve(post: GaussianPosterior, b: torch.Tensor) -> torch.Tensor:
    """``u = (A K Aᵀ + λI)⁻¹ b`` for ``b`` ``(B, n, H', W')``, every channel at once: the kGLM-DEQ
    equation ``u = W1 u + b/λ`` with ``W1 = −A K Aᵀ/λ`` (``kdeq.maths.linear.solve_affine``: CG with the
    operator's preconditioner, or a transform)."""
    w1 = Sandwich(post.op, post.kernel, -1.0 / post.lam)
    if post.stationary is None:
        # Sandwich's circulant preconditioner is the response to one impulse: for an adaptive kernel
        # it describes one pixel's neighbourhood only (and one sample's): plain CG, as the denoiser's
        w1.preconditioner = None
    zero = torch.zeros_like(b)
    mean = b / post.lam.reshape(-1, 1, 1, 1)
    u, stats, _ = solve_affine(w1, Negated(w1), zero, mean, None, None, INNER_SOLVER)
    if not bool(stats.converged.all()):
        # the map is still returned (CG's best iterate); a caller that must know reads the warning
        warnings.warn(
            f"posterior variance: the probes' CG stopped at relative residual "
            f"{stats.residual.max().item():.2e} > {INNER_SOLVER.tol:g} "
            f"after {stats.iterations.max().item()} iterations",
            RuntimeWarning,
            stacklevel=4,
        )
    return u


def _ml_amplitude(post: GaussianPosterior, alpha: torch.Tensor) -> torch.Tensor:
    """``s² = (y − A m)ᵀ α / n`` ``(B,)`` for ``α = (A K Aᵀ + λI)⁻¹(y − A m)``, ``n`` the observed
    values (a restriction's observed pixels times the channels)."""
    centred = post.centred
    if isinstance(post.op, Restriction):
        count = post.op.observed.flatten(1).sum(1).to(centred) * centred.shape[1]
    else:
        count = torch.full(
            (centred.shape[0],), centred[0].numel(), dtype=centred.dtype, device=centred.device
        )
    return (centred * alpha).flatten(1).sum(1) / count


def _probes(
    shape: tuple[int, int, int, int],
    spacing: int,
    rounds: int,
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """Coloured Rademacher probes ``(B, R·C, H, W)`` float64, round-major: probe ``(r, q)`` is the
    round's sign field on the pixels of colour ``q`` (``C`` the colours present) and 0 elsewhere."""
    bsz, _, height, width = shape
    signs = torch.randint(0, 2, (rounds, height, width), generator=generator).double().mul_(2).sub_(1)
    rows = torch.arange(height)[:, None] % spacing
    cols = torch.arange(width)[None, :] % spacing
    colour = rows * spacing + cols
    present = colour.unique()
    onehot = (colour[None] == present[:, None, None]).double()  # (C, H, W)
    probes = (signs[:, None] * onehot[None]).reshape(-1, height, width)
    return probes.to(device)[None].expand(bsz, -1, -1, -1)


def _probed(
    post: GaussianPosterior, spacing: int, rounds: int, generator: torch.Generator | None
) -> Uncertainty:
    """The coloured Hutchinson estimate of ``diag Σ`` (module docstring), every probe's inner solve in
    one batch of CG (the maximum-likelihood amplitude's solve as extra channels of the same batch)."""
    device = post.lam.device
    v = _probes(post.shape, spacing, rounds, generator, device)
    count = v.shape[1]
    kv = post.kernel(v)
    rhs = post.op.forward(kv)
    if post.amplitude is None:
        rhs = torch.cat([rhs, post.centred], dim=1)
    u = _solve(post, rhs)
    amplitude = post.amplitude
    if amplitude is None:
        amplitude = _ml_amplitude(post, u[:, count:])
        u = u[:, :count]
    sv = kv - post.kernel(post.op.adjoint(u))  # Σ v / s²
    s2 = amplitude.reshape(-1, 1, 1, 1)
    # each round covers every pixel once: its estimate is the sum over the colours
    per_round = (v * sv).reshape(v.shape[0], rounds, -1, *v.shape[-2:]).sum(2) * s2  # (B, R, H, W)
    var = per_round.mean(1, keepdim=True)
    error = None
    if rounds > 1:
        # the between-round spread: standard error of the variance, halved for the std; the solved
        # part's, which bounds the whole's where a prior part (exact) is mixed in
        se = per_round.std(1, keepdim=True) / math.sqrt(rounds)
        rel = se / (2 * var.clamp(min=torch.finfo(var.dtype).tiny))
        error = rel.flatten(1).mean(1).float()
    var = _with_prior(post, var, amplitude)
    return Uncertainty(_std(var, post.shape), amplitude.float(), False, count, error)


# --- what the models build their posteriors from ------------------------------------------------


def noise_amplitude(predictor: Predictor, s: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``s² = σ²/λ`` ``(B,)`` with ``σ`` ``(B,)`` as ``λ``'s rule used it (floored by a ``noise`` rule)."""
    rule = predictor.config.lam
    sigma = s.clamp(min=rule.min_sigma / 255.0) if isinstance(rule, NoiseLambda) else s
    return sigma.double().square() / lam.double()


def conv_kernel(predictor: Predictor, bsz: int) -> tuple[KernelMap, Stationary]:
    """``K`` of a conv model (its ``w1`` bank, the equilibrium's kernel) as a float64 map and filter.
    Only a one-channel bank (one kernel on every channel) has a per-channel posterior."""
    bank = predictor.tensors["w1"].double()
    if bank.shape[:2] != (1, 1):
        raise ValueError(f"{predictor.name}: a coregionalised (multi-channel) kernel is not supported")
    padding = predictor.config.architecture.padding
    ones = torch.ones(bsz, dtype=torch.float64, device=bank.device)
    return KernelMap(bank, ones, padding), Stationary(bank[0, 0], ones.reshape(-1, 1, 1, 1), padding)


def guided_kernel(predictor: Predictor, guide: torch.Tensor, h2: torch.Tensor) -> GuidedOperator:
    """The adaptive ``K̃`` of ``guide`` ``(B, c, H, W)`` and ``h²`` ``(B,)``, built in float64."""
    kern = predictor.config.architecture.kernel
    return GuidedOperator(
        guide.double(),
        predictor.tensors["spatial"].double(),
        kern.patch_radius,
        h2.double(),
        kern.normalize,
        predictor.weight_budget,
    )


__all__ = [
    "INNER_SOLVER",
    "MAX_SPACING",
    "GaussianPosterior",
    "Uncertainty",
    "conv_kernel",
    "gaussian_posterior",
    "guided_kernel",
    "noise_amplitude",
    "posterior",
    "posterior_std",
    "probe_spacing",
    "unsupported",
]
