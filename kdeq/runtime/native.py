"""The guided kernel's offset loops as compiled C (``native.c``), for the CPU.

``kdeq.maths.adaptive`` makes the weight maps, applies ``K`` and gathers the non-local matches an offset at a
time, a few torch operations per offset: each one a pass over a map in memory, so that on a CPU the loops are
bound by memory traffic and by the operations' count, not by arithmetic
(docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "the offset loops compiled"). ``native.c`` does each loop in
one pass over a block of rows, its intermediate rows in cache.

The file is compiled the first time it is needed, by the C compiler ``CC`` (default ``cc``) for the
machine it runs on (``-march=native``), and kept in ``KDEQ_NATIVE_CACHE`` (default
``~/.cache/kdeq/native``), under a name that hashes the source, the flags, the compiler's version and
the CPU's model and features, so that another machine, compiler or source builds its own. Without a
compiler, or if the build fails, kdeq uses its torch loops; the build and the choice are logged
(logger ``kdeq.runtime.native``). ``KDEQ_GUIDED_BACKEND`` picks the implementation: ``native``, ``triton``
(``kdeq.maths.fused``'s kernels, for GPUs), ``loop`` (torch's operations) or ``auto`` (``native`` on a CPU
where it builds, ``triton`` on a CUDA device where Triton imports).

A call splits the rows of its images into bands, one per thread of torch's own OpenMP pool
(``torch.get_num_threads()``): the library is linked to ``libgomp.so.1``, which the loader finds
already loaded by torch. Threads of a pool of their own competed with torch's workers, which spin
for a while after each operation, and lost; so where loading it brings an OpenMP runtime beside
torch's (a torch built with another), torch's loops are used. Results do not depend on the split: each pixel
is summed in one fixed order (see ``native.c``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from kdeq.runtime import autotune

ENV = "KDEQ_GUIDED_BACKEND"
CACHE_ENV = "KDEQ_NATIVE_CACHE"
SOURCE = Path(__file__).with_name("native.c")
#: compiled without fused multiply-adds, so that a vector lane and the scalar remainder round alike
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-std=c11")
#: rows below which a call runs on one thread (a thread's start costs more than a few rows' work)
MIN_ROWS_PER_THREAD = 16
#: block matching's references below which its selection runs on one thread
MIN_REFS_PER_THREAD = 256

log = logging.getLogger("kdeq.native")

#: ``native``, ``triton`` or ``loop``: pinned by ``KDEQ_GUIDED_BACKEND``, ``pin`` or ``force``; ``auto`` is
#: ``native`` on a CPU wherever the library builds (the loops are never faster: docs/BENCHMARKS.md) and
#: ``triton`` (``kdeq.maths.fused``) on a CUDA device wherever Triton imports
choice = autotune.Tuner("guided kernel's implementation", ENV, ("native", "triton", "loop"), log)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failed: str | None = None
_compiler = ""  # the compiler's first line of --version
_cache_pin: Path | None = None  # pin_cache's folder


def pin_cache(folder: Path | None) -> None:
    """Keep the compiled library in ``folder`` from now on, over ``KDEQ_NATIVE_CACHE`` (the service's
    setting of that name); ``None`` drops the pin. A library already loaded stays loaded."""
    global _cache_pin
    _cache_pin = folder


def _cpu() -> str:
    """The CPU's model and feature flags (``-march=native`` compiles for them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _cache_dir() -> Path:
    """``KDEQ_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/kdeq/native`` (``~/.cache`` by default); where that
    cannot be made or written (a service user without a home), a folder of the temporary directory
    that only this user may write and that this user owns, since a library found there is loaded;
    ``pin_cache``'s folder over all of them."""
    if _cache_pin is not None:
        return _cache_pin
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or (Path.home() / ".cache")) / "kdeq" / "native"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    private = Path(tempfile.gettempdir()) / f"kdeq-native-{os.getuid()}"
    private.mkdir(mode=0o700, exist_ok=True)
    info = private.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise PermissionError(f"{private} is not this user's own: the compiled loops are not kept there")
    return private


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler and CPU: from the cache, or compiled into it
    (written under a temporary name and renamed, so that processes building at once never load a
    partial file)."""
    global _compiler
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    _compiler = version.splitlines()[0] if version else compiler
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu()]).encode())
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"guided-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=cache) as work:
        objects = []
        for real, suffix, double in (("float", "f", 0), ("double", "d", 1)):
            obj = Path(work) / f"{suffix}.o"
            types = [f"-DREAL={real}", f"-DSFX={suffix}", f"-DREAL_IS_DOUBLE={double}"]
            cmd = [compiler, *FLAGS, "-c", *types, str(SOURCE)]
            subprocess.run([*cmd, "-o", str(obj)], capture_output=True, text=True, check=True, timeout=120)
            objects.append(str(obj))
        partial = Path(work) / "guided.so"
        subprocess.run(
            [compiler, "-shared", "-fopenmp", *objects, "-o", str(partial)], capture_output=True, check=True
        )
        os.replace(partial, target)
    log.info("compiled %s with %s %s into %s", SOURCE.name, compiler, " ".join(FLAGS), target)
    return target


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; ``None`` where they cannot be (the reason logged once)."""
    global _library, _failed
    with _lock:
        if _library is not None or _failed is not None:
            return _library
        compiler = shutil.which(os.environ.get("CC", "cc"))
        try:
            if compiler is None:
                raise FileNotFoundError(f"no C compiler ({os.environ.get('CC', 'cc')}) on the PATH")
            path = _build(compiler)
            before = openmp_runtimes(_maps_text())
            lib = ctypes.CDLL(str(path))
            added = openmp_runtimes(_maps_text()) - before
            if before and added:
                raise OSError(f"it brought an OpenMP runtime of its own beside torch's: {sorted(added)}")
            _library = lib
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", None) or exc
            _failed = str(detail).strip()
            log.warning("the guided kernel's C loops are not available, torch's are used: %s", _failed)
        return _library


