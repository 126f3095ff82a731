"""The models this process serves: which were configured, which loaded, and why others did not.

A model that fails to load or to warm up is kept in the registry with its
error (``GET /models``, ``kdeq_model_ready{model}=0``, a log line naming the
file and the reason); the others are served. Models load on the loader thread
(``load``) and warm up on each device's inference worker (``warm``), the
thread that serves them.

At run time (``load_model``, ``unload_model``) a model is loaded and warmed on
every device beside the version serving, then swapped in: ``slots`` is replaced
by a new mapping, never changed in place, so a reader sees the old or the new
one whole; a request holds the slot it was admitted with until it is answered.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kdeq.models.checkpoint import CheckpointError, ModelConfig, read_config
from kdeq.models.repository import NAME, VERSION, find_model, find_reference, list_models, load_predictor
from kdeq.predictors.base import Predictor
from kdeq.predictors.uncertainty import unsupported
from kdeq.registry import TASKS
from kdeq.tasks.base import solve_batch
from service.devices import classify, on_device
from service.errors import ApiError, DeviceFailedError

log = logging.getLogger("kdeq.service")


@dataclass(eq=False)  # compared and hashed by identity: a reloaded version is another slot
class ModelSlot:
    """One configured model (``NAME:VERSION``) and its predictors, one per device."""

    id: str
    path: Path | None
    config: ModelConfig | None
    error: str | None = None
    predictors: dict[str, Predictor] = field(default_factory=dict)
    ready: bool = False
    load_seconds: float | None = None

    @property
    def name(self) -> str:
        return self.id.partition(":")[0]

    @property
    def task(self) -> str | None:
        return self.config.task if self.config is not None else None

    @property
    def pads_exactly(self) -> bool:
        """Whether the model batches images of different sizes exactly (``kdeq.predictors.base``)."""
        return any(p.pads_exactly for p in self.predictors.values())

    @property
    def uncertainty_unsupported(self) -> str | None:
        """Why the model gives no posterior standard deviation (``kdeq.predictors.uncertainty.unsupported``),
        or ``None`` where it gives one."""
        found = next(iter(self.predictors.values()), None)
        return "it is not loaded" if found is None else unsupported(found)

    @property
    def tiles(self) -> bool:
        """Whether the model solves images larger than a tile a tile at a time (``kdeq.serving.tiling``)."""
        task = TASKS[self.task] if self.task is not None else None
        return task is not None and any(task.tile_halo(p) is not None for p in self.predictors.values())


class ModelRegistry:
    """Resolves the configured model list against the repository at ``root``."""

    def __init__(self, root: Path, names: tuple[str, ...]) -> None:
        self.root = root
        self.slots: dict[str, ModelSlot] = {}
        self._lock = threading.Lock()  # workers warming up on several devices may fail a model at once
        self._control = threading.Lock()  # one run-time load or unload at a time
        if not names:
            latest: dict[str, int] = {}
            for entry in list_models(root):
                latest[entry.name] = max(latest.get(entry.name, 0), entry.version)
            names = tuple(f"{n}:{v}" for n, v in latest.items())
        for spec in names:
            self._plan(spec)

    def _plan(self, spec: str) -> None:
        try:
            path = find_reference(self.root, spec)
        except (LookupError, ValueError) as err:
            slot = ModelSlot(spec, None, None, error=str(err))
        else:
            slot_id = f"{path.parent.name}:{path.name}"
            try:
                slot = ModelSlot(slot_id, path, read_config(path))
            except CheckpointError as err:
                slot = ModelSlot(slot_id, path, None, error=str(err))
        self.slots.setdefault(slot.id, slot)

    def iteration_caps(self) -> list[int]:
        return [s.config.solver.max_iter for s in self.slots.values() if s.config is not None]

    def load(self, devices: list[str]) -> None:
        """Load every planned model onto every device; failures are recorded."""
        for slot in self.slots.values():
            if slot.error is not None:
                log.error("model %s not loaded: %s", slot.id, slot.error)
                continue
            start = time.perf_counter()
            try:
                for device in devices:
                    slot.predictors[device] = load_predictor(slot.path, device)
            except Exception as err:  # a broken model must not stop the others from serving
                slot.predictors.clear()
                slot.error = str(err) if isinstance(err, CheckpointError) else f"{slot.path}: {err}"
                log.error("model %s not loaded: %s", slot.id, slot.error)
                continue
            slot.load_seconds = time.perf_counter() - start
            slot.ready = True
            log.info("model %s loaded on %s in %.2f s", slot.id, ",".join(devices), slot.load_seconds)

    def warm(self, device: str, sizes: tuple[int, ...]) -> None:
        """Solve one generated request per ready model and size on ``device``, on the calling thread
        (its worker). A model that fails is no longer ready, with the reason; a sticky device error
        raises ``DeviceFailedError``, since no model can run on the device any more."""
        for slot in self.slots.values():
            predictor = slot.predictors.get(device)
            if not slot.ready or predictor is None:
                continue
            try:
                _warm(predictor, device, sizes)
            except DeviceFailedError:
                raise
            except Exception as err:
                self._fail(slot, f"{slot.path}: {err}")

    def _fail(self, slot: ModelSlot, error: str) -> None:
        with self._lock:
            if slot.ready:
                slot.ready, slot.error = False, error
                log.error("model %s not loaded: %s", slot.id, error)

    def settle(self) -> None:
        """After warm-up: drop the predictors of the models that failed it (no worker uses them now)."""
        for slot in self.slots.values():
            if not slot.ready:
                slot.predictors.clear()

    def default(self, task: str) -> ModelSlot | None:
        """The first ready model of ``task`` in the configured order."""
        return next((s for s in self.slots.values() if s.ready and s.task == task), None)

    def resolve(self, task: str, requested: str | None) -> ModelSlot:
        """The ready model for ``task`` named ``requested`` (``NAME`` or ``NAME:VERSION``), or the
        first ready model of ``task`` in the configured order; ``ApiError`` 400/404 otherwise."""
        if requested is None:
            default = self.default(task)
            if default is None:
                raise ApiError(404, "no_model", f"no {task} model is loaded")
            return default
        candidates = [s for s in self.slots.values() if s.ready and s.task == task]
        name, _, ver = requested.partition(":")
        if not NAME.match(name) or (ver and not VERSION.match(ver)):
            raise ApiError(400, "invalid_model", f"`model` must be NAME or NAME:VERSION, got {requested!r}")
        matches = [
            (int(slot_ver), slot)
            for slot in candidates
            for slot_name, _, slot_ver in [slot.id.partition(":")]
            if slot_name == name and (not ver or int(ver) == int(slot_ver))
        ]
        if matches:
            return max(matches, key=lambda m: m[0])[1]
        loaded = ", ".join(s.id for s in candidates) or "none"
        raise ApiError(404, "no_model", f"no {task} model {requested!r} is loaded (loaded: {loaded})")

    def named(self, name: str) -> list[ModelSlot]:
        """The slots of model ``name`` (any version, ready or not), in the configured order."""
        return [slot for slot in self.slots.values() if slot.name == name]

    def versions(self, name: str) -> list[int]:
        """The versions of ``name`` in the repository, ascending."""
        return [entry.version for entry in list_models(self.root) if entry.name == name]

    def load_model(
        self, name: str, version: int | None, devices: list[str], sizes: tuple[int, ...]
    ) -> tuple[ModelSlot, list[ModelSlot]]:
        """Load ``name`` at ``version`` (default the highest in the repository) onto every device,
        warm it at each of ``sizes`` there, then make it the one version of ``name`` served, in the
        place of the versions serving (or last, for a model not served); the new slot and the slots
        it replaced. Raises ``ApiError`` 404 when the repository has no such version, 422
        ``load_failed`` (the file and the reason) when it does not load or warm up, and
        ``DeviceFailedError`` on a sticky device error; the versions serving are then untouched.
        Blocks the caller."""
        with self._control:
            try:
                path = find_model(self.root, name, version)
            except LookupError as err:
                raise ApiError(404, "no_model", str(err)) from None
            slot = ModelSlot(f"{name}:{path.name}", path, None)
            start = time.perf_counter()
            try:
                slot.config = read_config(path)
                for device in devices:
                    slot.predictors[device] = load_predictor(path, device)
                    _warm(slot.predictors[device], device, sizes)
            except Exception as err:
                if isinstance(err, DeviceFailedError):
                    raise
                reason = str(err) if isinstance(err, CheckpointError) else f"{path}: {err}"
                log.error(
                    "model %s not loaded at run time (still serving %s): %s", slot.id, self._ids(name), reason
                )
                raise ApiError(422, "load_failed", reason) from None
            slot.load_seconds = time.perf_counter() - start
            slot.ready = True
            replaced = self.named(name)
            swapped: dict[str, ModelSlot] = {}
            for key, old in self.slots.items():
                if old.name != name:
                    swapped[key] = old
                elif slot.id not in swapped:
                    swapped[slot.id] = slot
            swapped.setdefault(slot.id, slot)
            self.slots = swapped
            log.info(
                "model %s loaded on %s in %.2f s, serving in place of %s",
                slot.id,
                ",".join(devices),
                slot.load_seconds,
                ", ".join(s.id for s in replaced) or "nothing",
            )
            return slot, replaced

    def unload_model(self, name: str) -> list[ModelSlot]:
        """Stop serving every version of ``name``; the removed slots. ``ApiError`` 404 if none is
        configured. Requests already admitted finish on the slot they hold."""
        with self._control:
            removed = self.named(name)
            if not removed:
                raise ApiError(404, "no_model", f"no model {name!r} is loaded")
            self.slots = {key: slot for key, slot in self.slots.items() if slot.name != name}
            log.info("model(s) %s unloaded", ", ".join(s.id for s in removed))
            return removed

    def _ids(self, name: str) -> str:
        return ", ".join(s.id for s in self.named(name)) or "nothing"


def _warm(predictor: Predictor, device: str, sizes: tuple[int, ...]) -> None:
    """Solve one generated request at each of ``sizes`` with ``predictor`` on ``device``; a sticky
    device error raises ``DeviceFailedError``, another failure ``RuntimeError`` naming the size."""
    task = TASKS[predictor.task]
    with on_device(device):
        for size in sizes:
            try:
                solve_batch(task, predictor, [task.warmup(size)])
            except Exception as err:
                if classify(err) == "device":
                    raise DeviceFailedError(device, str(err)) from None
                raise RuntimeError(f"warm-up at {size}×{size} on {device} failed: {err}") from None
