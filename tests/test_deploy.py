"""Deployment files checked for real: Prometheus config, rules and rule tests with promtool; the compose
files against the Compose Specification schema; the dashboard against Grafana's dashboard schema;
the Dockerfile's promises."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import subprocess
from pathlib import Path

import jsonschema
import yaml

from service.settings import Settings
from tests.service_helpers import missing_tool

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SCHEMAS = DEPLOY / "schemas"
PROM = DEPLOY / "prometheus"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        missing_tool("promtool not installed (Debian package prometheus; .ci/run installs it)")
    return path


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def local_prometheus_config(
    tmp_path: Path, targets: tuple[str, ...] = ("127.0.0.1:8000",), interval: str = "15s"
) -> Path:
    """The repository's ``prometheus.yml`` with the kdeq job's targets rewritten to ``targets`` on
    loopback (where Docker's DNS would list the replicas) and its rule files read from the repository."""
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = interval
    config["rule_files"] = [str(PROM / "rules" / "*.yml")]
    for job in config["scrape_configs"]:
        if job["job_name"] == "kdeq":
            del job["dns_sd_configs"]
            job["static_configs"] = [{"targets": list(targets)}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


# --- Prometheus ------------------------------------------------------------------------------


def test_prometheus_config_and_rules_pass_promtool(tmp_path) -> None:
    tool = promtool()
    done = run(tool, "check", "config", str(local_prometheus_config(tmp_path)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 rule files found" in done.stdout
    rules = sorted(str(p) for p in (PROM / "rules").glob("*.yml"))
    done = run(tool, "check", "rules", *rules)
    assert done.returncode == 0, done.stdout + done.stderr
    done = run(tool, "test", "rules", "kdeq-alerts.test.yml", cwd=PROM / "tests")
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    alerts = {
        r["alert"]
        for f in (PROM / "rules").glob("*.yml")
        for g in yaml.safe_load(f.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    required = {
        "KdeqDown",
        "KdeqNoReplicas",
        "KdeqServerErrors",
        "KdeqModelNotReady",
        "KdeqSolverNotConverging",
        "KdeqLatencyP99High",
        "KdeqQueueRejections",
        "KdeqGpuMemoryNearFull",
    }
    assert required <= alerts
    fires, quiet = set(), set()
    for test in yaml.safe_load((PROM / "tests" / "kdeq-alerts.test.yml").read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            (fires if case["exp_alerts"] else quiet).add(case["alertname"])
    assert fires == alerts and quiet == alerts


# --- compose ---------------------------------------------------------------------------------


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's ``!reset`` tag (the key is dropped from the merged file)."""


RESET = object()
ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def merge(base: dict, override: dict) -> dict:
    """Compose's merge for the mappings used here: keys merge recursively, ``!reset`` removes one."""
    out = dict(base)
    for key, value in override.items():
        if value is RESET:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def interpolate(value: str, shell: dict[str, str] | None = None) -> str:
    """Compose's ``${VAR:-default}`` and ``${VAR}`` against ``shell`` (empty: nothing set)."""
    shell = shell or {}

    def one(m: re.Match) -> str:
        name, _, default = m.group(1).partition(":-")
        return shell.get(name) or default

    return re.sub(r"\$\{([^}]+)\}", one, value)


def compose_settings(service: dict) -> Settings:
    """The service's ``KDEQ_*`` environment as the container gets it on a host that sets nothing
    (a null value passes a shell variable through, so it is absent here)."""
    env = {k: interpolate(str(v)) for k, v in service["environment"].items() if v is not None}
    return Settings.from_env(env)


def compose_validator() -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / "compose-spec.schema.json").read_text())
    return jsonschema.Draft7Validator(schema)


def test_compose_files_follow_the_compose_specification() -> None:
    validator = compose_validator()
    base = yaml.load((ROOT / "docker-compose.yml").read_text(), ComposeLoader)
    cpu = merge(base, yaml.load((ROOT / "docker-compose.cpu.yml").read_text(), ComposeLoader))
    for doc in (base, cpu):
        errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, errors
    # the schema is live: a misspelt key is caught
    broken = merge(base, {"services": {"kdeq": {"helthcheck": {}}}})
    assert any("helthcheck" in e.message for e in validator.iter_errors(broken))

    kdeq = base["services"]["kdeq"]
    # the container's settings are valid as shipped, on both files
    assert compose_settings(kdeq).device == ("auto",) and compose_settings(kdeq).api_key is None
    assert compose_settings(cpu["services"]["kdeq"]).devices() == ["cpu"]
    gpu = kdeq["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and gpu["driver"] == "nvidia"
    assert (
        "deploy" not in cpu["services"]["kdeq"]
        and cpu["services"]["kdeq"]["environment"]["KDEQ_DEVICE"] == "cpu"
    )
    seconds = lambda text: int(text.rstrip("s"))  # noqa: E731
    env = kdeq["environment"]
    # uvicorn's graceful limit is the request timeout + 5 s (service/server.py), after the drain
    drain = int(env["KDEQ_DRAIN_SECONDS"]) + int(env["KDEQ_REQUEST_TIMEOUT_SECONDS"]) + 5
    assert seconds(kdeq["stop_grace_period"]) > drain
    assert seconds(kdeq["healthcheck"]["start_period"]) >= 60
    assert "service.healthcheck" in kdeq["healthcheck"]["test"]
    prom, grafana = base["services"]["prometheus"], base["services"]["grafana"]
    assert all(v.endswith(":ro") for v in prom["volumes"] if v.startswith("./"))
    assert all(v.endswith(":ro") for v in grafana["volumes"] if v.startswith("./"))
    assert "/-/ready" in " ".join(prom["healthcheck"]["test"])
    assert "/api/health" in " ".join(grafana["healthcheck"]["test"])
    assert "GF_AUTH_ANONYMOUS_ENABLED" in grafana["environment"]
    # replicas publish distinct host ports (on loopback unless BIND_ADDRESS says otherwise) and
    # Prometheus finds them by the service's DNS name
    assert interpolate(kdeq["ports"][0]).split(":")[:2] == ["127.0.0.1", "8000-8009"]
    assert cpu["services"]["kdeq"]["image"] != kdeq["image"]  # the two builds never share a tag
    job = next(
        j
        for j in yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]
        if j["job_name"] == "kdeq"
    )
    assert job["dns_sd_configs"][0]["names"] == ["kdeq"]
    for mount in prom["volumes"] + grafana["volumes"]:
        if mount.startswith("./"):
            assert (ROOT / mount.split(":")[0]).exists(), mount


# --- Grafana ---------------------------------------------------------------------------------


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "kdeq.json").read_text())


def panel_targets(board: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def test_dashboard_follows_grafanas_schema_and_the_provisioned_datasource() -> None:
    schema = json.loads((SCHEMAS / "grafana-dashboard.schema.json").read_text())
    board = dashboard()
    errors = [f"{list(e.path)}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(board)]
    assert not errors, errors
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    uid = provisioned["datasources"][0]["uid"]
    refs = re.findall(r'"datasource":\s*(\{[^}]*\})', json.dumps(board))
    assert refs and all(json.loads(r) == {"type": "prometheus", "uid": uid} for r in refs)
    titles = " | ".join(p["title"] for p in board["panels"]).lower()
    for needed in (
        "requests per second",
        "error ratio",
        "latency",
        "queue wait",
        "batch size",
        "queue depth",
        "rejections",
        "heatmap",
        "p50 / p95",
        "residual",
        "non-convergence",
        "models ready",
        "gpu memory",
    ):
        assert needed in titles, needed
    heatmap = next(p for p in board["panels"] if p["type"] == "heatmap")
    assert heatmap["options"]["calculate"] is False and heatmap["targets"][0]["format"] == "heatmap"
    assert all(p.get("pluginVersion") for p in board["panels"] if p["type"] != "row")
    residual = next(p for p in board["panels"] if "residual" in p["title"].lower())
    assert residual["fieldConfig"]["defaults"]["custom"]["scaleDistribution"]["type"] == "log"
    dashboards = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "kdeq.yml").read_text())
    assert dashboards["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_committed_dashboard_is_the_generators_output() -> None:
    generator = runpy.run_path(str(DEPLOY / "grafana" / "dashboard.py"))
    expected = json.dumps(generator["dashboard"](), indent=2, ensure_ascii=False) + "\n"
    assert (DEPLOY / "grafana" / "dashboards" / "kdeq.json").read_text() == expected


# --- image -----------------------------------------------------------------------------------


def test_dockerfile_promises() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2  # multi-stage
    assert re.search(r"^ARG BASE_IMAGE=\S*cuda", text, re.M)  # CUDA-capable default, chosen by argument
    assert "-c constraints.txt" in text and "--no-index --find-links /wheels" in text
    assert 'if [ "${OFFLINE}" = 1 ]' in text  # the offline path is chosen, never implied by stray wheels
    # dependencies are installed before the source is copied, so a code change keeps that layer
    assert text.index("-r requirements.txt") < text.index("COPY kdeq/ kdeq/")
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1] not in ("root", "0")
    health = re.search(r"^HEALTHCHECK .*\n.*", text, re.M).group(0)
    assert "/readyz" in (ROOT / "service" / "healthcheck.py").read_text() and "curl" not in health
    assert "COPY --chown=kdeq:kdeq models/ /models/" in text and 'VOLUME ["/models"]' in text
    rules = [r for r in (ROOT / ".dockerignore").read_text().splitlines() if r and not r.startswith("#")]
    assert rules[0] == "*" and "!bench/" not in rules and "!tests/" not in rules  # an allow-list