def _maps_text() -> str:
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:
        return ""


def openmp_runtimes(maps: str) -> set[str]:
    """The OpenMP runtimes' files among a process's mapped files (``/proc/self/maps``' text). The
    library must run on torch's (the loader reuses the ``libgomp.so.1`` torch loaded): one that its
    loading brings would keep threads of a second pool, which compete with torch's spinning workers
    for the cores and lost to torch's loops by 2.4× (docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "the
    offset loops compiled"). Others already in the process (scikit-learn bundles a ``libgomp`` of its own,
    under another name) are not the library's."""
    found = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
        if len(fields) == 6 and Path(fields[5]).name.startswith(("libgomp", "libiomp5", "libomp")):
            found.add(fields[5])
    return found


def summary() -> str:
    """One line on the compiled kernels: the library and the compiler that built it, or why not."""
    lib = library()
    if lib is None:
        return f"not built: {_failed}"
    return f"{Path(lib._name).name}, by {_compiler}"


def build_error() -> str | None:
    """Why the compiled kernels are not available (``None`` when they are or have not been tried)."""
    return _failed


def enabled(*tensors: torch.Tensor) -> bool:
    """Whether the guided kernel's loops for ``tensors`` run natively: on the CPU, all in float32 or
    all in float64, with nothing to differentiate, by ``choice`` and where the library builds."""
    if any(t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64) for t in tensors):
        return False
    if len({t.dtype for t in tensors}) > 1:  # one type throughout: torch's loops promote, C does not
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if choice.pinned() not in (None, "native"):
        return False
    return library() is not None


