"""IEEE float32 in every kGLM operator (kdeq.maths.precision), and convergence at every noise level."""

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kdeq.cli import test_image as piecewise_image
from kdeq.maths import adaptive, deq, linear, precision
from kdeq.models.checkpoint import read_config
from kdeq.models.repository import load_predictor
from kdeq.predictors import robust
from kdeq.runtime import backends
from tests.helpers import predict_arguments

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.parent for p in (ROOT / "models").glob("*/*/config.json"))
GAUSSIAN = [p for p in SHIPPED if read_config(p).family == "gaussian"]


def _id(folder: Path) -> str:
    return f"{folder.parent.name}:{folder.name}"


def _inputs(model, size: int = 48, sigma: float = 25.0, seed: int = 0) -> tuple[tuple, dict]:
    """A piecewise-smooth test image with noise σ (0–255) and, for the inpainter, half its pixels
    missing; the arguments of ``model.predict``."""
    gen = torch.Generator().manual_seed(seed)
    clean = piecewise_image(size)
    return predict_arguments(
        model.task, clean + sigma / 255 * torch.randn(clean.shape, generator=gen), sigma, gen
    )


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to TF32: float32 with 10 of its 23 mantissa bits, to nearest."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


@pytest.fixture
def process_tf32():
    """Every backend's float32 precision set to TF32 for the test, as a user might set it; the
    settings before are put back afterwards (the flags are properties, out of monkeypatch's reach)."""
    before = precision.fp32_precisions()
    for backend in precision._BACKENDS:
        backend.fp32_precision = "tf32"
    yield
    for backend, value in zip(precision._BACKENDS, before, strict=True):
        backend.fp32_precision = value


@pytest.fixture
def emulated_cudnn(monkeypatch: pytest.MonkeyPatch, process_tf32: None) -> Iterator[None]:
    """``F.conv2d`` that, like cuDNN on an Ampere or later GPU, rounds its float32 operands to TF32
    when the process's flag allows it (TF32 here, as cuDNN's default is); every zero-border
    convolution runs through it, as on a GPU (``kdeq.runtime.backends`` measures only on the CPU)."""
    exact = F.conv2d

    def conv2d(x: torch.Tensor, w: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if torch.backends.cudnn.conv.fp32_precision == "tf32" and x.dtype == torch.float32:
            x, w = _tf32(x), _tf32(w)
        return exact(x, w, *args, **kwargs)

    monkeypatch.setattr(F, "conv2d", conv2d)
    with backends.force_backend("padded"):
        yield


def test_tf32_convolutions_change_the_inpainters_answer_and_ieee_float32_prevents_it(
    emulated_cudnn: None,
) -> None:
    """The failure this prevents: with the operands rounded to 10 mantissa bits the inpainter's
    solve still reports convergence, in its own rounded arithmetic, to a different image (off by
    several grey levels); inside ``predict`` the convolutions stay IEEE and the answer is exact."""
    model = load_predictor(ROOT / "models" / "inpaint-kglm" / "3", device="cpu")
    args, _ = _inputs(model, size=96, sigma=0.0)
    unguarded = type(model).forward.__wrapped__  # the forward without its IEEE section
    with torch.inference_mode():
        rounded = unguarded(model, *args)
    guarded = model.predict(*args)
    with precision.ieee_float32():
        reference = model.predict(*args)
    assert guarded.stats.converged.all() and torch.equal(guarded.output, reference.output)
    assert (rounded.output - reference.output).abs().max() > 10 / 255
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"  # the process's setting is back


@pytest.mark.parametrize("folder", SHIPPED, ids=_id)
def test_ieee_float32_is_in_force_inside_every_predictors_solve(
    folder: Path, monkeypatch: pytest.MonkeyPatch, process_tf32: None
) -> None:
    """Every convolution, guided kernel product and solve a shipped model runs sees IEEE float32,
    whatever the process had set (TF32 everywhere here), which is restored afterwards."""
    seen: list[tuple[str, bool]] = []

    def watched(name: str, fn):
        def call(*args, **kwargs):
            seen.append((name, precision.ieee_in_force()))
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(F, "conv2d", watched("conv2d", F.conv2d))
    monkeypatch.setattr(linear, "linear_cg", watched("linear_cg", linear.linear_cg))
    # the impulse denoiser's inner solves (kdeq.predictors.robust)
    monkeypatch.setattr(robust, "linear_cg", watched("linear_cg", robust.linear_cg))
    monkeypatch.setattr(linear, "transform_solve", watched("transform", linear.transform_solve))
    monkeypatch.setattr(deq, "equilibrium", watched("equilibrium", deq.equilibrium))
    monkeypatch.setattr(adaptive.GuidedMap, "forward", watched("guided", adaptive.GuidedMap.forward))
    model = load_predictor(folder, device="cpu")
    args, kwargs = _inputs(model)
    model.predict(*args, **kwargs)
    assert seen and all(ieee for _, ieee in seen), seen
    assert {name for name, _ in seen} & {"linear_cg", "transform", "equilibrium", "guided"}
    assert precision.fp32_precisions() == ("tf32",) * len(precision._BACKENDS)


def test_the_ieee_section_holds_while_any_thread_is_inside_it(process_tf32: None) -> None:
    """One worker thread per device: a thread leaving its solve must not hand TF32 back to another
    still inside its own; the last to leave restores the process's settings."""
    first_inside, second_inside, first_left = threading.Event(), threading.Event(), threading.Event()
    observed: dict[str, bool] = {}

    def first() -> None:
        with precision.ieee_float32():
            first_inside.set()
            second_inside.wait(5)
        first_left.set()

    def second() -> None:
        first_inside.wait(5)
        with precision.ieee_float32():
            second_inside.set()
            first_left.wait(5)
            observed["after the first left"] = precision.ieee_in_force()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert observed == {"after the first left": True}
    assert precision.fp32_precisions() == ("tf32",) * len(precision._BACKENDS)


@pytest.mark.parametrize("folder", GAUSSIAN, ids=_id)
def test_every_gaussian_model_converges_in_float32_from_sigma_half_to_255(folder: Path) -> None:
    """Low noise makes ``A = I + K/λ`` ill-conditioned (``λ ∝ σ²``): at σ = 0.5 an iterate rounded
    to float32 already misses ``tol``; the solves must converge at every level all the same."""
    model = load_predictor(folder, device="cpu")
    for sigma in (0.5, 2.0, 25.0, 255.0):
        args, kwargs = _inputs(model, size=40, sigma=sigma, seed=int(sigma * 2))
        stats = model.predict(*args, **kwargs).stats
        assert stats.converged.all(), (sigma, stats)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_gpu_script_refuses_a_machine_without_cuda_and_says_so(tmp_path: Path) -> None:
    """``bench/gpu.sh`` must not report a CPU run as GPU figures: without a device it stops, exit 2."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    assert not list(tmp_path.glob("gpu-*/results.md"))
