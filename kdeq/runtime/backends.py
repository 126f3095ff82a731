"""Zero-border convolutions by the backend measured fastest, once per shape class (the CPU's
``cudnn.benchmark``).

The same correlation ``y = C ⋆ x`` with a zero border, ``(B, c_in, H, W) → (B, c_out, H, W)``, has
several exact implementations whose speed depends on the machine and the shapes:

- ``padded``: ``F.conv2d(x, C, padding=r)``, torch's own. On this project's CPU oneDNN runs a
  one-channel 11×11 filter over 256² this way in ~24 ms;
- ``prepadded``: the zeros put in first (``F.pad``), then an unpadded ``F.conv2d``: the same filter
  in ~1.7 ms (oneDNN takes another path without the padding), and no faster for 3×3 filters;
- ``fft``: the product of the spectra on a grid padded by the filter, which pays for large filters.

On the CPU ``conv_zeros`` times the candidates (``candidates``) on the first input of a shape class
(the batch and each side rounded up to a power of two, the channels and the filter exact), keeps the
fastest, and logs the choice (logger ``kdeq.runtime.backends``; the rule is ``kdeq.runtime.autotune``'s). A
backend is passed over for a later one (in the order above) only when that one is at least
``autotune.MARGIN`` times faster, so that timing noise does not flip a close choice between runs.
Other devices use ``padded`` (cuDNN does its own benchmarking). ``KDEQ_CONV_BACKEND`` (or
``force_backend``) pins one backend for every shape; ``auto`` measures. ``kdeq train`` pins
``prepadded`` unless the variable names a backend, so that its ranks and a resumed run repeat the
same arithmetic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kdeq.runtime import autotune

#: ``fft`` is timed only for filters of at least this many taps, on at most this many channel pairs
FFT_MIN_TAPS = 25
FFT_MAX_PAIRS = 9

#: the environment variable that pins a backend (``auto``: measure)
ENV = "KDEQ_CONV_BACKEND"

log = logging.getLogger("kdeq.backends")


def _padded(x: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, bank, padding=(bank.shape[-2] // 2, bank.shape[-1] // 2))


def _prepadded(x: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    rh, rw = bank.shape[-2] // 2, bank.shape[-1] // 2
    return F.conv2d(F.pad(x, (rw, rw, rh, rh)), bank)


def _fft(x: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    """``y[o] = Σ_i C[o, i] ⋆ x[i]`` by the DFT on the ``(H + kh − 1)×(W + kw − 1)`` grid, where the
    circular correlation of the zero-extended image equals the zero-border one on the image."""
    kh, kw = bank.shape[-2:]
    h, w = x.shape[-2:]
    size = (h + kh - 1, w + kw - 1)
    spectrum = torch.fft.rfft2(F.pad(x, (0, kw - 1, 0, kh - 1)))
    # the correlation's taps reversed and centred on the origin: the filter as a convolution
    taps = torch.fft.rfft2(bank.flip(-2, -1), s=size)
    out = torch.fft.irfft2(torch.einsum("bihw,oihw->bohw", spectrum, taps), s=size)
    return out[..., kh // 2 : kh // 2 + h, kw // 2 : kw // 2 + w]


BACKENDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "padded": _padded,
    "prepadded": _prepadded,
    "fft": _fft,
}

_tuner = autotune.Tuner("convolution backend", ENV, tuple(BACKENDS), log)
#: the backend pinned by ``force_backend``, ``pin`` or ``KDEQ_CONV_BACKEND``, in that order (``None``:
#: measure)
_pinned = _tuner.pinned
pin = _tuner.pin
force_backend = _tuner.force
reproducible = _tuner.reproducible
chosen = _tuner.chosen
forget = _tuner.forget


def shape_class(x: torch.Tensor, bank: torch.Tensor) -> tuple:
    """The key a choice is kept under: device type, dtype, the filter bank's shape exactly, the batch
    and each side rounded up to a power of two."""
    sides = tuple(autotune.bucket(n) for n in (x.shape[0], x.shape[2], x.shape[3]))
    return (x.device.type, x.dtype, tuple(bank.shape), *sides)


def candidates(bank: torch.Tensor) -> list[str]:
    """The backends worth timing for ``bank`` ``(c_out, c_in, kh, kw)``, in ``BACKENDS``' order:
    ``fft`` only for a large filter on few channel pairs (on many channels of a small filter it is
    far slower, and timing it would cost a request its deadline)."""
    c_out, c_in, kh, kw = bank.shape
    keep = {"padded", "prepadded"}
    if kh * kw >= FFT_MIN_TAPS and c_out * c_in <= FFT_MAX_PAIRS:
        keep.add("fft")
    return [name for name in BACKENDS if name in keep]


def measure(x: torch.Tensor, bank: torch.Tensor) -> dict[str, float]:
    """Seconds of each of ``candidates(bank)`` on ``x`` and ``bank`` (no autograd), timed in turns
    (``autotune.compare``)."""
    with torch.no_grad():
        return autotune.compare({n: lambda n=n: BACKENDS[n](x, bank) for n in candidates(bank)})


def choose(times: dict[str, float]) -> str:
    """The first timed backend, in ``BACKENDS``' order of preference, within ``MARGIN`` of the
    fastest: a close call always goes the same way, so the choice does not flip with timing noise."""
    return autotune.choose(times, tuple(BACKENDS))


def backend_for(x: torch.Tensor, bank: torch.Tensor) -> str:
    """The backend ``conv_zeros`` uses for ``x`` and ``bank``: pinned, ``padded`` off the CPU, else
    the one measured for their shape class (measured now if it is the first of its class)."""
    pinned = _pinned()
    if pinned is not None:
        return pinned
    if x.device.type != "cpu":
        return "padded"
    subject = f"conv {tuple(bank.shape)} on {tuple(x.shape)} ({x.dtype})"
    return _tuner.decide(shape_class(x, bank), lambda: measure(x.detach(), bank.detach()), subject)


def conv_zeros(x: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    """``C ⋆ x`` with a zero border, ``(B, c_in, H, W) → (B, c_out, H, W)``, for ``bank``
    ``(c_out, c_in, kh, kw)`` with odd sides, by ``backend_for``'s backend."""
    return BACKENDS[backend_for(x, bank)](x, bank)
