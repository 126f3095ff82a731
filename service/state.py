"""The service's lifecycle: starting → ready → draining, and the parts it owns.

``start()`` returns at once; a background thread loads every configured model
onto every device and starts the inference workers, each of which selects its
device and warms the models up on its own thread; then the service is ready,
so ``/healthz`` answers from the first moment while ``/readyz`` says 503 until
the models are usable.

A sticky device error (``service.devices.classify``) retires the device: the
engine refuses every request with 503 ``device_failed``, ``/readyz`` says so
with the device and the reason, and ``fault`` tells the server to exit
non-zero so that the orchestrator restarts the process.
"""

from __future__ import annotations

import logging
import threading
from typing import Literal

from kdeq.maths import graphs
from kdeq.registry import TASKS
from kdeq.runtime import backends, heap, native, netprecision, threads
from kdeq.serving.tiling import solve_requests
from kdeq.tasks.base import Solved
from service.devices import choose_devices, classify, release_memory, select_device
from service.engine import Engine, Job
from service.errors import ApiError, DeviceFailedError
from service.metrics import Metrics
from service.registry import ModelRegistry, ModelSlot
from service.settings import Settings

log = logging.getLogger("kdeq.service")

Phase = Literal["starting", "ready", "draining", "stopped"]
Readiness = Literal["ready", "starting", "draining", "stopped", "no_models", "workers_down", "device_failed"]

# the C heap keeps memory freed after a solve for reuse (kdeq.runtime.heap), so the resident size would stay
# at the largest request's peak and wander with fragmentation; after a batch this large it is handed back
TRIM_PIXELS = 1 << 20


