"""Deployment files checked for real: Prometheus config, rules and rule tests with promtool; the compose
files against the Compose Specification schema; the dashboard against Grafana's dashboard schema;
the Dockerfile's promises."""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import torch
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
    rules = sorted(str(p) for p in (PROM / "rules").glob("*.yml"))
    # the config's glob loads every rule file in the folder
    assert len(rules) >= 2 and f"{len(rules)} rule files found" in done.stdout
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
    """YAML with Compose's ``!reset`` tag (the key is dropped from the merged file) and ``!override``
    (the value replaces the base's instead of merging with it)."""


RESET = object()


class Override(dict):
    """A mapping tagged ``!override``."""


ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
ComposeLoader.add_constructor(
    "!override", lambda loader, node: Override(loader.construct_mapping(node, deep=True))
)


def plain(value: object) -> object:
    """``value`` without the ``Override`` marks, as the merged file Compose shows."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def merge(base: dict, override: dict) -> dict:
    """Compose's merge for the keys these files override: mappings merge recursively, sequences are
    appended (so a GPU reservation merged into the base's would reserve both), ``!reset`` removes a
    key and ``!override`` replaces it whole."""
    out = dict(base)
    for key, value in override.items():
        if value is RESET:
            out.pop(key, None)
        elif isinstance(value, Override):
            out[key] = plain(value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = out[key] + value
        else:
            out[key] = value
    return out


def load_compose(*names: str) -> dict:
    """The files merged as ``docker compose -f NAME -f NAME ...`` does, ``extends`` resolved: a
    service that extends ``{file, service}`` starts from that file's service as written there."""
    docs = [yaml.load((ROOT / name).read_text(), ComposeLoader) for name in names]
    merged = docs[0]
    for doc in docs[1:]:
        for service in doc["services"].values():
            if "extends" in service:
                ref = service.pop("extends")
                origin = yaml.load((ROOT / ref["file"]).read_text(), ComposeLoader)
                service.update(merge(origin["services"][ref["service"]], dict(service)))
        merged = merge(merged, doc)
    return plain(merged)


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
    base = load_compose("docker-compose.yml")
    cpu = load_compose("docker-compose.yml", "docker-compose.cpu.yml")
    for doc in (base, cpu, load_compose("docker-compose.yml", "docker-compose.multi-gpu.yml")):
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
    # replicas publish no host port (any number can run); Prometheus finds them by the service's DNS
    # name, and so does HAProxy (test_haproxy_config_promises)
    assert "ports" not in kdeq and kdeq["expose"] == ["8000"]
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


def kdeq_dns_names() -> set[str]:
    """The names Prometheus's kdeq job asks Docker's DNS for."""
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "kdeq")
    return {name for sd in job["dns_sd_configs"] for name in sd["names"]}


def dns_names(name: str, service: dict) -> set[str]:
    """What Docker's DNS answers with this service's containers: its name and its network aliases."""
    networks = service.get("networks") or {}
    if isinstance(networks, list):  # the short form has no aliases
        return {name}
    return {name} | {a for net in networks.values() for a in ((net or {}).get("aliases") or [])}


def test_multi_gpu_compose_runs_one_discoverable_replica_per_gpu(monkeypatch) -> None:
    base = load_compose("docker-compose.yml")["services"]["kdeq"]
    services = load_compose("docker-compose.yml", "docker-compose.multi-gpu.yml")["services"]
    replicas = {name: s for name, s in services.items() if s.get("image") == base["image"]}
    assert len(replicas) >= 2 and "kdeq" in replicas  # `docker compose cp ... kdeq:` still works
    # inside a replica's container its one GPU is the only CUDA device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpus = []
    for name, service in replicas.items():
        (request,) = service["deploy"]["resources"]["reservations"]["devices"]
        # one GPU named by its host index; `count` with it is refused by Docker, and `count` alone
        # is GPU 0 for every container
        assert request["driver"] == "nvidia" and request["capabilities"] == ["gpu"], name
        assert "count" not in request and len(request["device_ids"]) == 1, name
        gpus += request["device_ids"]
        # the setting is valid there and names that GPU, cuda:0, and no other
        env = service["environment"]
        assert env["KDEQ_DEVICE"] == "cuda", name
        devices = [torch.device(d) for d in compose_settings(service).devices()]
        assert [(d.type, d.index or 0) for d in devices] == [("cuda", 0)], name
        # Prometheus scrapes it and HAProxy sends it requests: its DNS names include every name the
        # kdeq job asks for and the one HAProxy's server-template resolves
        assert kdeq_dns_names() | {haproxy_target()[0]} <= dns_names(name, service), name
        assert "ports" not in service, name  # reached through HAProxy, as every replica
        # the rest is the base service (extends and the merge kept it)
        for key in ("build", "healthcheck", "volumes", "expose", "stop_grace_period", "restart"):
            assert service[key] == base[key], (name, key)
        assert {k: v for k, v in env.items() if k != "KDEQ_DEVICE"} == {
            k: v for k, v in base["environment"].items() if k != "KDEQ_DEVICE"
        }, name
    # distinct GPUs, numbered from 0 as nvidia-smi numbers them, none skipped
    assert sorted(gpus, key=int) == [str(i) for i in range(len(replicas))]


