"""kdeq: kernel-GLM deep equilibrium models (Tsuchida et al., ICLR 2022).

The public surface: exponential families and priors, PSD kernels with their
Gram matrices and filter banks, spectral norms, the kGLM → DEQ mapping, the
fixed-point solvers with implicit gradients, and reference kGLM solvers.
"""

from kdeq.maths.conv import conv
from kdeq.maths.deq import KGLMDEQ, ConvMap, DenseMap, DEQOutput
from kdeq.maths.families import Bernoulli, Binomial, Family, Gaussian, Poisson, Spin, get_family
from kdeq.maths.implicit import equilibrium
from kdeq.maths.kernels import (
    Coregional,
    Kernel,
    NotPSDError,
    filter_symbol,
    gram_min_eigenvalue,
    grid_coordinates,
    require_psd,
    symbol_min_eigenvalue,
)
from kdeq.maths.kglm import conv_deq, dense_deq
from kdeq.maths.priors import GaussianPrior, LogCoshPrior, Prior, get_prior, rho
from kdeq.maths.reference import kernel_ridge, newton_kglm
from kdeq.maths.solvers import SOLVERS, SolverConfig, SolverStats, solve
from kdeq.maths.spectral import (
    circular_spectral_norm,
    conv_spectral_norm,
    dense_spectral_norm,
    lambda_from_ratio,
)

__all__ = [
    "KGLMDEQ",
    "SOLVERS",
    "Bernoulli",
    "Binomial",
    "ConvMap",
    "Coregional",
    "DEQOutput",
    "DenseMap",
    "Family",
    "Gaussian",
    "GaussianPrior",
    "Kernel",
    "LogCoshPrior",
    "NotPSDError",
    "Poisson",
    "Prior",
    "SolverConfig",
    "SolverStats",
    "Spin",
    "circular_spectral_norm",
    "conv",
    "conv_deq",
    "conv_spectral_norm",
    "dense_deq",
    "dense_spectral_norm",
    "equilibrium",
    "filter_symbol",
    "get_family",
    "get_prior",
    "gram_min_eigenvalue",
    "grid_coordinates",
    "kernel_ridge",
    "lambda_from_ratio",
    "newton_kglm",
    "require_psd",
    "rho",
    "solve",
    "symbol_min_eigenvalue",
]
