"""The devices the service runs on: which ones ``auto`` picks and why, how a worker thread selects
its device, how a failure is classified, and how memory is handed back after one.

A failure of a solve is one of three kinds (``classify``): the device ran out of memory, including
the allocation failures cuBLAS, cuDNN and cuFFT report as a plain ``RuntimeError`` (the request
gets 503 ``out_of_memory``); a *sticky* device error — a device-side assert, an illegal memory
access, a launch failure, an uncorrectable ECC error — after which every later CUDA call in the
process fails (the device is marked failed and the process exits so that it is restarted); or
anything else (the request's own fault, handled by the engine).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from typing import Literal, NamedTuple

import torch

from kdeq.predictors.base import resolve_device
from kdeq.runtime import heap

log = logging.getLogger("kdeq.service")

Failure = Literal["out_of_memory", "device"]

# messages of allocation failures that do not come as torch.OutOfMemoryError: the CUDA runtime's
# "out of memory", the libraries' *_ALLOC_FAILED (cuBLAS, cuDNN, cuFFT, cuSOLVER, cuSPARSE) and
# cuDNN's workspace refusal
OUT_OF_MEMORY_MESSAGES = ("out of memory", "ALLOC_FAILED", "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE")
# the CUDA runtime's messages for errors that corrupt the process's context: every later call fails
STICKY_MESSAGES = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "uncorrectable ECC error",
    "misaligned address",
    "an illegal instruction was encountered",
    "the launch timed out and was terminated",
    "hardware stack error",
)
# the same errors as cudaError_t codes, carried by torch.AcceleratorError.error_code: ECC
# uncorrectable, illegal address, launch timeout, assert, hardware stack error, illegal instruction,
# misaligned address, invalid address space, invalid PC, launch failure
STICKY_CUDA_CODES = frozenset({214, 700, 702, 710, 714, 715, 716, 717, 718, 719})


def classify(err: BaseException) -> Failure | None:
    """``out_of_memory`` when ``err`` says the device (or host) ran out of memory, ``device`` when it
    is a sticky device error, ``None`` for anything else."""
    if isinstance(err, torch.OutOfMemoryError | MemoryError):
        return "out_of_memory"
    if not isinstance(err, RuntimeError):
        return None
    message = str(err)
    if getattr(err, "error_code", None) in STICKY_CUDA_CODES or any(m in message for m in STICKY_MESSAGES):
        return "device"
    if any(m.lower() in message.lower() for m in OUT_OF_MEMORY_MESSAGES):
        return "out_of_memory"
    return None


class DeviceChoice(NamedTuple):
    """The devices to serve on, why, and how loudly to log it (``logging`` level)."""

    devices: list[str]
    reason: str
    level: int


def choose_devices(requested: tuple[str, ...]) -> DeviceChoice:
    """The concrete devices for ``KDEQ_DEVICE`` (already normalised by ``Settings``): ``auto`` is
    every CUDA device, or the CPU with the reason CUDA is not usable — a warning when this torch is
    built with CUDA, since then a GPU was probably meant to be used."""
    if requested != ("auto",):
        return DeviceChoice(list(requested), "as configured by KDEQ_DEVICE", logging.INFO)
    try:
        resolve_device("cuda")
    except ValueError as err:
        level = logging.INFO if torch.version.cuda is None else logging.WARNING
        return DeviceChoice(["cpu"], f"auto chose the CPU because CUDA is not usable: {err}", level)
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    names = ", ".join(f"{d} {torch.cuda.get_device_name(d)}" for d in devices)
    return DeviceChoice(devices, f"auto chose every CUDA device: {names}", logging.INFO)


def select_device(device: str) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for the CPU), so that the
    tensors, streams and cuBLAS/cuDNN handles the thread creates belong to it."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


@contextlib.contextmanager
def on_device(device: str) -> Iterator[None]:
    """Within: ``device`` is the calling thread's current CUDA device (nothing for the CPU); the
    previous one is restored after, so that a shared thread (a load at run time) leaves no trace."""
    if not device.startswith("cuda"):
        yield
        return
    with torch.cuda.device(torch.device(device)):
        yield


def release_memory(device: str) -> None:
    """Hand back memory after a solve ran out of it: collect the objects the failure left in
    reference cycles (an exception's frames can form them), then return the free blocks — the CUDA
    caching allocator's, or the C heap's — so that a smaller batch, or another process, can have
    them."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    else:
        heap.trim()