def _ints(values: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int * len(values))(*values)


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def _rows(fn, height: int, args: tuple) -> None:
    """``fn(*args, threads)``: its images' rows in bands, one per thread of torch's OpenMP pool;
    ``MemoryError`` where a thread could not allocate its row buffers."""
    if fn(*args, max(1, min(torch.get_num_threads(), height // MIN_ROWS_PER_THREAD))):
        raise MemoryError("kdeq.runtime.native: a thread's row buffers could not be allocated")


def _fn(name: str, dtype: torch.dtype):
    """The kernel ``name`` for ``dtype``; it returns its status as a C ``int``, ctypes' default."""
    lib = library()
    assert lib is not None
    return getattr(lib, f"{name}_{'f' if dtype == torch.float32 else 'd'}")


def _real(dtype: torch.dtype, value: float) -> ctypes._SimpleCData:
    return (ctypes.c_float if dtype == torch.float32 else ctypes.c_double)(value)


def _contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.contiguous() for t in tensors]


def _writable(*tensors: torch.Tensor | None) -> None:
    """The outputs are written in place through their pointers: each must be contiguous."""
    if any(t is not None and not t.is_contiguous() for t in tensors):
        raise ValueError("kdeq.runtime.native writes only contiguous outputs")


def _maps(
    weights: torch.Tensor,
    index: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    scale: Sequence[float],
    power: int,
) -> tuple[tuple, torch.Tensor]:
    """The arguments both pair loops open with (the maps, the chosen ones' indices, offsets and scales,
    the power), and the tensor of scales they point into, to be held until the call returns."""
    taps = torch.tensor(list(scale), dtype=weights.dtype)
    a, b = _ints([o[0] for o in offsets]), _ints([o[1] for o in offsets])
    return (_ptr(weights), weights.shape[1], _ints(index), a, b, _ptr(taps), len(index), power), taps


def pairs(
    weights: torch.Tensor,
    index: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    scale: Sequence[float],
    power: int,
    x: torch.Tensor,
    out: torch.Tensor,
    best: torch.Tensor | None = None,
) -> None:
    """``out += Σ_j u_j ⊙ S_{o_j} x + Σ_{o_j ≠ 0} S_{−o_j}(u_j ⊙ x)`` in place, ``u_j = (scale_j ·
    weights[:, index_j])^power``, ``S_o x (y) = x(y + o)`` (0 outside the image); with ``best``
    ``(B, 1, H, W)``, ``best ← max(best, u_j, S_{−o_j} u_j)`` over ``j``. ``weights`` ``(B, O, H, W)``;
    ``x``, ``out`` ``(B, C, H, W)`` contiguous, the same dtype."""
    weights, x = _contiguous(weights, x)
    _writable(out, best)
    bsz, channels, height, width = x.shape
    maps, _held = _maps(weights, index, offsets, scale, power)
    args = (*maps, _ptr(x), channels, _ptr(out), _ptr(best), bsz, height, width)
    _rows(_fn("kdeq_pairs", x.dtype), height, args)


def patch_pairs(
    weights: torch.Tensor,
    index: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    scale: Sequence[float],
    power: int,
    t: torch.Tensor,
    patch_radius: int,
    x: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out += Σ_j S_j ⊙ S_{o_j} x + S_{−o_j}(S_j ⊙ x)`` in place with the box sums over patch centres
    ``S_j(q) = Σ_{|d|≤p} s_j(q + d)``, ``s_j(z) = (scale_j · weights[:, index_j](z))^power · t(z)
    t(z + o_j)`` (0 unless ``z`` and ``z + o_j`` are in the image): the patch-aggregated non-local
    pass (``GuidedOperator.nonlocal_mean``). ``t`` ``(B, 1, H, W)``; others as in ``pairs``."""
    weights, t, x = _contiguous(weights, t, x)
    _writable(out)
    bsz, channels, height, width = x.shape
    maps, _held = _maps(weights, index, offsets, scale, power)
    args = (*maps, _ptr(t), patch_radius, _ptr(x), channels, _ptr(out), bsz, height, width)
    _rows(_fn("kdeq_patch", x.dtype), height, args)


def weights(
    padded: torch.Tensor,
    offsets: Sequence[tuple[int, int]],
    taps: torch.Tensor,
    inv: torch.Tensor,
    cutoff: float,
    out: torch.Tensor,
) -> None:
    """The guided kernel's weight maps in place: ``out[:, j](x) = k_j·e^{max(inv·D_j(x), cutoff)}``, 0
    where the exponential is at most ``e^cutoff`` or ``x + o_j`` is outside the image, with the patch
    distance ``D_j(x) = ‖g(x) − g(x + o_j)‖²`` of ``padded`` ``(B, c, H + 2p, W + 2p)`` (the guide
    mirrored by ``p``) as a box sum of per-pixel squared differences; ``taps`` ``k`` ``(n,)``, ``inv``
    ``(B,)``, ``out`` ``(B, n, H, W)`` contiguous. The exponential is ``native.c``'s own, within a
    unit or two in the last place of the type's."""
    (padded,) = _contiguous(padded)
    _writable(out)
    bsz, channels = padded.shape[:2]
    height, width = out.shape[-2:]
    taps, inv = (t.to(padded.dtype).contiguous() for t in (taps, inv))
    args = (
        _ptr(padded),
        channels,
        bsz,
        height,
        width,
        (padded.shape[-1] - width) // 2,
        _ints([a for a, _ in offsets]),
        _ints([b for _, b in offsets]),
        _ptr(taps),
        len(offsets),
        _ptr(inv),
        _real(padded.dtype, cutoff),
        _real(padded.dtype, math.exp(cutoff)),
        _ptr(out),
    )
    _rows(_fn("kdeq_distances", padded.dtype), height, args)


def select(
    weights: torch.Tensor,
    offsets: Sequence[tuple[int, int]],
    self_first: bool,
    refs: torch.Tensor,
    height: int,
    width: int,
    scores: torch.Tensor,
    members: torch.Tensor,
) -> None:
    """Block matching's running selection in place (``kdeq.maths.collab.matches``): each reference ``r`` of
    ``refs`` ``(G,)`` (flat pixels of an ``height × width`` image) keeps its ``K`` best candidates,
    ``scores`` ``(G, K)`` highest first and ``members`` ``(G, K)`` (int64) their pixels; the offsets'
    candidates, forward ``r + o_j`` (score ``weights[j](r)``) then backward ``r − o_j`` (score
    ``weights[j](r − o_j)``), those outside the image left out, enter after every entry of at least
    their score (a stable sort, highest first); with ``self_first`` the reference's own (``o_0 = 0``)
    scores 2. ``weights`` ``(n, H·W)``."""
    weights, refs = _contiguous(weights, refs)
    _writable(scores, members)
    assert members.dtype == refs.dtype == torch.int64 and scores.dtype == weights.dtype
    count = refs.numel()
    threads = max(1, min(torch.get_num_threads(), count // MIN_REFS_PER_THREAD))
    args = (
        _ptr(weights),
        len(offsets),
        _ints([a for a, _ in offsets]),
        _ints([b for _, b in offsets]),
        height,
        width,
        _ptr(refs),
        ctypes.c_int64(count),
        _ptr(scores),
        _ptr(members),
        scores.shape[1],
        int(self_first),
        threads,
    )
    _fn("kdeq_select", weights.dtype)(*args)
