"""IEEE float32 for the kGLM operators on every device, whatever the process-wide defaults.

Ampere and later GPUs run float32 convolutions (cuDNN, on by default) and, when asked, matrix
products in TF32, which keeps 10 of float32's 23 mantissa bits; oneDNN can do the same on CPUs
with bf16/TF32 units. The kGLM operators cannot afford it: ``A = I + K/λ`` is far from the
identity at low noise (``‖K/λ‖`` in the thousands), so an operand rounded to 10 bits puts an error
of ``2⁻¹¹·‖K/λ‖`` into every residual, and CG and Anderson stall far above their tolerance
(``tests/test_precision.py`` shows it by rounding the operands on the CPU).

PyTorch keeps these choices as process-wide flags (``torch.backends.*.fp32_precision``), not per
thread or per call. ``ieee_float32`` therefore holds them at ``"ieee"`` while any thread is inside
it, reference-counted: the first thread to enter saves the process's settings and the last to leave
restores them, so the service's worker threads (one per device) and the autograd engine's threads
can overlap their solves freely. Code outside kdeq that runs during a solve in the same process
runs in IEEE float32 too: the safe direction.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")

#: the backends whose float32 convolutions and matrix products may otherwise round to TF32/bf16
_BACKENDS = (
    torch.backends.cuda.matmul,
    torch.backends.cudnn.conv,
    torch.backends.mkldnn.matmul,
    torch.backends.mkldnn.conv,
)

_lock = threading.Lock()
_holders = 0
_saved: tuple[str, ...] = ()


def fp32_precisions() -> tuple[str, ...]:
    """The current ``fp32_precision`` of each backend in ``_BACKENDS`` (``"ieee"``, ``"tf32"``,
    ``"bf16"`` or ``"none"`` = inherited)."""
    return tuple(b.fp32_precision for b in _BACKENDS)


def ieee_in_force() -> bool:
    """Whether every float32 convolution and matrix product now runs in IEEE float32."""
    return all(p == "ieee" for p in fp32_precisions())


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """Within: IEEE float32 convolutions and matrix products on every backend (module docstring)."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            _saved = fp32_precisions()
            for backend in _BACKENDS:
                backend.fp32_precision = "ieee"
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                for backend, value in zip(_BACKENDS, _saved, strict=True):
                    backend.fp32_precision = value


def ieee(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run inside ``ieee_float32``."""

    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
        with ieee_float32():
            return fn(*args, **kwargs)

    return wrapped