class Service:
    """Settings, metrics, model registry and inference engine of one process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        heap.configure(settings.malloc)
        backends.pin(settings.conv_backend)
        netprecision.choice.pin(settings.network_precision)
        native.choice.pin(settings.guided_backend)
        native.pin_cache(settings.native_cache)
        graphs.pin(settings.cuda_graphs)
        threads.pin(settings.threads)
        choice = choose_devices(settings.device)
        log.log(choice.level, "serving on %s: %s", ",".join(choice.devices), choice.reason)
        self.devices = choice.devices
        self.registry = ModelRegistry(settings.models_dir, settings.models)
        self.metrics = Metrics(self.registry.iteration_caps(), self.devices)
        self.engine = Engine(
            self._solve,
            self.metrics,
            queue_size=settings.queue_size,
            max_batch_size=settings.batch_size(self.devices),
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
        self.registry.load(self.devices)
        self.engine.start(self.devices, self._prepare)
        self.registry.settle()
        for slot in self.registry.slots.values():
            self._publish(slot)
        with self._phase_lock:
            if self.phase == "starting":
                self.phase = "ready"
        ready = sum(s.ready for s in self.registry.slots.values())
        log.info("ready: %d of %d model(s) serving", ready, len(self.registry.slots))

    def _publish(self, slot: ModelSlot) -> None:
        """Export ``slot``'s readiness and, when ready, its version as its name's serving version."""
        self.metrics.model_ready.labels(slot.id).set(1 if slot.ready else 0)
        if slot.ready:
            self.metrics.model_version.labels(slot.name).set(int(slot.id.partition(":")[2]))
            # a zero series from the start, so a non-convergence ratio is defined before the first miss
            self.metrics.start_solver_series(slot.task, slot.id)

    def load_model(self, name: str, version: int | None) -> ModelSlot:
        """Load, warm and swap in ``name`` at ``version`` (``ModelRegistry.load_model``) on every
        device, with the warm-up sizes of startup; counted. Blocks: call it off the event loop."""
        self._controllable()
        sizes = self.settings.warmup_sizes_for(self.devices) if self.settings.warmup else ()
        try:
            slot, replaced = self.registry.load_model(name, version, self.devices, sizes)
        except DeviceFailedError as err:  # nothing runs on the device any more: as after a solve
            self.engine.retire(err.device, err)
            raise
        except ApiError as err:
            if err.error == "load_failed":
                self.metrics.model_load_failures.labels(name).inc()
            raise
        for old in replaced:
            if old.id != slot.id:
                self.metrics.model_ready.labels(old.id).set(0)
        self._publish(slot)
        self.metrics.model_loads.labels(name).inc()
        return slot

    def unload_model(self, name: str) -> list[ModelSlot]:
        """Stop serving ``name`` (``ModelRegistry.unload_model``); its metrics say so."""
        self._controllable()
        removed = self.registry.unload_model(name)
        for slot in removed:
            self.metrics.model_ready.labels(slot.id).set(0)
        self.metrics.model_version.labels(name).set(0)
        return removed

    def _controllable(self) -> None:
        """Raise the answer to a load or unload now: 403 when ``KDEQ_MODEL_CONTROL`` is off, 503 until
        startup has loaded the configured models (or while draining)."""
        if not self.settings.model_control:
            raise ApiError(
                403,
                "model_control_off",
                "loading and unloading models at run time is off; set KDEQ_MODEL_CONTROL=true",
            )
        if self.phase != "ready":
            raise ApiError(503, "not_ready", f"the service is {self.phase}", {"Retry-After": "5"})

    def _prepare(self, device: str) -> None:
        """Ready the calling worker thread for ``device``: select it (before any torch work, so that
        what the thread creates lives there), let the metrics read it, and warm every model up at
        each ``KDEQ_WARMUP_SIZES`` size, so that the thread's cuBLAS/cuDNN handles and the
        allocator's pools exist before the first request."""
        select_device(device)
        self.metrics.device_ready(device)
        if self.settings.warmup:
            self.registry.warm(device, self.settings.warmup_sizes_for(self.devices))

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

    @property
    def fault(self) -> str | None:
        """``device: reason`` once a device has failed (the process must exit), else ``None``."""
        return self.engine.failure

    def readiness(self) -> Readiness:
        """``ready``; ``starting``, ``draining``, ``stopped``, ``device_failed`` (``fault`` says which
        and why), ``no_models`` (none could be loaded) or ``workers_down``."""
        if self.fault is not None:
            return "device_failed"
        if self.phase == "ready" and not any(s.ready for s in self.registry.slots.values()):
            return "no_models"
        if self.phase == "ready" and not self.engine.alive:
            return "workers_down"
        return self.phase

    def _solve(self, device: str, jobs: list[Job]) -> list[Solved | ApiError]:
        slot: ModelSlot = jobs[0].target  # the version the request was admitted with
        refusal: ApiError | None = None
        try:

            def abandon(_: int) -> None:
                # a large image's tiles take minutes on a CPU: once no one awaits the result (past
                # its deadline), the worker stops between tiles rather than finish it for nobody
                if all(job.future.done() for job in jobs):
                    raise ApiError(504, "timeout", "no result within the request timeout")

            # an image's tiles are batched as far as requests are (a tile is about a small image)
            solved = solve_requests(
                TASKS[slot.task],
                slot.predictors[device],
                [job.payload for job in jobs],
                self.settings.tile_size,
                self.engine.batch_limit,
                self.settings.max_batch_pixels,
                abandon,
            )
        except ValueError as err:  # the model's own input checks: a request it cannot take
            refusal = ApiError(422, "invalid_input", f"{slot.id}: {err}")
        except Exception as err:
            refusal = _device_refusal(device, err)
            if refusal is None:  # not the device's doing: the engine retries the requests one by one
                raise
        # raised here, past the except clauses, so that nothing keeps the failed solve's exception —
        # whose frames hold the batch's tensors — while the memory is released and the engine retries
        if refusal is not None:
            if refusal.error == "out_of_memory":
                release_memory(device)
            raise refusal
        if sum(job.pixels for job in jobs) >= TRIM_PIXELS:
            heap.trim()
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


def _device_refusal(device: str, err: Exception) -> ApiError | None:
    """The answer to a solve on ``device`` that raised ``err``, when the device is the cause: 503
    ``out_of_memory``, or ``DeviceFailedError`` for a sticky device error; else ``None``."""
    kind = classify(err)
    if kind == "device":
        return DeviceFailedError(device, str(err))
    if kind == "out_of_memory":
        detail = f"not enough memory on {device} for this request"
        return ApiError(503, "out_of_memory", detail, {"Retry-After": "5"})
    return None
