"""The kdeq Grafana dashboard as code: ``python deploy/grafana/dashboard.py`` writes
``deploy/grafana/dashboards/kdeq.json`` and sets the inference routes in the recording rules'
endpoint matchers (tests check that the committed files are this script's output).

The inference routes are the registered tasks' (``kdeq.registry.TASKS``), so a new task's route is on
the dashboard and in the rules once this script has run.

Every panel queries the provisioned Prometheus datasource (uid ``kdeq-prometheus``); heavy queries
read the recording rules of ``deploy/prometheus/rules/kdeq-recording.yml``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kdeq.registry import TASKS

DATASOURCE = {"type": "prometheus", "uid": "kdeq-prometheus"}
GRAFANA_VERSION = "11.2.2"  # the image in docker-compose.yml
OUT = Path(__file__).resolve().parent / "dashboards" / "kdeq.json"
RATE = "$__rate_interval"
RULES = Path(__file__).resolve().parents[1] / "prometheus" / "rules" / "kdeq-recording.yml"
INFERENCE = "|".join(task.route for task in TASKS.values())
WIDTH, HEIGHT = 12, 8


def target(expr: str, legend: str, ref: str, fmt: str | None = None) -> dict:
    t = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}
    if fmt is not None:
        t["format"] = fmt
    return t


def panel(
    title: str,
    description: str,
    targets: list[tuple[str, str]],
    *,
    kind: str = "timeseries",
    unit: str = "short",
    log_axis: bool = False,
    fmt: str | None = None,
    width: int = WIDTH,
    options: dict | None = None,
) -> dict:
    custom: dict = {}
    if log_axis:
        custom["scaleDistribution"] = {"type": "log", "log": 10}
    return {
        "type": kind,
        "title": title,
        "description": description,
        # a panel without a version goes through Grafana's migration of old panels on load
        "pluginVersion": GRAFANA_VERSION,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": options or {},
        "targets": [target(e, leg, chr(ord("A") + i), fmt) for i, (e, leg) in enumerate(targets)],
        "_width": width,
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_width": 24}


def panels() -> list[dict]:
    return [
        row("Traffic"),
        panel(
            "Requests per second by endpoint and status",
            "Answered HTTP requests, 5-minute rate (recording rule kdeq:http_requests:rate5m).",
            [("sum by (endpoint, status) (kdeq:http_requests:rate5m)", "{{endpoint}} {{status}}")],
            unit="reqps",
        ),
        panel(
            "Error ratio",
            "Server errors (5xx, recording rule) and client errors (4xx) over answered inference requests.",
            [
                ("kdeq:http_errors:ratio5m", "5xx"),
                (
                    f'(sum(rate(kdeq_http_requests_total{{endpoint=~"{INFERENCE}", status=~"4.."}}[{RATE}]))'
                    " or vector(0))"
                    f' / sum(rate(kdeq_http_requests_total{{endpoint=~"{INFERENCE}"}}[{RATE}]))',
                    "4xx",
                ),
            ],
            unit="percentunit",
        ),
        panel(
            "Latency p50 / p90 / p99 (inference routes)",
            "Request duration from arrival to the end of the response, by endpoint.",
            [
                ("kdeq:http_request_duration_seconds:p50_5m", "p50 {{endpoint}}"),
                ("kdeq:http_request_duration_seconds:p90_5m", "p90 {{endpoint}}"),
                ("kdeq:http_request_duration_seconds:p99_5m", "p99 {{endpoint}}"),
            ],
            unit="s",
        ),
        panel(
            "Queue wait against inference time (p90)",
            "Time a request waited for a worker, and time to solve one batch.",
            [
                (
                    f"histogram_quantile(0.9, sum by (le) (rate(kdeq_queue_wait_seconds_bucket[{RATE}])))",
                    "queue wait p90",
                ),
                (
                    "histogram_quantile(0.9, sum by (le) "
                    f"(rate(kdeq_inference_duration_seconds_bucket[{RATE}])))",
                    "inference p90",
                ),
            ],
            unit="s",
        ),
        row("Capacity"),
        panel(
            "Batch size (mean)",
            "Requests solved together per batch, by model.",
            [
                (
                    f"sum by (model) (rate(kdeq_batch_size_sum[{RATE}]))"
                    f" / sum by (model) (rate(kdeq_batch_size_count[{RATE}]))",
                    "{{model}}",
                )
            ],
        ),
        panel(
            "Queue depth and requests in flight",
            "Requests waiting for a worker, and inference requests being decoded, queued, solved or encoded.",
            [("sum(kdeq_queue_depth)", "queued"), ("sum(kdeq_requests_in_flight)", "in flight")],
        ),
        panel(
            "Rejections by reason",
            "Requests refused for capacity or limits (queue_full, draining, not_ready, timeout, "
            "body_too_large, too_many_pixels), 5-minute rate.",
            [("kdeq:rejected_requests:rate5m", "{{reason}}")],
            unit="reqps",
        ),
        panel(
            "GPU memory",
            "This process's caching allocator (allocated, reserved) and the whole device (in use by any "
            "process, total).",
            [
                (
                    "sum by (instance, device) (kdeq_cuda_memory_allocated_bytes)",
                    "allocated {{instance}} {{device}}",
                ),
                (
                    "sum by (instance, device) (kdeq_cuda_memory_reserved_bytes)",
                    "reserved {{instance}} {{device}}",
                ),
                (
                    "sum by (instance, device) (kdeq_cuda_memory_total_bytes - kdeq_cuda_memory_free_bytes)",
                    "device in use {{instance}} {{device}}",
                ),
                ("sum by (instance, device) (kdeq_cuda_memory_total_bytes)", "total {{instance}} {{device}}"),
            ],
            unit="bytes",
        ),
        row("Solver"),
        panel(
            "Solver iterations (heatmap)",
            "Distribution of solver steps per image after its start (X-KDEQ-Iterations; 0: the start "
            "met the tolerance), all models; a band at a model's cap is solves that stopped there.",
            [(f"sum by (le) (rate(kdeq_solver_iterations_bucket[{RATE}]))", "{{le}}")],
            kind="heatmap",
            fmt="heatmap",
            # draw Prometheus's own buckets; Grafana must not re-bucket them
            options={"calculate": False, "yAxis": {"unit": "short"}, "cellGap": 1},
        ),
        panel(
            "Solver iterations p50 / p95 per model",
            "Solver steps per image after its start, as X-KDEQ-Iterations (recording rules).",
            [
                ("kdeq:solver_iterations:p50_5m", "p50 {{model}}"),
                ("kdeq:solver_iterations:p95_5m", "p95 {{model}}"),
            ],
        ),
        panel(
            "Relative residual p95 per model",
            "‖f(z)−z‖/‖f(z)‖ of the returned iterate, as X-KDEQ-Residual (the worst of chained solves "
            "and tiles), log axis.",
            [("kdeq:solver_relative_residual:p95_5m", "{{model}}")],
            unit="sci",
            log_axis=True,
        ),
        panel(
            "Non-convergence ratio",
            "Images answered X-KDEQ-Converged: false (a solve stopped above its tolerance; the best iterate "
            "was returned), over images solved.",
            [("kdeq:solver_nonconverged:ratio5m", "{{model}}")],
            unit="percentunit",
        ),
        panel(
            "Models ready",
            "1 when a model is loaded and warm on a replica; 0 when it failed (GET /models says why).",
            [("kdeq_model_ready", "{{instance}} {{model}}")],
            kind="stat",
            width=24,
        ),
    ]


def dashboard() -> dict:
    laid_out, x, y, ids = [], 0, 0, 1
    for p in panels():
        width = p.pop("_width")
        height = 1 if p["type"] == "row" else HEIGHT
        if x + width > 24:
            x, y = 0, y + HEIGHT
        p["id"] = ids
        p["gridPos"] = {"h": height, "w": width, "x": x, "y": y}
        ids += 1
        laid_out.append(p)
        x += width
        if x >= 24:
            x, y = 0, y + height
    return {
        "uid": "kdeq-overview",
        "title": "kdeq — serving and solver",
        "description": "kdeq HTTP service: traffic, latency, capacity and the fixed-point solver.",
        "tags": ["kdeq"],
        "editable": False,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "panels": laid_out,
        "templating": {"list": []},
        "annotations": {"list": []},
        "links": [],
    }


def recording_rules(text: str) -> str:
    """``text`` (the recording rules) with every ``endpoint=~"…"`` matcher set to the inference routes."""
    return re.sub(r'endpoint=~"[^"]*"', f'endpoint=~"{INFERENCE}"', text)


def main() -> None:
    OUT.write_text(json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")
    RULES.write_text(recording_rules(RULES.read_text()))
    print(f"wrote {RULES}")


if __name__ == "__main__":
    main()
