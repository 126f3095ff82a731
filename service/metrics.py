"""The service's Prometheus metrics (DESIGN §4): names, labels and buckets in one place.

Each ``Metrics`` owns its registry, so an application (or a test) sees only
its own series. Labels are bounded: ``endpoint`` is one of the routes,
``model`` one of the configured models, ``status`` an HTTP status, ``reason``
one of ``REJECTION_REASONS``. A request carries one ``endpoint`` in every
family, the route it was sent to: a ``/denoise`` request with ``noise=poisson``
is ``/denoise`` in the HTTP metrics and the solver's alike, and its ``model``
(a Poisson model) says which task answered it.

The solver's statistics mean what the response headers say (``docs/api.md``,
"Solver statistics"): ``kdeq_solver_iterations`` observes ``X-KDEQ-Iterations``,
``kdeq_solver_relative_residual`` ``X-KDEQ-Residual``, and
``kdeq_solver_nonconverged`` counts ``X-KDEQ-Converged: false``.
"""

from __future__ import annotations

import logging
import math
import platform
from collections.abc import Iterable, Iterator

import torch
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kdeq.registry import TASKS
from service import __version__

log = logging.getLogger("kdeq.service")

# the statuses the inference routes answer with; their series start at 0 so that rate() sees the
# first error (a counter series born at 3 has no increase until its next change)
INFERENCE_ROUTES = frozenset(task.route for task in TASKS.values())
INFERENCE_STATUSES = ("200", "400", "401", "404", "413", "415", "422", "500", "503", "504")
REJECTION_REASONS = (
    "queue_full",
    "draining",
    "not_ready",
    "timeout",
    "body_too_large",
    "too_many_pixels",
    "out_of_memory",
    "device_failed",
)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RESIDUAL_BUCKETS = tuple(10.0**e for e in range(-10, 1))
# a residual that is not finite is recorded as this value (it lands above every finite bucket)
RESIDUAL_NONFINITE = 1e3
ITERATION_LADDER = (1, 2, 3, 5, 8, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)
SIZE_BUCKETS = tuple(2.0**e for e in range(10, 31, 2))
# fixed, not derived from the settings, so replicas configured differently aggregate
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)

# the `_created` series double the exposition and no dashboard or alert here reads them
disable_created_metrics()


def task_routes(task: str) -> tuple[str, ...]:
    """The routes a request for ``task`` may be sent to: its own, and its host's where it is a
    variant (``/denoise`` with ``noise=poisson`` for ``denoise-poisson``)."""
    variant = TASKS[task].variant
    return (TASKS[task].route,) if variant is None else (TASKS[task].route, TASKS[variant.host].route)


def iteration_buckets(caps: Iterable[int]) -> tuple[float, ...]:
    """The iteration ladder with a bucket edge at every model's cap, so ``le=cap`` counts the
    solves that stopped at the cap separately from those that converged just before it."""
    edges = set(ITERATION_LADDER)
    for cap in caps:
        edges.update((cap - 1, cap) if cap > 1 else (cap,))
    return tuple(sorted(edges))


class CudaMemoryCollector(Collector):
    """Per device, read at scrape: this process's caching allocator (allocated, reserved bytes) and
    the device as a whole (free and total bytes, whoever holds the rest).

    A device is read only once its worker has selected it (``activate``): reading one before would
    initialise CUDA, or create that device's context, on the event loop that serves the scrape."""

    def __init__(self, devices: list[str]) -> None:
        self.devices = [torch.device(d) for d in devices if d.startswith("cuda")]
        self._active: set[torch.device] = set()

    def activate(self, device: str) -> None:
        """Start reading ``device`` (called by its worker thread once CUDA is initialised on it)."""
        self._active.add(torch.device(device))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "allocated": GaugeMetricFamily(
                "kdeq_cuda_memory_allocated_bytes", "bytes held by tensors", labels=["device"]
            ),
            "reserved": GaugeMetricFamily(
                "kdeq_cuda_memory_reserved_bytes",
                "bytes reserved by the caching allocator",
                labels=["device"],
            ),
            "free": GaugeMetricFamily(
                "kdeq_cuda_memory_free_bytes", "device memory free (all processes)", labels=["device"]
            ),
            "total": GaugeMetricFamily("kdeq_cuda_memory_total_bytes", "device memory", labels=["device"]),
        }
        for dev in self.devices:
            if dev not in self._active:
                continue
            label = [str(dev)]
            free, total = torch.cuda.mem_get_info(dev)
            families["allocated"].add_metric(label, torch.cuda.memory_allocated(dev))
            families["reserved"].add_metric(label, torch.cuda.memory_reserved(dev))
            families["free"].add_metric(label, free)
            families["total"].add_metric(label, total)
        yield from families.values()


class GuardedCollector(Collector):
    """``inner``'s metric families, or none at a scrape where it raises, so that a collector's error
    never fails ``/metrics``. Every error counts in ``errors{collector=name}``; the first is logged
    with its traceback, later ones are not (a broken collector would log at every scrape)."""

    def __init__(self, inner: Collector, name: str, errors: Counter) -> None:
        self.inner = inner
        self.name = name
        self.errors = errors
        self._logged = False
        errors.labels(name)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            families = list(self.inner.collect())
        except Exception:
            self.errors.labels(self.name).inc()
            if not self._logged:
                self._logged = True
                log.exception("metrics collector %s failed; its series are left out of scrapes", self.name)
            families = []
        yield from families


