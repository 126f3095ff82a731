"""``kdeq.runtime.native``: the guided kernel's offset loops compiled, against torch's
(``kdeq.maths.adaptive``), and its build: cached per source and machine, and a clear fallback where it
cannot be built."""

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
import torch

from kdeq.maths import graphs
from kdeq.maths.adaptive import GuidedOperator, apply_weights, guided_weights
from kdeq.maths.kernels import Kernel
from kdeq.runtime import native
from tests.helpers import require_native

F64 = torch.float64


@pytest.fixture
def built() -> None:
    require_native()


def both(fn) -> dict[str, object]:
    """``fn()`` by torch's loops and by the compiled ones."""
    out = {}
    for name in ("loop", "native"):
        with native.choice.force(name), torch.no_grad():
            out[name] = fn()
    return out


def taps(radius: int, dtype: torch.dtype, holes: bool = False) -> torch.Tensor:
    spatial = Kernel(profile="matern32", lengthscale=2.0, radius=radius).filter(dtype).clone()
    if holes:  # zero taps between the offsets, point-symmetric
        spatial[::2, 1::2] = 0
    return spatial


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize(
    ("channels", "shape", "patch", "radius", "sizes", "budget", "holes"),
    [
        (1, (2, 9, 11), 1, 3, None, 1 << 30, False),
        (3, (1, 40, 37), 3, 6, None, 1 << 30, False),
        (3, (2, 23, 30), 2, 4, [(23, 30), (15, 19)], 1 << 30, False),
        (1, (2, 21, 18), 0, 2, [(12, 18), (21, 9)], 1, False),
        (3, (1, 33, 47), 2, 5, None, 1 << 30, True),
        (1, (1, 6, 5), 2, 6, None, 1 << 30, False),  # a window wider than the image
    ],
)
def test_each_compiled_loop_equals_torchs(
    channels, shape, patch, radius, sizes, budget, holes, dtype
) -> None:
    """The weight maps, ``K x``, ``K̃ x`` and both non-local means (each at κ = 1 to 5), on kept
    weights and on weights made again a part at a time (a one-byte budget), padded batches, zero taps,
    a window wider than the image. The sums' order differs, and the exponential is ``native.c``'s
    own: float64 to 1e-12, float32 to a few units in the last place."""
    bsz, height, width = shape
    gen = torch.Generator().manual_seed(7)
    guide = torch.rand(bsz, channels, height, width, generator=gen, dtype=dtype)
    x = torch.randn(bsz, 2, height, width, generator=gen, dtype=dtype)
    v = torch.rand(bsz, channels, height, width, generator=gen, dtype=dtype)
    h2 = torch.linspace(0.05, 0.6, bsz, dtype=dtype)
    spatial = taps(radius, dtype, holes)

    def run() -> list[torch.Tensor]:
        op = GuidedOperator(guide, spatial, patch, h2, True, budget, sizes=sizes)
        weights = guided_weights(guide, spatial, patch, h2, sizes=sizes)
        means = [t for k in range(1, 6) for by in (False, True) for t in op.nonlocal_mean(v, k, patches=by)]
        return [weights.clone(), apply_weights(weights, x), op(x), op.degree, *means]

    results = both(run)
    tol = {"rtol": 1e-12, "atol": 1e-14} if dtype == F64 else {"rtol": 2e-6, "atol": 1e-6}
    for loop, compiled in zip(results["loop"], results["native"], strict=True):
        torch.testing.assert_close(compiled, loop, **tol)


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("patches", [False, True])
def test_results_do_not_depend_on_how_many_threads_share_the_rows(patches) -> None:
    """Each thread takes a band of rows and writes only those: with 1, 2 or 3 threads the outputs are
    bit for bit equal (a term that crosses a band's edge, or a pixel's sums in another order, would
    show)."""
    gen = torch.Generator().manual_seed(9)
    guide = torch.rand(2, 3, 70, 41, generator=gen)
    x = torch.randn(2, 3, 70, 41, generator=gen)
    spatial = taps(5, torch.float32)
    h2 = torch.tensor([0.2, 0.5])
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with native.choice.force("native"), torch.no_grad():
                op = GuidedOperator(guide, spatial, 2, h2, True)
                outputs.append((op(x), *op.nonlocal_mean(x, 3, patches)))
    finally:
        torch.set_num_threads(threads)
    for other in outputs[1:]:
        for a, b in zip(outputs[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("image", ["noisy", "levels", "flat"])
def test_block_matchings_compiled_selection_is_torchs_bit_for_bit(monkeypatch, image, dtype) -> None:
    """``native.select`` and ``collab.running_best`` on the same weight maps, a part of the offsets at
    a time as ``collab.matches`` calls them: the same scores and members, in the same order, where
    candidates tie too (an image of eight grey levels, a flat one, whose every weight is 1), and the
    same on 1, 2 or 3 threads."""
    from kdeq.maths import collab
    from kdeq.maths.adaptive import half_offsets

    gen = torch.Generator().manual_seed(11)
    guide = torch.rand(1, 1, 47, 52, generator=gen, dtype=dtype)
    guide = {"noisy": guide, "levels": (guide * 8).round() / 8, "flat": torch.zeros_like(guide)}[image]
    height, width = guide.shape[-2:]
    refs = (collab.grid(height)[:, None] * width + collab.grid(width)[None, :]).reshape(-1)
    offsets = half_offsets(5)
    window = torch.ones(11, 11, dtype=dtype)
    monkeypatch.setattr(native, "MIN_REFS_PER_THREAD", 1)
    threads = torch.get_num_threads()
    results = []
    try:
        for name, count in (("loop", 2), ("native", 1), ("native", 2), ("native", 3)):
            torch.set_num_threads(count)
            scores = guide.new_full((refs.numel(), 8), -2.0)
            members = torch.zeros(refs.numel(), 8, dtype=torch.long)
            for first in range(0, len(offsets), 16):
                part = offsets[first : first + 16]
                weights = guided_weights(guide, window, 2, torch.tensor([0.5], dtype=dtype), offsets=part)
                weights = weights[0].reshape(len(part), -1)
                select = collab.running_best if name == "loop" else native.select
                select(weights, part, first == 0, refs, height, width, scores, members)
            results.append((scores, members))
    finally:
        torch.set_num_threads(threads)
    for scores, members in results[1:]:
        assert torch.equal(scores, results[0][0]) and torch.equal(members, results[0][1])
    assert torch.equal(results[0][1][:, 0], refs)  # the reference first


def test_autograd_and_other_devices_use_torchs_loops(built) -> None:
    """The compiled loops have no backward: a guide to differentiate takes torch's path, and its
    weights carry the gradient."""
    guide = torch.rand(1, 1, 8, 9, requires_grad=True)
    spatial, h2 = taps(2, torch.float32), torch.tensor([0.3])
    assert native.enabled(guide.detach()) and not native.enabled(guide)
    assert not native.enabled(guide.detach().to(torch.float16))
    guided_weights(guide, spatial, 1, h2).sum().backward()
    assert guide.grad is not None and guide.grad.abs().sum() > 0


def test_the_environment_variable_pins_the_implementation(built, monkeypatch) -> None:
    x = torch.rand(1, 1, 4, 4)
    monkeypatch.setenv(native.ENV, "loop")
    assert not native.enabled(x)
    monkeypatch.setenv(native.ENV, "native")
    assert native.enabled(x)
    monkeypatch.setenv(native.ENV, "fast")
    with pytest.raises(ValueError, match="auto or one of"):
        native.enabled(x)


def test_the_service_pins_its_settings(tmp_path, monkeypatch) -> None:
    """``KDEQ_GUIDED_BACKEND``, ``KDEQ_NATIVE_CACHE`` and ``KDEQ_CUDA_GRAPHS``, the last two over the
    variables themselves."""
    from service.settings import Settings
    from service.state import Service

    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "elsewhere"))
    try:
        Service(Settings(models_dir=tmp_path, device=("cpu",), guided_backend="loop", warmup=False))
        assert native.choice.pinned() == "loop" and not native.enabled(torch.rand(1, 1, 4, 4))
        assert native._cache_dir() == tmp_path / "elsewhere"
        Service(Settings(models_dir=tmp_path, device=("cpu",), native_cache=tmp_path / "cache", warmup=False))
        assert native.choice.pinned() is None and native._cache_dir() == tmp_path / "cache"
        # and KDEQ_CUDA_GRAPHS, over the variable
        monkeypatch.setenv(graphs.ENV, "1")
        Service(Settings(models_dir=tmp_path, device=("cpu",), cuda_graphs=False, warmup=False))
        assert not graphs.replays()
    finally:
        native.choice.pin("auto")
        native.pin_cache(None)
        graphs.pin(None)


