"""The monitoring as code against the real thing: a real service process, a real Prometheus scraping it
with the repository's own config and rules, and every dashboard and recording-rule expression
evaluated through Prometheus's HTTP API. A dashboard cannot drift from the metrics."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import yaml

from service.metrics import CudaMemoryCollector
from tests.service_helpers import encode, free_port, missing_tool, noisy, run_server, smooth_image, to_uint8
from tests.test_deploy import PROM, dashboard, local_prometheus_config, panel_targets

# Grafana's own macros, given the values a query over this short test needs
MACROS = {"$__rate_interval": "1m"}
CUDA_PREFIX = "kdeq_cuda_"


def traffic(url: str) -> None:
    """A mix: successes on every route, a non-converged solve, client errors, and a full queue."""
    png = encode(to_uint8(noisy(smooth_image(64, 64), 25.0)))
    mask = encode((smooth_image(64, 64) > 0.6).astype("uint8") * 255)
    post = lambda path, files, **data: httpx.post(url + path, files=files, data=data, timeout=60)  # noqa: E731
    assert post("/denoise", {"image": png}).status_code == 200
    assert post("/denoise", {"image": png}, max_iter="1", tol="1e-9").headers["x-kdeq-converged"] == "false"
    assert post("/inpaint", {"image": png, "mask": mask}).status_code == 200
    assert post("/segment", {"image": png}).status_code == 200
    assert post("/denoise", {"image": b"not an image"}).status_code == 415
    assert post("/denoise", {"image": png}, sigma="900").status_code == 422
    assert post("/denoise", {"image": png}, model="nope").status_code == 404
    big = encode(to_uint8(noisy(smooth_image(384, 384), 25.0)))
    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda _: post("/denoise", {"image": big}).status_code, range(6)))
    assert 503 in codes and 200 in codes, codes


def query(prom: str, expr: str) -> list:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


@contextlib.contextmanager
def prometheus(tmp_path, targets: tuple[str, ...]):
    binary = shutil.which("prometheus")
    if binary is None:
        missing_tool("prometheus not installed (Debian package prometheus; .ci/run installs it)")
    port = free_port()
    config = local_prometheus_config(tmp_path, targets, interval="1s")
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        else:
            raise RuntimeError((tmp_path / "prometheus.log").read_text())
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def rule_count() -> int:
    return sum(
        len(g["rules"])
        for f in (PROM / "rules").glob("*.yml")
        for g in yaml.safe_load(f.read_text())["groups"]
    )


def deploy_expressions() -> dict[str, str]:
    """Every PromQL expression in deploy/: dashboard targets and every rule, by where it stands."""
    exprs = {
        f"panel {title!r} target {i}": expr for i, (title, expr) in enumerate(panel_targets(dashboard()))
    }
    for f in (PROM / "rules").glob("*.yml"):
        for group in yaml.safe_load(f.read_text())["groups"]:
            for rule in group["rules"]:
                exprs[f"{f.name}: {rule.get('record') or rule.get('alert')}"] = rule["expr"]
    for name, expr in exprs.items():
        for macro, value in MACROS.items():
            exprs[name] = expr.replace(macro, value)
    return exprs


def test_every_dashboard_and_rule_expression_returns_data(tmp_path) -> None:
    # two replicas, as `docker compose up --scale kdeq=2` gives, scraped by one Prometheus
    with (
        run_server(tmp_path, queue_size=1) as server,
        run_server(tmp_path) as replica,
        prometheus(tmp_path, tuple(s.url.split("//")[1] for s in (server, replica))) as prom,
    ):
        # scrapes before the traffic, so every rate() has a baseline
        deadline = time.monotonic() + 30
        while len(query(prom, 'up{job="kdeq"} == 1')) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        traffic(server.url)
        small = encode(to_uint8(smooth_image(32, 32)))
        assert httpx.post(replica.url + "/denoise", files={"image": small}, timeout=60).is_success
        time.sleep(6)  # several scrapes and rule evaluations after the traffic
        exposition = httpx.get(server.url + "/metrics").text
        exprs = deploy_expressions()
        rules = rule_count()
        assert len(exprs) == len(panel_targets(dashboard())) + rules
        empty, alerting = [], set()
        for where, expr in exprs.items():
            result = query(prom, expr)
            if ": Kdeq" in where:
                if result:
                    alerting.add(where.rsplit(": ", 1)[1])
            elif not result and CUDA_PREFIX not in expr and "cuda_memory" not in expr:
                empty.append(f"{where}: {expr}")
        assert not empty, "expressions without data:\n" + "\n".join(empty)
        # the traffic had a non-converged solve and 503s (full queue): exactly those alerts' conditions
        # hold, and they are pending (each waits minutes before firing); the others are quiet
        assert {"KdeqSolverNotConverging", "KdeqServerErrors"} <= alerting
        assert not alerting & {
            "KdeqDown",
            "KdeqNoReplicas",
            "KdeqModelNotReady",
            "KdeqLatencyP99High",
            "KdeqGpuMemoryNearFull",
        }, alerting

        # every metric name in deploy/ is exported (the CUDA ones only on CUDA: by the collector's names)
        text = "\n".join(exprs.values()) + json.dumps(dashboard())
        used = set(re.findall(r"\bkdeq_[a-z0-9_]+", text))
        cuda = {m.name for m in CudaMemoryCollector([]).collect()}
        exported = set(re.findall(r"^(kdeq_[a-z0-9_]+)", exposition, re.M))
        missing = {m for m in used if m not in exported and not (m.startswith(CUDA_PREFIX) and m in cuda)}
        assert not missing, missing
        assert {m for m in used if m.startswith(CUDA_PREFIX)} <= cuda

        # both replicas are scraped and the dashboard's aggregations span them
        assert len(query(prom, 'up{job="kdeq"} == 1')) == 2
        per_instance = query(prom, 'sum by (instance) (kdeq_http_requests_total{endpoint="/denoise"})')
        assert len(per_instance) == 2

        # the rules are loaded and healthy, and the tripped alerts are pending, not firing yet
        groups = httpx.get(prom + "/api/v1/rules").json()["data"]["groups"]
        files = sorted((PROM / "rules").glob("*.yml"))
        assert {g["name"] for g in groups} == {
            group["name"] for f in files for group in yaml.safe_load(f.read_text())["groups"]
        }
        assert all(r["health"] == "ok" for g in groups for r in g["rules"]), groups
        states = {
            a["labels"]["alertname"]: a["state"]
            for a in httpx.get(prom + "/api/v1/alerts").json()["data"]["alerts"]
        }
        assert states.get("KdeqSolverNotConverging") == "pending" and "firing" not in states.values(), states