class Metrics:
    """Every metric the service exports; ``render()`` is the ``/metrics`` body."""

    def __init__(self, iteration_caps: Iterable[int], devices: list[str]) -> None:
        r = self.registry = CollectorRegistry()
        self.solver_iterations = Histogram(
            "kdeq_solver_iterations",
            "solver steps per image after its start, as X-KDEQ-Iterations (0: the start met the "
            "tolerance, or an exact solve; chained solves summed, an image in tiles its slowest tile's)",
            ["endpoint", "model"],
            buckets=iteration_buckets(iteration_caps),
            registry=r,
        )
        self.solver_residual = Histogram(
            "kdeq_solver_relative_residual",
            "relative residual ‖f(z)−z‖/‖f(z)‖ of the returned iterate per image, as X-KDEQ-Residual "
            f"(the worst of chained solves and tiles; non-finite recorded as {RESIDUAL_NONFINITE:g})",
            ["endpoint", "model"],
            buckets=RESIDUAL_BUCKETS,
            registry=r,
        )
        self.solver_nonconverged = Counter(
            "kdeq_solver_nonconverged",
            "images whose solve stopped above its tolerance, X-KDEQ-Converged: false (the best iterate "
            "was returned), and solves with a non-finite output (answered 422 non_finite)",
            ["endpoint", "model"],
            registry=r,
        )
        self.http_requests = Counter(
            "kdeq_http_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.http_duration = Histogram(
            "kdeq_http_request_duration_seconds",
            "time from request arrival to the end of the response",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "kdeq_queue_wait_seconds",
            "time a request waited for a worker",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inference_duration = Histogram(
            "kdeq_inference_duration_seconds",
            "time to solve one batch on the device",
            ["endpoint", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "kdeq_batch_size",
            "requests solved together in one batch",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("kdeq_queue_depth", "requests waiting for a worker", registry=r)
        self.batch_limit = Gauge(
            "kdeq_batch_size_limit",
            "current batch size limit (halved after out-of-memory, regrown)",
            registry=r,
        )
        self.in_flight = Gauge(
            "kdeq_requests_in_flight",
            "inference requests being decoded, queued, solved or encoded",
            registry=r,
        )
        self.rejected = Counter(
            "kdeq_rejected_requests", "requests refused for capacity or limits", ["reason"], registry=r
        )
        self.upload_size = Histogram(
            "kdeq_upload_size_bytes", "request body size", ["endpoint"], buckets=SIZE_BUCKETS, registry=r
        )
        self.model_ready = Gauge(
            "kdeq_model_ready", "1 when the model is loaded and warm", ["model"], registry=r
        )
        self.model_loads = Counter(
            "kdeq_model_loads", "run-time loads that swapped a version in", ["model"], registry=r
        )
        self.model_load_failures = Counter(
            "kdeq_model_load_failures",
            "run-time loads that failed (the version serving was kept)",
            ["model"],
            registry=r,
        )
        self.model_version = Gauge(
            "kdeq_model_serving_version",
            "the version of the model serving requests (0: none)",
            ["model"],
            registry=r,
        )
        self.build = Info("kdeq_build", "service version, torch version and devices", registry=r)
        self.build.info(
            {
                "version": __version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "devices": ",".join(devices),
            }
        )
        for reason in REJECTION_REASONS:
            self.rejected.labels(reason)
        for endpoint in sorted(INFERENCE_ROUTES):
            for status in INFERENCE_STATUSES:
                self.http_requests.labels(endpoint, status)
        # registered after the collectors it watches, so that a scrape shows its own errors
        self.collector_errors = Counter(
            "kdeq_metrics_collector_errors",
            "scrapes at which a collector failed (its series were left out)",
            ["collector"],
            registry=None,
        )
        # a zero series from the start, on every device kind: the alert's rate() sees the first error
        self.collector_errors.labels("cuda_memory")
        self.cuda_memory: CudaMemoryCollector | None = None
        if any(d.startswith("cuda") for d in devices):
            self.cuda_memory = CudaMemoryCollector(devices)
            r.register(GuardedCollector(self.cuda_memory, "cuda_memory", self.collector_errors))
        r.register(self.collector_errors)

    def start_solver_series(self, task: str, model: str) -> None:
        """Zero series of ``model``'s non-convergence on every route its task is asked on
        (``task_routes``), so that a ratio is defined before the first miss."""
        for route in task_routes(task):
            self.solver_nonconverged.labels(route, model)

    def observe_solve(
        self, endpoint: str, model: str, iterations: int, residual: float, converged: bool
    ) -> None:
        """Record one image's solver statistics, those its response carries (``endpoint``: the route
        the request was sent to)."""
        self.solver_iterations.labels(endpoint, model).observe(iterations)
        value = residual if math.isfinite(residual) else RESIDUAL_NONFINITE
        self.solver_residual.labels(endpoint, model).observe(value)
        if not converged:
            self.solver_nonconverged.labels(endpoint, model).inc()

    def device_ready(self, device: str) -> None:
        """``device``'s worker has selected it: its memory may be read at scrapes from now on."""
        if self.cuda_memory is not None and device.startswith("cuda"):
            self.cuda_memory.activate(device)

    def render(self) -> bytes:
        return generate_latest(self.registry)
