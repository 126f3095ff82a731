"""The service's lifecycle: starting → ready → draining, and the parts it owns.

``start()`` returns at once; a background thread loads every configured model
onto every device, warms each up, starts the inference workers and then marks
the service ready, so ``/healthz`` answers from the first moment while
``/readyz`` says 503 until the models are usable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from typing import Literal

import torch

from service.engine import Engine, Job
from service.errors import ApiError
from service.metrics import Metrics
from service.registry import ModelRegistry
from service.settings import Settings
from service.tasks import Solved, solve_batch

log = logging.getLogger("kdeq.service")

Phase = Literal["starting", "ready", "draining", "stopped"]

# glibc keeps memory freed after a large solve for reuse, so the resident size stays at the largest
# request's peak and wanders with fragmentation; after a batch this large it is handed back
TRIM_PIXELS = 1 << 20
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)


def trim_heap() -> None:
    """Return freed heap memory to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


class Service:
    """Settings, metrics, model registry and inference engine of one process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.devices = settings.devices()
        self.registry = ModelRegistry(settings.models_dir, settings.models)
        self.metrics = Metrics(self.registry.iteration_caps(), self.devices)
        self.engine = Engine(
            self._solve,
            self.metrics,
            queue_size=settings.queue_size,
            max_batch_size=settings.batch_size(),
            max_batch_pixels=settings.max_batch_pixels,
            batch_wait_seconds=settings.batch_wait_seconds,
        )
        self.phase: Phase = "starting"
        self._phase_lock = threading.Lock()
        self._loader: threading.Thread | None = None
        for slot in self.registry.slots.values():
            self.metrics.model_ready.labels(slot.id).set(0)

    def start(self) -> None:
        """Begin loading in the background (see the module docstring)."""
        self._loader = threading.Thread(target=self._load, name="kdeq-loader", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        log.info("loading %d model(s) onto %s", len(self.registry.slots), ",".join(self.devices))
        self.registry.load(self.devices, self.settings.warmup)
        for slot in self.registry.slots.values():
            self.metrics.model_ready.labels(slot.id).set(1 if slot.ready else 0)
            if slot.ready:
                # a zero series from the start, so a non-convergence ratio is defined before the first miss
                self.metrics.solver_nonconverged.labels(f"/{slot.task}", slot.id)
        self.engine.start(self.devices)
        with self._phase_lock:
            if self.phase == "starting":
                self.phase = "ready"
        ready = sum(s.ready for s in self.registry.slots.values())
        log.info("ready: %d of %d model(s) serving", ready, len(self.registry.slots))

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the background load has finished; False on timeout."""
        if self._loader is not None:
            self._loader.join(timeout)
            return not self._loader.is_alive()
        return False

    def begin_drain(self) -> None:
        """Readiness turns 503; requests already admitted, and new ones during the drain, are served."""
        with self._phase_lock:
            changed = self.phase not in ("draining", "stopped")
            if changed:
                self.phase = "draining"
        if changed:
            log.info("draining: /readyz now answers 503")

    def stop(self) -> None:
        """Finish the queued requests and end the workers (a load still running is abandoned: its
        workers, if it starts them, find the engine stopping and end at once)."""
        self.begin_drain()
        self.engine.stop()
        with self._phase_lock:
            self.phase = "stopped"

    def readiness(self) -> str:
        """``ready``, ``starting``, ``draining``, ``stopped`` or ``no_models`` (none could be loaded)."""
        if self.phase == "ready" and not any(s.ready for s in self.registry.slots.values()):
            return "no_models"
        if self.phase == "ready" and not self.engine.alive:
            return "workers_down"
        return self.phase

    def _solve(self, device: str, jobs: list[Job]) -> list[Solved | ApiError]:
        slot = self.registry.slots[jobs[0].model]
        try:
            solved = solve_batch(slot.predictors[device], [job.payload for job in jobs])
            if sum(job.pixels for job in jobs) >= TRIM_PIXELS:
                trim_heap()
        except (torch.OutOfMemoryError, MemoryError):
            raise ApiError(
                503, "out_of_memory", f"not enough memory on {device} for this request", {"Retry-After": "5"}
            ) from None
        except ValueError as err:  # the model's own input checks: a request it cannot take
            raise ApiError(422, "invalid_input", f"{slot.id}: {err}") from None
        outcomes: list[Solved | ApiError] = []
        for job, result in zip(jobs, solved, strict=True):
            self.metrics.observe_solve(
                job.endpoint,
                job.model,
                result.iterations,
                result.residual,
                result.converged and result.finite,
            )
            if result.finite:
                outcomes.append(result)
            else:  # never NaNs in a PNG: a solve that left nothing finite is an error, not an image
                outcomes.append(
                    ApiError(
                        422,
                        "non_finite",
                        f"{slot.id} produced non-finite values for this image (after {result.iterations} "
                        f"iterations, residual {result.residual:.3g}); nothing finite to return",
                    )
                )
        return outcomes