# --- HAProxy ---------------------------------------------------------------------------------

HAPROXY = DEPLOY / "haproxy" / "haproxy.cfg"


def haproxy_config() -> dict[str, list[list[str]]]:
    """``deploy/haproxy/haproxy.cfg`` as HAProxy reads it in the container (no ``LB_*`` variable set):
    section (``"backend kdeq"``, ...) to its lines' words, comments dropped, quotes removed and
    ``"${NAME-default}"`` expanded to its default."""
    expand = lambda m: m[2]  # noqa: E731
    sections: dict[str, list[list[str]]] = {}
    current: list[list[str]] = []
    for raw in HAPROXY.read_text().splitlines():
        line = raw.split(" #", 1)[0] if not raw.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        words = [re.sub(r"\$\{(\w+)-([^}]*)\}", expand, w.strip('"')) for w in shlex.split(line, posix=False)]
        if not raw[0].isspace():
            current = sections.setdefault(" ".join(words), [])
        else:
            current.append(words)
    return sections


def directive(section: list[list[str]], *prefix: str) -> list[str]:
    """The one line of ``section`` that starts with the words ``prefix``."""
    (line,) = [words for words in section if words[: len(prefix)] == list(prefix)]
    return line


def option_after(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def haproxy_seconds(value: str) -> float:
    """An HAProxy time (``500ms``, ``2s``, ``1m``; bare numbers are milliseconds) in seconds."""
    number, unit = re.fullmatch(r"(\d+)(us|ms|s|m|h|d)?", value).groups()
    return int(number) * {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1e-3}[unit]


def haproxy_target() -> tuple[str, int]:
    """The DNS name and port HAProxy's ``server-template`` fills its servers from."""
    line = directive(haproxy_config()["backend kdeq"], "server-template")
    host, port = line[3].rsplit(":", 1)
    return host, int(port)


def test_haproxy_config_passes_haproxys_own_check(tmp_path) -> None:
    binary = shutil.which("haproxy")
    if binary is None:
        missing_tool("haproxy not installed (Debian package haproxy; .ci/run installs it)")
    # as compose runs it (the LB_* variables unset: their defaults), and as tests/test_haproxy.py
    # runs it on loopback
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LB_")}
    done = subprocess.run(
        [binary, "-c", "-f", str(HAPROXY)], env=clean, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "Configuration file is valid" in done.stdout + done.stderr, done
    local = {"LB_BIND": "127.0.0.1:18000", "LB_STATS_BIND": "127.0.0.1:18404", "LB_CHECK_INTER": "200ms"}
    done = subprocess.run(
        [binary, "-c", "-f", str(HAPROXY)], env={**clean, **local}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done
    # the check is live: a misspelt keyword fails it
    broken = tmp_path / "broken.cfg"
    broken.write_text(HAPROXY.read_text().replace("balance leastconn", "balance lestconn"))
    done = subprocess.run(
        [binary, "-c", "-f", str(broken)], env=clean, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "balance only supports" in done.stdout + done.stderr


def test_haproxy_config_promises() -> None:
    config = haproxy_config()
    defaults, backend = config["defaults"], config["backend kdeq"]
    services = load_compose("docker-compose.yml")["services"]
    kdeq, lb = services["kdeq"], services["haproxy"]

    # the only published kdeq port is HAProxy's, on loopback unless BIND_ADDRESS says otherwise,
    # whatever files are combined (so `--scale` never races for host ports)
    for names in (
        ["docker-compose.yml"],
        ["docker-compose.yml", "docker-compose.cpu.yml"],
        ["docker-compose.yml", "docker-compose.multi-gpu.yml"],
    ):
        published = {
            name: [interpolate(p) for p in s.get("ports", [])]
            for name, s in load_compose(*names)["services"].items()
            if any(interpolate(p).endswith(":8000") for p in s.get("ports", []))
        }
        assert published == {"haproxy": ["127.0.0.1:8000:8000"]}, (names, published)
    # it listens where it is published, and finds replicas as Prometheus does, on the port they expose
    assert directive(config["frontend kdeq"], "bind")[1] == ":8000"
    host, port = haproxy_target()
    assert {host} == kdeq_dns_names() and [str(port)] == kdeq["expose"]
    assert directive(config["resolvers docker"], "nameserver")[2] == "127.0.0.11:53"  # Docker's DNS
    # the repository's file, read-only, where the image's entrypoint reads its config; a pinned image
    assert lb["volumes"] == ["./deploy/haproxy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro"]
    assert re.fullmatch(r"haproxy:\d+\.\d+\.\d+", lb["image"]), lb["image"]

    # replicas are checked on /readyz, the readiness the image's own health check uses
    assert directive(backend, "option", "httpchk") == ["option", "httpchk", "GET", "/readyz"]
    assert "/readyz" in (ROOT / "service" / "healthcheck.py").read_text()
    assert directive(backend, "http-check", "expect") == ["http-check", "expect", "status", "200"]
    server = directive(backend, "default-server")
    assert "check" in server and option_after(server, "resolvers") == "docker"
    # a stopping replica is out of the pool before its drain ends: the next check after SIGTERM, the
    # failures after it at the fast interval, and a second for a check's answer on a busy host
    detect = haproxy_seconds(option_after(server, "inter")) + (int(option_after(server, "fall")) - 1) * (
        haproxy_seconds(option_after(server, "fastinter"))
    )
    env = kdeq["environment"]
    assert detect + 1 <= float(env["KDEQ_DRAIN_SECONDS"]), detect
    # kdeq answers its own 504 (JSON, with the request ID) before HAProxy would time out
    timeout = float(env["KDEQ_REQUEST_TIMEOUT_SECONDS"])
    assert haproxy_seconds(directive(defaults, "timeout", "server")[2]) > timeout
    assert haproxy_seconds(directive(defaults, "timeout", "client")[2]) > timeout
    # only connection failures are retried (the request never reached a replica), each on another
    # replica; a replica's 503 and its Retry-After go to the client
    assert directive(defaults, "retry-on") == ["retry-on", "conn-failure"]
    assert directive(defaults, "option", "redispatch") == ["option", "redispatch", "1"]
    assert not any(words[0] == "http-response" for words in config["frontend kdeq"] + backend + defaults)
    assert directive(backend, "balance") == ["balance", "leastconn"]


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


def test_recording_rules_match_every_inference_route() -> None:
    from service.metrics import INFERENCE_ROUTES

    generator = runpy.run_path(str(DEPLOY / "grafana" / "dashboard.py"))
    text = (DEPLOY / "prometheus" / "rules" / "kdeq-recording.yml").read_text()
    assert text == generator["recording_rules"](text), "run deploy/grafana/dashboard.py"
    matchers = re.findall(r'endpoint=~"([^"]*)"', text)
    assert matchers and all(set(m.split("|")) == INFERENCE_ROUTES for m in matchers)


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


def dockerfile_lines() -> list[str]:
    """The Dockerfile's instructions as Docker reads them: continuation lines joined."""
    return (ROOT / "Dockerfile").read_text().replace("\\\n", "").splitlines()


def index_cuda(url: str) -> str | None:
    """The CUDA of a PyTorch wheel index: ``.../whl/cu130`` is 13.0, ``.../whl/cpu`` none."""
    variant = url.rstrip("/").rsplit("/", 1)[-1]
    if variant == "cpu":
        return None
    major, minor = re.fullmatch(r"cu(\d+)(\d)", variant).groups()
    return f"{major}.{minor}"


def image_cuda(image: str) -> str | None:
    """The CUDA of a base image: ``nvidia/cuda:13.0.2-...`` is 13.0, any other image none."""
    found = re.match(r"(?:\S+/)?nvidia/cuda:(\d+)\.(\d+)", image)
    return f"{found[1]}.{found[2]}" if found else None


def test_torch_wheel_and_base_image_name_the_same_cuda_in_every_variant() -> None:
    lines = dockerfile_lines()
    defaults = dict(re.findall(r"^ARG (BASE_IMAGE|TORCH_INDEX)=(\S+)", "\n".join(lines), re.M))
    assert index_cuda(defaults["TORCH_INDEX"]) == image_cuda(defaults["BASE_IMAGE"]) is not None
    # every pair the Dockerfile and the deployment page show agrees, the CPU one included
    pairs = re.findall(
        r"--build-arg BASE_IMAGE=(\S+)[\s\\#]+--build-arg TORCH_INDEX=(\S+)",
        (ROOT / "Dockerfile").read_text() + (ROOT / "docs" / "deployment.md").read_text(),
    )
    assert {index_cuda(index) for _, index in pairs} >= {None, "12.6"}
    for image, index in pairs:
        assert index_cuda(index) == image_cuda(image), (image, index)
    # and so do the compose builds, GPU and CPU
    for names, cuda in (
        (["docker-compose.yml"], "13.0"),
        (["docker-compose.yml", "docker-compose.cpu.yml"], None),
    ):
        args = {
            k: interpolate(v) for k, v in load_compose(*names)["services"]["kdeq"]["build"]["args"].items()
        }
        assert index_cuda(args["TORCH_INDEX"]) == image_cuda(args["BASE_IMAGE"]) == cuda, names
    # torch itself comes from that index alone, before the other dependencies fill in its own
    text = "\n".join(line for line in lines if not line.startswith("#"))
    assert 'torch_from="--index-url ${TORCH_INDEX}"' in text and "--extra-index-url" not in text
    assert text.index("--no-deps ${torch_from} -c constraints.txt torch") < text.index("-r requirements.txt")


def cuda_check() -> str:
    """The Python the build runs to compare torch's CUDA with the base image's."""
    (code,) = [
        m[1] for line in dockerfile_lines() if (m := re.match(r"RUN /opt/kdeq/bin/python -c '(.*)'$", line))
    ]
    return code


def test_build_stops_on_a_torch_built_for_another_cuda() -> None:
    lines = dockerfile_lines()
    check = next(i for i, line in enumerate(lines) if "torch.version.cuda" in line)
    installed = next(i for i, line in enumerate(lines) if "-r requirements.txt" in line)
    copied = lines.index("COPY kdeq/ kdeq/")
    assert installed < check < copied  # after torch is installed, in the build stage, before the code

    def build_check(cuda_version: str | None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VERSION"}
        if cuda_version is not None:
            env["CUDA_VERSION"] = cuda_version  # as the nvidia/cuda base images set it
        return subprocess.run(
            [sys.executable, "-c", cuda_check()], env=env, capture_output=True, text=True, timeout=120
        )

    # the same snippet, run against this machine's torch: a base naming its CUDA (none for a CPU
    # wheel) passes, any other CUDA stops the build with both versions in the message
    same = None if torch.version.cuda is None else f"{torch.version.cuda}.1"
    done = build_check(same)
    assert done.returncode == 0, done.stderr
    done = build_check("99.9.0")
    assert done.returncode == 1
    assert f"built for CUDA {torch.version.cuda} but the base image has CUDA 99.9" in done.stderr
    if torch.version.cuda is None:  # a CPU wheel on a CUDA base, the mistake issue 20 found
        done = build_check("13.0.2")
        assert done.returncode == 1 and "CUDA None but the base image has CUDA 13.0" in done.stderr


def test_runtime_image_sets_the_allocator_torch_reads() -> None:
    lines = dockerfile_lines()
    last = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    env = dict(
        word.split("=", 1)
        for line in lines[last:]
        if line.startswith("ENV ")
        for word in shlex.split(line)[1:]
    )
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    # this torch reads that name (its alias removed) and accepts the value; a malformed one raises
    clean = {k: v for k, v in os.environ.items() if not k.endswith("ALLOC_CONF")}
    code = "import torch; print(torch._C._accelerator_getAllocatorSettings())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "PYTORCH_ALLOC_CONF": env["PYTORCH_ALLOC_CONF"]},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == env["PYTORCH_ALLOC_CONF"], done.stderr
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "PYTORCH_ALLOC_CONF": "expandable_segments:true"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "Expected 'True' or 'False'" in done.stderr