@pytest.fixture
def fresh(monkeypatch, tmp_path) -> Iterator[None]:
    """``kdeq.runtime.native`` as in a new process, its cache in ``tmp_path``."""
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failed", None)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    yield


@pytest.mark.usefixtures("fresh")
def test_without_a_compiler_torchs_loops_serve_and_the_log_says_why(monkeypatch, caplog) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    guide = torch.rand(1, 1, 12, 10)
    spatial, h2 = taps(3, torch.float32), torch.tensor([0.3])
    with caplog.at_level(logging.WARNING, logger="kdeq.native"):
        assert native.library() is None and not native.enabled(guide)
        op = GuidedOperator(guide, spatial, 1, h2, True)
    assert "no C compiler (/nonexistent/cc)" in caplog.text and "torch's are used" in caplog.text
    assert native.build_error() is not None and "no C compiler" in native.build_error()
    with native.choice.force("loop"):
        torch.testing.assert_close(
            op(guide), GuidedOperator(guide, spatial, 1, h2, True)(guide), rtol=0, atol=0
        )


@pytest.mark.usefixtures("fresh")
def test_the_library_is_built_once_per_source_compiler_and_cpu(monkeypatch, tmp_path) -> None:
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler here")
    first = native._build(compiler)
    assert first.parent == tmp_path and first.suffix == ".so"
    stamp = first.stat().st_mtime_ns
    assert native._build(compiler) == first and first.stat().st_mtime_ns == stamp  # from the cache
    monkeypatch.setattr(native, "_cpu", lambda: "another machine")
    other = native._build(compiler)
    assert other != first and sorted(tmp_path.iterdir()) == sorted([first, other])
    assert native.library() is not None  # the fresh module loads what it built


