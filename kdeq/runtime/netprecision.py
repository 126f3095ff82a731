"""The guide networks' arithmetic: float32, or bfloat16 where it measures faster.

A guide network (``kdeq.maths.guidenet``) is an ordinary ReLU CNN whose output, the pilot ``p``, is read
once, as the kernel's guide and the solve's mean; the kGLM operators that follow stay in IEEE
float32 whatever this module chooses (``kdeq.maths.precision``: their residuals cannot afford rounding).
Run in bfloat16 (8 mantissa bits; oneDNN accumulates each convolution in float32 and rounds its output), every
served model's score moves by at most 0.0015 dB (``denoise-kglm:4`` on Set12, BSD68 and CBSD68;
docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "the guide networks in bfloat16"). On a CPU with bfloat16 dot
products (AVX512_BF16, AMX) the 3×3 convolutions then run 2–3× faster; where bfloat16 is emulated they run
2–10× slower, which the measurement finds.

The options are ``float32`` (preferred) and ``bfloat16``, chosen by ``kdeq.runtime.autotune`` once per shape
class (device, features, and the batch and each side of the unshuffled input rounded up to a power
of two) by timing one hidden layer, a ``features → features`` 3×3 convolution on that shape, in
each; ``bfloat16`` must be ``autotune.MARGIN`` times faster. Only float32 inputs without autograd
are eligible: training, gradients and float64 callers keep their own arithmetic. Off the CPU the
network runs in float32 unless pinned: on an H100 (``bench/gpu.py``'s ``netprecision`` section,
docs/BENCHMARKS.md) bfloat16 saved nothing at batch 1, where the solve is bound by kernel launches,
and 15 % at batch 8–32, too little to give up float32's agreement with the CPU.
``KDEQ_NETWORK_PRECISION`` (or ``choice.pin``, ``choice.force``) pins one option; ``kdeq train``
pins ``float32`` unless the variable names one, so that its validation, and the checkpoint chosen
on it, do not depend on the machine.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kdeq.runtime import autotune

#: the options, in order of preference
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

#: the environment variable that pins an option (``auto``: measure)
ENV = "KDEQ_NETWORK_PRECISION"

log = logging.getLogger("kdeq.netprecision")

#: the measured choice and its pins (``choice.pin``, ``choice.force``, ``choice.reproducible``)
choice = autotune.Tuner("network precision", ENV, tuple(DTYPES), log)


def shape_class(h: torch.Tensor, features: int) -> tuple:
    """The key a choice is kept under, for a network of ``features`` features on its unshuffled
    input ``h`` ``(N, C, H', W')``: device type, ``features``, and ``N``, ``H'``, ``W'`` rounded up
    to a power of two."""
    n, _, height, width = h.shape
    return (h.device.type, features, autotune.bucket(n), autotune.bucket(height), autotune.bucket(width))


def measure(h: torch.Tensor, features: int) -> dict[str, float]:
    """Seconds of one hidden layer (``features → features``, 3×3, channels-last, as ``kdeq.maths.guidenet``
    runs it) on ``h``'s batch and sides, in each of ``DTYPES``, timed in turns (``autotune.compare``)."""
    n, _, height, width = h.shape
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, features, height, width, generator=gen).to(h.device)
    weight = torch.randn(features, features, 3, 3, generator=gen).to(h.device)
    layers = {}
    for name, dtype in DTYPES.items():
        xd = x.to(dtype).contiguous(memory_format=torch.channels_last)
        wd = weight.to(dtype).contiguous(memory_format=torch.channels_last)
        layers[name] = lambda xd=xd, wd=wd: F.conv2d(xd, wd, padding=1)
    with torch.no_grad():
        return autotune.compare(layers)


def dtype_for(h: torch.Tensor, features: int, grad: bool) -> torch.dtype:
    """The dtype a network of ``features`` features computes in on its input ``h``: ``h``'s own for
    a non-float32 ``h`` or with ``grad`` (autograd through the network), else the pinned option,
    float32 off the CPU, or the option measured for ``h``'s shape class (measured now if it is the
    first of its class)."""
    if h.dtype != torch.float32 or grad:
        return h.dtype
    name = choice.pinned()
    if name is not None:
        return DTYPES[name]
    if h.device.type != "cpu":
        return torch.float32
    subject = f"network of {features} features on {tuple(h.shape)}"
    return DTYPES[choice.decide(shape_class(h, features), lambda: measure(h, features), subject)]
