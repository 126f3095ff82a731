"""A solver's steps replayed as CUDA graphs: a chunk of ``k`` steps one launch, the batch's done flag
read by the host once per chunk. Off by default (``KDEQ_CUDA_GRAPHS=1`` or ``pin(True)`` turns it on)
until a GPU run has measured it.

On a GPU a small image's step is hundreds of short kernels, each launched by the host (the guided
kernel's ``K x`` alone a few hundred), so the device idles between them. Here a solver's step
(``kdeq.maths.solvers``: ``advance(state, step)``, device work only) is captured ``k`` times in a row into a
``torch.cuda.CUDAGraph`` over static buffers, once per key, and replayed: the solve's state is copied
into the key's buffers, the chunk replayed until the batch's ``active`` flags are all off or
``max_iter`` steps ran, and the state copied out. A converged sample stops counting at once, as in
the eager loop, so the iterations reported are the map evaluations each sample used; the rest of its
chunk repeats its frozen state, counted by no sample (the eager loop's look-ahead step, ``k − 1``
wider). The last step reported is the one after which the batch was done, as the CPU's loop reports
it (a counter in the graph: the steps after which some sample was still active), so a caller that
budgets steps (CG's restarts) sees the eager loop's.

Only launch-bound solves replay: a batch whose iterate ``(B, c, H, W)`` has at most
``kdeq.maths.adaptive.GATHER_PIXELS`` pixels ``B·H·W`` (``numel ≤ GATHER_PIXELS·c``); a larger one's time
is its bytes, not its launches, and its static copies would double its memory. Nor does a solve whose
state or map holds a tensor that requires grad while grad is on (training: the static copies carry no
autograd); under ``torch.no_grad`` or ``torch.inference_mode`` a map reading an ``nn.Parameter`` does.

The key: what the step reads. ``advance`` is a closure over the map ``f`` (itself a closure or module
over the request's tensors: the image, its mean, the guided kernel's weight maps), the config and the
method's constants. ``_walk`` reads that object graph into a structure (code objects, Python values,
each tensor's shape, strides, dtype and device; not its values) and the list of its tensors; with the
state's own structure, the device, inference mode and the chunk's step phases (``phase(step)``: what
of the step number a step's work depends on, Anderson's history length and slot) it is the key. So a
model's solves of one batch and size class share a key, and their graphs, whatever their pixels. The
graph reads private copies of those tensors (``_rebuild``: the closure rebuilt around them), into
which each solve copies its own before its first replay; the originals are never written. An object
whose structure is not read here (``__slots__``, a function's attributes, anything the walk or the
rebuild fails on) refuses its key.

A step that a graph cannot hold is caught in its warm-up, before any capture: a host read or a copy
from pageable host memory (the warm-up runs under ``torch.cuda.set_sync_debug_mode``), or a map that
changes its own state; its key is then run eagerly from then on (logged once). A capture that still
fails leaves torch's caching allocator in a state no later capture recovers from, so it turns replay
off for the rest of the process (logged as an error). Captures are one at a time in the process (as
torch requires), each device's on its own stream. ``KDEQ_CUDA_GRAPHS=0`` (the default) turns replay
off; only CUDA tensors are replayed. On the CPU ``replaying_on_cpu`` runs the same chunks eagerly over
the same copies, so that everything but the capture itself is tested without a device
(``tests/test_graphs.py``).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import threading
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel

from kdeq.maths.adaptive import GATHER_PIXELS

log = logging.getLogger(__name__)

#: environment variable: ``0`` (default, until measured on a GPU) runs every solve's steps eagerly, ``1``
#: replays them on CUDA
ENV = "KDEQ_CUDA_GRAPHS"
#: the values of ``ENV`` that turn replay off (those the service's boolean settings read as false)
OFF = ("0", "false", "no", "off")
#: steps per chunk: a converged batch runs at most ``CHUNK − 1`` steps no sample counts
CHUNK = 4
#: keys kept (least recently used dropped first), each with its static copies and graphs
CACHE_SIZE = 16
#: objects ``_walk`` reads in one key before it gives up (a map reaching far beyond its request)
MAX_NODES = 20_000

State = dict[str, torch.Tensor]
Advance = Callable[[State, int], State]

_ATOMS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    enum.Enum,
    torch.dtype,
    torch.device,
    types.CodeType,
)


class NotGraphableError(Exception):
    """A step that cannot be replayed from a graph (the reason is the message)."""


_local = threading.local()
_pinned: bool | None = None  # ``pin``'s


def pin(on: bool | None) -> None:
    """Replay on CUDA (``True``) or not (``False``) from now on in this process, over ``KDEQ_CUDA_GRAPHS``
    (the service's setting of that name); ``None`` drops the pin."""
    global _pinned
    _pinned = on


def replays() -> bool:
    """Whether CUDA solves replay their steps: ``pin``'s choice, else ``KDEQ_CUDA_GRAPHS`` (default off)."""
    if _pinned is not None:
        return _pinned
    return os.environ.get(ENV, "0").strip().lower() not in OFF


def mode(device: torch.device) -> Literal["graph", "eager"] | None:
    """How ``device``'s steps run in chunks: ``graph`` on CUDA where ``replays()``; ``eager``
    on the CPU inside ``replaying_on_cpu``; else ``None`` (the solver's own loop)."""
    if device.type == "cuda":
        return "graph" if replays() else None
    if device.type == "cpu" and getattr(_local, "on_cpu", False):
        return "eager"
    return None


@contextlib.contextmanager
def replaying_on_cpu() -> Iterator[None]:
    """Within it, this thread's CPU solves run their steps in chunks as a CUDA solve replays them, each
    chunk run eagerly over the key's static copies (the tests' view of the CUDA path)."""
    before = getattr(_local, "on_cpu", False)
    _local.on_cpu = True
    try:
        yield
    finally:
        _local.on_cpu = before


def _meta(t: torch.Tensor) -> tuple:
    return ("T", tuple(t.shape), t.stride(), t.dtype, t.device)


class _Walk:
    """The structure of an object graph and its tensors (module docstring); ``rebuilt`` holds the ids of
    the objects that reach a tensor, which ``_rebuild`` makes anew."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.seen: dict[int, int] = {}
        self.rebuilt: set[int] = set()
        self.done: set[int] = set()
        self.nodes = 0

    def __call__(self, obj: object) -> Hashable:
        return self.visit(obj)[0]

    def visit(self, obj: object) -> tuple[Hashable, bool]:
        """``obj``'s structure, and whether it reaches a tensor (or, conservatively, an object it is
        reached from: a cycle)."""
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise NotGraphableError(f"the step reaches more than {MAX_NODES} objects")
        if isinstance(obj, _ATOMS):
            return (obj if not isinstance(obj, float) or obj == obj else ("nan",)), False
        if isinstance(obj, (type, types.ModuleType, types.BuiltinFunctionType)):
            return ("const", obj), False
        if isinstance(obj, (set, frozenset)) and all(isinstance(v, _ATOMS) for v in obj):
            return (type(obj), frozenset(obj)), False  # a module's names of non-persistent buffers
        if id(obj) in self.seen:  # shared (or cyclic) structure is part of the structure
            done = id(obj) in self.done and not isinstance(obj, torch.Tensor)
            return ("ref", self.seen[id(obj)]), id(obj) in self.rebuilt or not done
        self.seen[id(obj)] = len(self.seen)
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad and torch.is_grad_enabled():  # the static copies carry no autograd
                raise NotGraphableError("a tensor the step reads requires grad")
            self.tensors.append(obj)
            return _meta(obj), True
        if isinstance(obj, (tuple, list)):
            sig, reach = self.each(obj)
            parts: tuple = (type(obj), sig)
        elif isinstance(obj, dict):
            if not all(isinstance(k, _ATOMS) for k in obj):
                raise NotGraphableError("a dict the step reads has keys that are not plain values")
            sig, reach = self.each(obj.values())
            parts = (type(obj), tuple(obj), sig)
        elif isinstance(obj, types.FunctionType):
            if vars(obj):  # attributes set on it, which the rebuilt function would not carry
                raise NotGraphableError(f"{obj.__qualname__} has attributes")
            cells = obj.__closure__ or ()
            try:
                contents = [c.cell_contents for c in cells]
            except ValueError:  # an empty cell: a name bound after the closure was made
                raise NotGraphableError(f"{obj.__qualname__} closes over an unbound name") from None
            sig, reach = self.each([obj.__defaults__, obj.__kwdefaults__, *contents])
            parts = ("fn", obj.__code__, sig)
        elif isinstance(obj, types.MethodType):
            sig, reach = self.each([obj.__func__, obj.__self__])
            parts = ("method", sig)
        elif isinstance(obj, functools.partial):
            sig, reach = self.each([obj.func, obj.args, obj.keywords])
            parts = ("partial", sig)
        elif hasattr(obj, "__dict__"):
            if _slots(type(obj)):  # values the walk does not read nor the rebuild copy
                raise NotGraphableError(f"the step reads a {type(obj).__name__}, which has __slots__")
            sig, reach = self.visit(vars(obj))
            parts = ("object", type(obj), sig)
        else:
            raise NotGraphableError(
                f"the step reads a {type(obj).__name__}, whose structure is not known here"
            )
        if reach:
            self.rebuilt.add(id(obj))
        self.done.add(id(obj))
        return parts, reach

    def each(self, values: Iterable[object]) -> tuple[tuple, bool]:
        visited = [self.visit(v) for v in values]
        return tuple(sig for sig, _ in visited), any(reach for _, reach in visited)


def _slots(cls: type) -> list[str]:
    """The names ``cls`` and its bases keep in ``__slots__`` rather than in ``__dict__`` (pydantic's
    bookkeeping aside: ``model_copy`` keeps it)."""
    names = []
    for c in cls.__mro__:
        if c is BaseModel:
            continue
        declared = vars(c).get("__slots__", ())
        names += [declared] if isinstance(declared, str) else list(declared)
    return [n for n in names if n not in ("__dict__", "__weakref__")]


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its broadcast dimensions (stride 0 kept at length 1): the memory it reads."""
    return t[
        tuple(
            slice(0, 1) if st == 0 and n > 1 else slice(None)
            for n, st in zip(t.shape, t.stride(), strict=True)
        )
    ]


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` (already ``_compact``) share memory."""
    span = 0
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1):
        if st <= span:
            return True
        span += st * (n - 1)
    return False


def _static_like(t: torch.Tensor) -> torch.Tensor:
    """A new tensor laid out as ``t`` (its strides, its broadcast dimensions broadcast again)."""
    base = _compact(t)
    if _overlaps(base):
        raise NotGraphableError("a tensor the step reads overlaps itself")
    static = torch.empty_strided(base.shape, base.stride(), dtype=t.dtype, device=t.device)
    return static.expand(t.shape)


def _rebuild(obj: object, walk: _Walk, tensors: dict[int, torch.Tensor], memo: dict[int, object]) -> object:
    """``obj`` with every tensor ``t`` replaced by ``tensors[id(t)]``: each function, method, partial,
    container and object that reaches one (``walk.rebuilt``) made anew around the replacements, the
    rest shared."""
    if isinstance(obj, torch.Tensor):
        return tensors[id(obj)]
    if id(obj) not in walk.rebuilt:
        return obj
    if id(obj) in memo:
        return memo[id(obj)]
    again = functools.partial(_rebuild, walk=walk, tensors=tensors, memo=memo)
    # a list, a dict, a function and an object are remembered before their contents are rebuilt: the
    # contents may refer back to them (a closure calling itself)
    if type(obj) is list:
        new = memo[id(obj)] = []
        new.extend(again(v) for v in obj)
    elif type(obj) is dict:
        new = memo[id(obj)] = {}
        new.update((k, again(v)) for k, v in obj.items())
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        new = type(obj)._make(again(v) for v in obj)
    elif isinstance(obj, (tuple, list)):
        new = type(obj)(again(v) for v in obj)
    elif isinstance(obj, dict):
        new = type(obj)((k, again(v)) for k, v in obj.items())
    elif isinstance(obj, types.FunctionType):
        cells = tuple(types.CellType() for _ in obj.__closure__ or ())
        new = memo[id(obj)] = types.FunctionType(
            obj.__code__, obj.__globals__, obj.__name__, None, cells or None
        )
        for cell, old in zip(cells, obj.__closure__ or (), strict=True):
            cell.cell_contents = again(old.cell_contents)
        new.__defaults__ = again(obj.__defaults__)
        new.__kwdefaults__ = again(obj.__kwdefaults__)
    elif isinstance(obj, types.MethodType):
        new = types.MethodType(again(obj.__func__), again(obj.__self__))
    elif isinstance(obj, functools.partial):
        new = functools.partial(again(obj.func), *again(obj.args), **again(obj.keywords))
    elif isinstance(obj, BaseModel):  # its private slots copied with it
        new = obj.model_copy(update=again(vars(obj)))
    else:
        new = object.__new__(type(obj))
        memo[id(obj)] = new  # before its attributes: they may refer back to it
        vars(new).update(again(vars(obj)))
    memo[id(obj)] = new
    return new


def _structure(advance: Advance, state: State) -> tuple[Hashable, _Walk]:
    """The structure of ``advance`` and ``state`` (module docstring), and the walk of ``advance`` (the
    tensors it reads, the objects that reach them). Raises ``NotGraphableError`` for a step the walk
    cannot read (whatever fails in it: a cycle too deep for Python's stack, say)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in state.values()):
        raise NotGraphableError("the solve's state requires grad")
    walk = _Walk()
    try:
        steps = walk(advance)
    except NotGraphableError:
        raise
    except Exception as err:
        raise NotGraphableError(f"the step's objects cannot be read: {err!r}") from err
    states = tuple((k, _meta(v)) for k, v in state.items())
    return (steps, states), walk


@dataclass
class _Entry:
    """One key's static copies: the step rebuilt around copies of the tensors it reads, the state's
    buffers, the count ``alive`` (``int64``, ``()``) of the steps after which some sample was still
    active, and per chunk of step phases its graph (``True`` once its warm-up ran where chunks run
    eagerly)."""

    advance: Advance
    leaves: list[torch.Tensor]
    state: State
    alive: torch.Tensor
    graphs: dict[tuple, torch.cuda.CUDAGraph | bool] = field(default_factory=dict)


_cache: OrderedDict[Hashable, _Entry] = OrderedDict()
_cache_lock = threading.Lock()
#: keys whose step cannot be replayed (the last ``CACHE_SIZE`` of them): run eagerly, logged once
_refused: OrderedDict[Hashable, None] = OrderedDict()
#: per device: the memory pool its graphs share, the stream its warm-ups and captures run on (torch's
#: default capture stream is made once, on the first device captured), and the lock that has its
#: graphs replay one solve at a time
_pools: dict[torch.device, tuple] = {}
_streams: dict[torch.device, torch.cuda.Stream] = {}
_device_locks: dict[torch.device, threading.Lock] = {}
#: torch captures one graph at a time per process
_capture_lock = threading.Lock()


def cached() -> int:
    """How many keys hold static copies now."""
    return len(_cache)


def clear() -> None:
    """Drop every key's copies and graphs, and the refusals."""
    with _cache_lock:
        _cache.clear()
        _refused.clear()


def small(state: State) -> bool:
    """Whether a solve of ``state`` is launch-bound, so replayed: its iterate ``best`` ``(B, c, H, W)``
    (or ``(B, n)``, ``c = 1``) holds at most ``GATHER_PIXELS`` pixels, ``numel ≤ GATHER_PIXELS·c``."""
    best = state["best"]
    channels = best.shape[1] if best.dim() == 4 else 1
    return best.numel() <= GATHER_PIXELS * channels


def _entry(key: Hashable, advance: Advance, walk: _Walk, state: State) -> _Entry:
    """The key's entry, made (and the least recently used one dropped past ``CACHE_SIZE``) where it
    has none. Raises ``NotGraphableError`` where the step cannot be rebuilt around copies."""
    with _cache_lock:
        entry = _cache.get(key)
        if entry is not None:
            _cache.move_to_end(key)
            return entry
        try:
            statics = {id(t): _static_like(t) for t in walk.tensors}
            rebuilt = _rebuild(advance, walk, statics, {})
        except NotGraphableError:
            raise
        except Exception as err:  # a type that cannot be made anew from its parts, say
            raise NotGraphableError(f"the step cannot be rebuilt around copies: {err!r}") from err
        device = state["active"].device
        entry = _Entry(
            rebuilt,
            [statics[id(t)] for t in walk.tensors],
            {name: _static_like(t) for name, t in state.items()},
            torch.zeros((), dtype=torch.int64, device=device),
        )
        _cache[key] = entry
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
        return entry


def _load(statics: Iterable[torch.Tensor], values: Iterable[torch.Tensor]) -> None:
    for static, value in zip(statics, values, strict=True):
        _compact(static).copy_(_compact(value))


def _chunk(entry: _Entry, steps: range) -> None:
    """``len(steps)`` steps over the entry's buffers, the state written back into them, each step after
    which some sample is active counted in ``entry.alive``."""
    s = dict(entry.state)
    for step in steps:
        s = entry.advance(s, step)
        entry.alive.add_(s["active"].any())
    for name, static in entry.state.items():
        if s[name] is not static:
            static.copy_(s[name])


def _versions(tensors: list[torch.Tensor]) -> list[int | None]:
    """Each tensor's count of in-place writes; ``None`` for an inference tensor, which keeps none (an
    in-place write to one goes unseen: only a rebinding is caught)."""
    return [None if t.is_inference() else t._version for t in tensors]


def _stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


@contextlib.contextmanager
def _host_reads() -> Iterator[list[str]]:
    """Within it, this thread's host synchronisations on CUDA (``.item()``, ``bool``, ``.tolist()``, a
    copy from pageable host memory) are listed, not raised: torch's ``warn`` sync-debug mode, whose
    warnings from other threads pass through untouched (its ``error`` mode would fail their work)."""
    me, seen = threading.get_ident(), []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if threading.get_ident() == me and "synchroniz" in str(message):
                seen.append(str(message))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def _warm_up(entry: _Entry, steps: range) -> None:
    """Run the chunk ``steps`` eagerly (on CUDA on the device's capture stream, as torch asks before a
    capture, its host reads listed): it advances the state as a replay would. Raises
    ``NotGraphableError`` where the chunk reads the host or changes the tensors or the structure its
    step reads (a map that keeps state); an error of the steps themselves is raised as eagerly."""
    versions = _versions(entry.leaves)
    before = _structure(entry.advance, entry.state)[0]
    device = entry.alive.device
    if device.type == "cuda":
        side = _stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), _host_reads() as reads:
            _chunk(entry, steps)
        torch.cuda.current_stream(device).wait_stream(side)
        if reads:
            raise NotGraphableError(f"the step synchronises with the host: {reads[0]}")
    else:
        _chunk(entry, steps)
    if _versions(entry.leaves) != versions or _structure(entry.advance, entry.state)[0] != before:
        raise NotGraphableError("the step changes the tensors or the objects it reads")


def _capture(entry: _Entry, steps: range) -> torch.cuda.CUDAGraph:
    """The chunk ``steps`` captured (not run), on the device's own stream."""
    device = entry.alive.device
    if device not in _pools:
        _pools[device] = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's work on its own stream goes on while this one captures; the pool
    # is shared by the device's graphs, which replay one at a time (the device's lock) and whose
    # results are copied into their entries' buffers
    with torch.cuda.graph(
        graph, pool=_pools[device], stream=_stream(device), capture_error_mode="thread_local"
    ):
        _chunk(entry, steps)
    return graph


def _first_run(entry: _Entry, steps: range, phases: tuple, run: str, key: Hashable) -> bool:
    """The chunk ``steps``'s first run: its warm-up, then (on CUDA) its capture, kept in
    ``entry.graphs[phases]``. Returns whether the key goes on replaying; where not, the state has still
    advanced by the chunk."""
    with _capture_lock:  # the warm-up's too: its sync-debug mode is the process's
        try:
            _warm_up(entry, steps)
        except NotGraphableError as err:
            _refuse(key, err)
            return False
        if run != "graph":
            entry.graphs[phases] = True
            return True
        try:
            entry.graphs[phases] = _capture(entry, steps)
        except Exception as err:  # the allocator's capture state is now broken (module docstring)
            log.error("a CUDA graph capture failed, solver steps run eagerly from now on: %r", err)
            pin(False)
            clear()
            return False
    return True


def iterate(
    advance: Advance, state: State, start: int, stop: int, phase: Callable[[int], Hashable]
) -> tuple[State, int, bool]:
    """Steps ``start … stop`` of ``advance`` from ``state`` in chunks of ``CHUNK`` (the last one
    shorter), until no sample of ``state["active"]`` ``(B,)`` is left. Returns the state after the last
    chunk run, the last step run as the solver's own loop counts it (the step after which the batch was
    done, else ``stop``) and whether the loop is finished (the batch done or step ``stop`` run); not
    finished, the caller runs the steps left itself (a key that is not replayed)."""
    device = state["active"].device
    run = mode(device)
    if not small(state):
        return state, start - 1, False
    try:
        structure, walk = _structure(advance, state)
    except NotGraphableError as err:
        _refuse(("structure", str(err)), err)
        return state, start - 1, False
    key = (structure, device, torch.is_inference_mode_enabled(), CHUNK)
    if key in _refused:
        return state, start - 1, False
    try:
        entry = _entry(key, advance, walk, state)
    except NotGraphableError as err:
        _refuse(key, err)
        return state, start - 1, False
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with _device_locks.setdefault(device, threading.Lock()), on_device:
        _load(entry.leaves, walk.tensors)
        _load(entry.state.values(), state.values())
        entry.alive.zero_()
        step, finished = start - 1, True
        while step < stop:
            steps = range(step + 1, min(step + CHUNK, stop) + 1)
            phases = tuple(phase(k) for k in steps)
            graph = entry.graphs.get(phases)
            replaying = True
            if graph is None:
                replaying = _first_run(entry, steps, phases, run, key)
            elif isinstance(graph, torch.cuda.CUDAGraph):
                graph.replay()
            else:
                _chunk(entry, steps)
            step = steps[-1]
            alive = int(entry.alive)  # the one host read of a chunk
            if alive < step - start + 1:  # the batch was done after step ``start + alive``
                step = start + alive
                break
            if not replaying:
                finished = False
                break
        # copied out: the buffers are the next solve's
        out = {name: t.clone() for name, t in entry.state.items()}
    return out, step, finished


def _refuse(key: Hashable, err: Exception) -> None:
    """Run ``key`` eagerly from now on, its copies dropped; logged the first time."""
    with _cache_lock:
        _cache.pop(key, None)
        if key in _refused:
            return
        _refused[key] = None
        while len(_refused) > CACHE_SIZE:
            _refused.popitem(last=False)
    log.warning("solver steps run eagerly, not from a CUDA graph: %s", err)