def test_without_a_writable_cache_the_library_is_kept_in_a_private_temporary_folder(
    monkeypatch, tmp_path
) -> None:
    """A service user without a home: the library goes to a folder of the temporary directory that is
    this user's alone, and a folder others may write is refused (a library found there is loaded)."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.delenv(native.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # kdeq/native cannot be made under a file
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = native._cache_dir()
    assert folder == tmp_path / f"kdeq-native-{os.getuid()}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match="not this user's own"):
        native._cache_dir()


MAPS = """\
7f1d00000000-7f1d00100000 r-xp 00000000 08:01 1234 /venv/torch/lib/libgomp.so.1
7f1d00100000-7f1d00200000 r--p 00100000 08:01 1234 /venv/torch/lib/libgomp.so.1
7f1d00300000-7f1d00400000 r-xp 00000000 08:01 99 /usr/lib/x86_64-linux-gnu/libm.so.6
7f1d00500000-7f1d00501000 rw-p 00000000 00:00 0
"""


@pytest.mark.usefixtures("fresh")
def test_an_openmp_runtime_the_library_brings_beside_torchs_is_refused(monkeypatch, caplog) -> None:
    """Threads of a second pool compete with torch's for the cores (measured slower than torch's own
    loops): the library is used only on torch's OpenMP runtime. A runtime already in the process
    under another name (scikit-learn's) is not the library's, and does not stop it."""
    other = (
        "7f1d00800000-7f1d00900000 r-xp 00000000 08:01 55 /venv/scikit_learn.libs/libgomp-e985bcbb.so.1.0.0\n"
    )
    assert native.openmp_runtimes(MAPS) == {"/venv/torch/lib/libgomp.so.1"}
    assert len(native.openmp_runtimes(MAPS + other)) == 2
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    # before and after loading: scikit-learn's runtime was there already
    seen = iter([MAPS + other, MAPS + other])
    monkeypatch.setattr(native, "_maps_text", lambda: next(seen))
    assert native.library() is not None
    # the loading brings one
    monkeypatch.setattr(native, "_library", None)
    second = "7f1d00600000-7f1d00700000 r-xp 00000000 08:01 77 /usr/lib/libgomp.so.1\n"
    seen = iter([MAPS, MAPS + second])
    with caplog.at_level(logging.WARNING, logger="kdeq.native"):
        assert native.library() is None
    assert "an OpenMP runtime of its own beside torch's" in native.build_error()
    assert "/usr/lib/libgomp.so.1" in native.build_error() and "torch's are used" in caplog.text


UNALLOCATABLE = """
import resource, sys, torch
from kdeq.runtime import native
assert native.library() is not None  # loaded from the cache before the limit
width = 1 << 21  # a thread's row buffers: 2 x 8 rows x width floats = 128 MiB
weights, x = torch.zeros(1, 1, 1, width), torch.zeros(1, 1, 1, width)
out = torch.zeros_like(x)
size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (32 << 20), resource.RLIM_INFINITY))
try:
    native.pairs(weights, [0], [(0, 0)], [1.0], 1, x, out)
except MemoryError as error:
    sys.exit(f"raised: {error}")
"""


@pytest.mark.usefixtures("built")
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the address space from /proc")
def test_row_buffers_that_cannot_be_allocated_raise_rather_than_leave_rows_uncomputed() -> None:
    """A fresh process whose address space has room for 32 MiB more: the loop's 128 MiB of row
    buffers cannot be had, and the call raises ``MemoryError`` (it used to return with its rows
    never written)."""
    run = subprocess.run([sys.executable, "-c", UNALLOCATABLE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert "raised: kdeq.runtime.native: a thread's row buffers could not be allocated" in run.stderr
