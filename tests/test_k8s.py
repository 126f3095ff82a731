"""The Kubernetes deployment (deploy/k8s/) checked offline: every overlay rendered by kustomize
(``kubectl kustomize``) and each object validated strictly against its schema: the Kubernetes API's
(kubernetes-validate) or, for KEDA's and the Prometheus Operator's custom resources, the vendored
ones in deploy/schemas/; then what the manifests promise the service: its settings, probes, drain
and shutdown timing, the restricted pod security profile, the GPU, the monitoring generated from the
compose stack's files, and the autoscaling query's unit test under promtool. Nothing here runs on a
cluster."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import os
import re
import runpy
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import torch
import yaml

from service.settings import Settings, SettingsError
from tests.service_helpers import missing_tool

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = ROOT / "deploy" / "schemas"
PROM = ROOT / "deploy" / "prometheus"
KUBERNETES_VERSION = "1.32"  # the API version validated against: kubectl's own here
OVERLAYS = ("base", "overlays/cpu", "overlays/gpu")
# custom resources: (apiVersion, kind) -> vendored schema (deploy/schemas/README.md)
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda-scaledobject.schema.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "prometheus-operator-servicemonitor.schema.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheus-operator-prometheusrule.schema.json",
}


KUBECTL_MIN = (1, 27)  # the first kubectl whose built-in Kustomize is v5 (components, `labels`)


@functools.cache
def _kubectl_version(path: str) -> tuple[int, int] | None:
    """kubectl's client (major, minor), or None when it does not say (too old for ``-o json``)."""
    done = subprocess.run(
        [path, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60, check=False
    )
    try:
        client = json.loads(done.stdout)["clientVersion"]
        # a vendor build may write the minor as "32+"
        return int(client["major"]), int(re.match(r"\d+", client["minor"])[0])
    except (ValueError, KeyError, TypeError):
        return None


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        missing_tool("kubectl not installed (it renders the kustomizations: Debian package kubectl)")
    version = _kubectl_version(path)
    if version is None or version < KUBECTL_MIN:
        found = "an unknown version" if version is None else "{}.{}".format(*version)
        missing_tool(
            f"kubectl {KUBECTL_MIN[0]}.{KUBECTL_MIN[1]} or later needed (its Kustomize v5 renders the "
            f"components); {path} is {found}"
        )
    return path


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        missing_tool("promtool not installed (Debian package prometheus; .ci/run installs it)")
    return path


@functools.cache
def _render(path: str) -> str:
    done = subprocess.run(
        [kubectl(), "kustomize", path], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def render(path: str | Path) -> list[dict]:
    """The objects ``kubectl kustomize PATH`` renders (a fresh copy each call: tests mutate them)."""
    return [d for d in yaml.safe_load_all(_render(str(K8S / path))) if d]


def one(objects: list[dict], kind: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    return jsonschema.Draft7Validator(schema)


def schema_errors(obj: dict) -> list[str]:
    """Why ``obj`` does not follow its kind's schema (unknown fields included); empty when it does."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        return [f"{list(e.path)}: {e.message}" for e in crd_validator(*key).iter_errors(obj)]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        return [f"{list(err.path)}: {err.message}"]
    return []


def pod_spec(objects: list[dict]) -> dict:
    return one(objects, "Deployment")["spec"]["template"]["spec"]


def container(objects: list[dict]) -> dict:
    (only,) = pod_spec(objects)["containers"]
    return only


def env(objects: list[dict]) -> dict[str, object]:
    """The container's environment: a value, or the ``valueFrom`` mapping."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(objects)["env"]}


# the devices each rendering's pods solve on: the base's `auto` is sized for the worst, a GPU's batch
DEVICES = {"base": ["cuda:0"], "overlays/cpu": ["cpu"], "overlays/gpu": ["cuda:0"]}


def settings_of(objects: list[dict], monkeypatch) -> Settings:
    """The service's settings from the container's literal environment, as in the GPU overlay's
    container (one CUDA device) so that ``KDEQ_DEVICE=cuda`` resolves here too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return Settings.from_env({k: v for k, v in env(objects).items() if isinstance(v, str)})


BINARY = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(text: str | int) -> int:
    """A Kubernetes byte quantity (``3Gi``, ``512Mi``, ``1024``) in bytes: the binary suffixes the
    manifests use, anything else refused rather than misread."""
    number, suffix = re.fullmatch(r"(\d+)([KMGT]i)?", str(text)).groups()
    return int(number) * BINARY[suffix or ""]


# --- rendering and schemas -------------------------------------------------------------------


@pytest.mark.parametrize("path", OVERLAYS)
def test_every_rendered_object_follows_its_schema_strictly(path: str) -> None:
    objects = render(path)
    kinds = sorted(o["kind"] for o in objects)
    core = ["Deployment", "Namespace", "PodDisruptionBudget", "Service"]
    if path == "base":
        assert kinds == core
    else:
        assert kinds == sorted([*core, "ConfigMap", "PrometheusRule", "ScaledObject", "ServiceMonitor"])
    for obj in objects:
        assert schema_errors(obj) == [], (obj["kind"], schema_errors(obj))
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "kdeq", obj["kind"]


def test_a_misspelt_field_fails_validation_for_core_objects_and_custom_resources() -> None:
    objects = render("overlays/gpu")
    # core: a field name off by one letter, at three depths of the Deployment
    for where in ("spec", "pod", "container"):
        deployment = copy.deepcopy(one(objects, "Deployment"))
        target = {
            "spec": deployment["spec"],
            "pod": deployment["spec"]["template"]["spec"],
            "container": deployment["spec"]["template"]["spec"]["containers"][0],
        }[where]
        key = next(iter(target))
        target[key[:-1]] = target.pop(key)
        errors = schema_errors(deployment)
        assert errors and f"'{key[:-1]}' was unexpected" in errors[0], (where, errors)
    # a wrong type is caught too: a port number as a word
    service = copy.deepcopy(one(objects, "Service"))
    service["spec"]["ports"][0]["port"] = "eight thousand"
    assert schema_errors(service)
    # custom resources: a misspelt field at the top of the spec and deep inside it
    scaled = copy.deepcopy(one(objects, "ScaledObject"))
    scaled["spec"]["minReplicasCount"] = scaled["spec"].pop("minReplicaCount")
    assert any("minReplicasCount" in e for e in schema_errors(scaled))
    scaled = copy.deepcopy(one(objects, "ScaledObject"))
    scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behaviour"] = scaled["spec"]["advanced"][
        "horizontalPodAutoscalerConfig"
    ].pop("behavior")
    assert any("behaviour" in e for e in schema_errors(scaled))
    monitor = copy.deepcopy(one(objects, "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["intervall"] = monitor["spec"]["endpoints"][0].pop("interval")
    assert any("intervall" in e for e in schema_errors(monitor))
    rule = copy.deepcopy(one(objects, "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["expression"] = rule["spec"]["groups"][0]["rules"][0].pop("expr")
    assert any("expression" in e for e in schema_errors(rule))


# --- the service's contract --------------------------------------------------------------------


@pytest.mark.parametrize("path", OVERLAYS)
def test_the_container_environment_is_a_valid_service_configuration(path: str, monkeypatch) -> None:
    # as in the GPU overlay's container: one CUDA device, the one the device plugin gives it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    objects = render(path)
    variables = env(objects)
    # the Secret's key is passed only when the Secret exists (optional), never as an empty value
    # (the service refuses an empty key)
    secret = variables.pop("KDEQ_API_KEY")["secretKeyRef"]
    assert secret["optional"] is True and secret["name"] == "kdeq-api-key"
    settings = Settings.from_env({k: v for k, v in variables.items() if isinstance(v, str)})
    assert settings.api_key is None
    # `cuda` is named as the device it is at startup: cuda:0, the container's one GPU
    assert settings.device == {"base": ("auto",), "overlays/cpu": ("cpu",), "overlays/gpu": ("cuda:0",)}[path]
    # Service links would add KDEQ_SERVICE_HOST and KDEQ_PORT=tcp://… for the Service named kdeq,
    # which the service refuses at startup: they must be off
    assert one(objects, "Service")["metadata"]["name"] == "kdeq"
    assert pod_spec(objects)["enableServiceLinks"] is False
    links = {"KDEQ_SERVICE_HOST": "10.96.0.10", "KDEQ_PORT": "tcp://10.96.0.10:8000"}
    with pytest.raises(SettingsError):
        Settings.from_env({**{k: v for k, v in variables.items() if isinstance(v, str)}, **links})


def test_probes_drain_and_grace_period_fit_the_service() -> None:
    from service.routes import router

    routes = {r.path for r in router.routes}
    for path in OVERLAYS:
        objects = render(path)
        c = container(objects)
        port = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert port == {"http": 8000}
        for probe, route in (
            ("startupProbe", "/readyz"),
            ("readinessProbe", "/readyz"),
            ("livenessProbe", "/healthz"),
        ):
            get = c[probe]["httpGet"]
            assert get["path"] == route and route in routes and get["port"] in port, (path, probe)
        # the startup probe waits as long as compose's start period (120 s) at least: warm-up
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
        # liveness must not restart a replica that is only busy: /healthz never touches a model,
        # and a few misses are tolerated
        assert c["livenessProbe"]["failureThreshold"] >= 3
        # the app drains itself on SIGTERM (service/server.py): a preStop hook would only delay it
        assert "lifecycle" not in c
        variables = env(objects)
        drain = float(variables["KDEQ_DRAIN_SECONDS"])
        # uvicorn's graceful limit after the drain: int(request timeout) + 5 (service/server.py)
        graceful = int(float(variables["KDEQ_REQUEST_TIMEOUT_SECONDS"])) + 5
        grace = pod_spec(objects)["terminationGracePeriodSeconds"]
        assert grace >= drain + graceful + 10, (path, grace, drain, graceful)
        # the drain outlasts the endpoint removal's spread to kube-proxy and ingresses (seconds)
        assert drain >= 5


def dockerfile_uid() -> int:
    text = (ROOT / "Dockerfile").read_text()
    return int(re.search(r"useradd [^\n]*--uid (\d+)", text)[1])


# the volume types Pod Security's `restricted` profile allows
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def assert_restricted(objects: list[dict]) -> None:
    """The rules of Pod Security's `restricted` profile that a pod template can break, and the
    read-only root filesystem with a writable /tmp."""
    spec = pod_spec(objects)
    sc = spec["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["seccompProfile"]["type"] == "RuntimeDefault"
    # numeric, the image's user: a user named in the image cannot be checked against runAsNonRoot
    assert sc["runAsUser"] == dockerfile_uid() != 0
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    for c in spec["containers"]:
        csc = c["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"]
        assert not csc.get("capabilities", {}).get("add") and not csc.get("privileged")
        assert csc["readOnlyRootFilesystem"] is True
        assert "hostPort" not in json.dumps(c["ports"])
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]]
        # HOME (the caches of CUDA, torch and Triton) is on a writable volume
        home = next(e["value"] for e in c["env"] if e["name"] == "HOME")
        assert any(
            home == p or home.startswith(p + "/") for p, n in mounts.items() if "emptyDir" in volumes[n]
        )
    for volume in spec["volumes"]:
        assert set(volume) - {"name"} <= RESTRICTED_VOLUMES, volume


@pytest.mark.parametrize("path", OVERLAYS)
def test_pods_meet_the_restricted_pod_security_profile(path: str) -> None:
    objects = render(path)
    assert_restricted(objects)
    labels = one(objects, "Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


def test_gpu_overlay_takes_one_gpu_on_gpu_nodes_and_cpu_overlay_none() -> None:
    gpu, cpu = render("overlays/gpu"), render("overlays/cpu")
    resources = container(gpu)["resources"]
    # an extended resource is requested through its limit, one whole GPU per replica
    assert resources["limits"]["nvidia.com/gpu"] == 1 and "nvidia.com/gpu" not in resources.get(
        "requests", {}
    )
    spec = pod_spec(gpu)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert "nvidia.com/gpu" not in json.dumps(container(cpu)["resources"])
    assert "nodeSelector" not in pod_spec(cpu) and "tolerations" not in pod_spec(cpu)
    # distinct images: the CPU and the CUDA builds (the compose files' tags)
    assert container(gpu)["image"] == "kdeq:latest" and container(cpu)["image"] == "kdeq-cpu:latest"
    for objects in (gpu, cpu):
        # a `latest` tag with IfNotPresent would keep a node's first pull of it for good; unset,
        # Kubernetes pulls `latest` at every start (Always)
        c = container(objects)
        assert not (c["image"].endswith(":latest") and c.get("imagePullPolicy", "Always") != "Always")
    for objects in (gpu, cpu):
        res = container(objects)["resources"]
        # memory is bounded; the CPU is not (a quota throttles solves mid-batch)
        assert "memory" in res["limits"] and "cpu" not in res["limits"]
        assert "cpu" in res["requests"] and "memory" in res["requests"]
        # the overlay's patch set the device and the memory bounds; the other settings are the base's
        sized = {"KDEQ_DEVICE", "KDEQ_QUEUE_SIZE", "KDEQ_MAX_PIXELS"}
        base = env(render("base"))
        assert {k: v for k, v in env(objects).items() if k not in sized} == {
            k: v for k, v in base.items() if k not in sized
        }


@pytest.mark.parametrize("path", OVERLAYS)
def test_tmp_volume_holds_the_worst_case_of_spooled_uploads(path: str, monkeypatch) -> None:
    objects = render(path)
    settings = settings_of(objects, monkeypatch)
    # every request admitted (queued, or being read and decoded: at most the queue size) or being
    # solved (a batch) holds its upload, spooled to /tmp, until it is answered; 1 GiB on top for the
    # CUDA, torch and Triton caches (HOME=/tmp)
    uploads = settings.queue_size + settings.batch_size(DEVICES[path])
    need = uploads * settings.max_upload_bytes + 2**30
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container(objects)["volumeMounts"]}
    size = quantity(volumes[mounts["/tmp"]]["emptyDir"]["sizeLimit"])
    assert need <= size, (path, need / 2**30, size / 2**30)
    # the volume counts against the pod's ephemeral storage: the scheduler reserves it, and the
    # limit leaves room for the container's logs above it
    resources = container(objects)["resources"]
    assert quantity(resources["requests"]["ephemeral-storage"]) >= size
    assert quantity(resources["limits"]["ephemeral-storage"]) > size


@pytest.mark.parametrize("path", ["overlays/cpu", "overlays/gpu"])
def test_queued_decoded_images_fit_in_half_the_memory_limit(path: str, monkeypatch) -> None:
    objects = render(path)
    settings = settings_of(objects, monkeypatch)
    # decoded pixels are float32 in 3 channels (service/decode.py): 12 B a pixel, for every image
    # queued or being decoded (the queue size) and every one being solved (a batch). Half the limit
    # at most: the rest holds torch, the models, the solve's and the encoder's buffers, and an
    # alpha channel's extra third
    images = settings.queue_size + settings.batch_size(DEVICES[path])
    worst = images * settings.max_pixels * 12
    limit = quantity(container(objects)["resources"]["limits"]["memory"])
    assert worst <= limit / 2, (path, worst / 2**30, limit / 2**30)
    # the service's own defaults (a queue of 64 of 32-megapixel images) would not fit: the
    # overlays' bounds are what makes this hold
    defaults = Settings.from_env({})
    assert (defaults.queue_size + settings.batch_size(DEVICES[path])) * defaults.max_pixels * 12 > limit


def test_gpu_rollouts_free_a_gpu_before_starting_a_replica_and_cpu_rollouts_surge() -> None:
    # a fixed GPU pool at the autoscaler's maximum has no GPU for a surge replica: the rollout
    # would wait on a Pending pod for good
    gpu = one(render("overlays/gpu"), "Deployment")["spec"]["strategy"]
    assert gpu == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    # CPU nodes have room for one more: the new replica is warm before an old one drains
    cpu = one(render("overlays/cpu"), "Deployment")["spec"]["strategy"]
    assert cpu == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("path", ["overlays/cpu", "overlays/gpu"])
def test_service_budget_monitor_and_autoscaler_find_the_pods(path: str) -> None:
    objects = render(path)
    deployment, service = one(objects, "Deployment"), one(objects, "Service")
    pods = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], pods)
    assert selects(service["spec"]["selector"], pods)
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    budget = one(objects, "PodDisruptionBudget")["spec"]
    # one replica at a time, never a budget that blocks a node drain when there is one replica
    assert selects(budget["selector"]["matchLabels"], pods) and budget["maxUnavailable"] == 1
    monitor = one(objects, "ServiceMonitor")["spec"]
    assert selects(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    # Prometheus names the job after the Service: the rules' and alerts' job="kdeq"
    rules = json.dumps(one(objects, "PrometheusRule")["spec"])
    assert 'job=\\"kdeq\\"' in rules and service["metadata"]["name"] == "kdeq"
    scaled = one(objects, "ScaledObject")["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kdeq"}
    # the autoscaler owns the replica count: an applied one would reset it at every apply
    assert "replicas" not in deployment["spec"]
    (trigger,) = scaled["triggers"]
    query = trigger["metadata"]["query"]
    assert f'namespace="{deployment["metadata"]["namespace"]}"' in query and 'job="kdeq"' in query


# --- generated monitoring ------------------------------------------------------------------------


def generator() -> dict:
    return runpy.run_path(str(K8S / "generate.py"))


def test_committed_monitoring_objects_are_the_generators_output() -> None:
    for path, text in generator()["outputs"]().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run deploy/k8s/generate.py"


def datasource_refs(node: object):
    """Every ``datasource`` value in a dashboard, panels and queries alike."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield value
            else:
                yield from datasource_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from datasource_refs(value)


def test_prometheus_rule_and_dashboard_are_the_compose_stacks() -> None:
    objects = render("overlays/gpu")
    groups = [
        g for f in sorted((PROM / "rules").glob("*.yml")) for g in yaml.safe_load(f.read_text())["groups"]
    ]
    assert one(objects, "PrometheusRule")["spec"]["groups"] == groups
    assert {g["name"] for g in groups} >= {"kdeq-alerts", "kdeq-recording", "kdeq-autoscaling"}
    compose = yaml.safe_load((PROM / "prometheus.yml").read_text())
    endpoint = one(objects, "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["interval"] == compose["global"]["scrape_interval"] and endpoint["path"] == "/metrics"

    dashboard = one(objects, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    ((name, text),) = dashboard["data"].items()
    board = json.loads(text)
    original = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / name).read_text())
    # every panel queries the dashboard's datasource variable, which lists the Prometheus sources
    refs = list(datasource_refs(board))
    assert len(refs) == len(list(datasource_refs(original))) > 10
    assert all(r == {"type": "prometheus", "uid": "${datasource}"} for r in refs)
    variable = board["templating"]["list"][0]
    assert (
        variable["name"] == "datasource"
        and variable["type"] == "datasource"
        and variable["query"] == "prometheus"
    )
    # and otherwise it is the compose dashboard, panel for panel and query for query
    assert [(p["title"], [t["expr"] for t in p.get("targets", [])]) for p in board["panels"]] == [
        (p["title"], [t["expr"] for t in p.get("targets", [])]) for p in original["panels"]
    ]
    schema = json.loads((SCHEMAS / "grafana-dashboard.schema.json").read_text())
    assert not list(jsonschema.Draft7Validator(schema).iter_errors(board))
    # `kubectl apply` (client-side) keeps the object in an annotation limited to 256 KiB
    assert len(json.dumps(dashboard)) < 256 * 1024


# --- autoscaling ---------------------------------------------------------------------------------


AUTOSCALING_RULES = PROM / "rules" / "kdeq-autoscaling.yml"
AUTOSCALING_TEST = PROM / "tests" / "kdeq-autoscaling.test.yml"


def run_promtool_test(test: Path) -> subprocess.CompletedProcess:
    """``promtool test rules`` on ``test``, from its folder (its rule_files are relative)."""
    return subprocess.run(
        [promtool(), "test", "rules", test.name], cwd=test.parent, capture_output=True, text=True, timeout=120
    )


def rule_test_expressions() -> dict[str, list[tuple[int, str, list[float]]]]:
    """Every expression the autoscaling unit test evaluates: (the test's index, eval_time, expected
    values) each time."""
    tests = yaml.safe_load(AUTOSCALING_TEST.read_text())["tests"]
    found: dict[str, list[tuple[int, str, list[float]]]] = {}
    for index, test in enumerate(tests):
        for case in test.get("promql_expr_test", []):
            values = [float(s["value"]) for s in case["exp_samples"]]
            found.setdefault(case["expr"], []).append((index, case["eval_time"], values))
    return found


def minutes(duration: str) -> float:
    """A promtool eval_time such as ``15m`` or ``90s``, in minutes."""
    number, unit = re.fullmatch(r"(\d+)([sm])", duration).groups()
    return int(number) / (60 if unit == "s" else 1)


def test_autoscaling_rule_unit_test_passes_and_notices_a_changed_rule(tmp_path) -> None:
    done = subprocess.run(
        [promtool(), "check", "rules", str(AUTOSCALING_RULES)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    done = run_promtool_test(AUTOSCALING_TEST)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    # the test bites: each of these rules gets a wrong total and fails it
    text = AUTOSCALING_RULES.read_text()
    mutations = {
        # no `and` on the current sample: a restarted pod's last minute is counted beside its successor
        "restart": ('\n            and kdeq_requests_in_flight{job="kdeq"}', ""),
        # summed over every namespace: another deployment's load is counted as this one's
        "namespace": ("sum by (namespace, job)", "sum by (job)"),
        # the queue instead of the requests in flight: near 0 while the replicas keep up
        "signal": ("avg_over_time(kdeq_requests_in_flight", "avg_over_time(kdeq_queue_depth"),
    }
    for name, (old, new) in mutations.items():
        assert text.count(old) == 1, name
        root = tmp_path / name
        (root / "rules").mkdir(parents=True)
        (root / "tests").mkdir()
        (root / "rules" / AUTOSCALING_RULES.name).write_text(text.replace(old, new))
        shutil.copy(AUTOSCALING_TEST, root / "tests" / AUTOSCALING_TEST.name)
        done = run_promtool_test(root / "tests" / AUTOSCALING_TEST.name)
        assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr, name


def test_the_autoscalers_queries_are_the_ones_the_rule_test_evaluates() -> None:
    tested = rule_test_expressions()
    recorded = {
        r["record"] for g in yaml.safe_load(AUTOSCALING_RULES.read_text())["groups"] for r in g["rules"]
    }
    for path in ("overlays/cpu", "overlays/gpu"):
        objects = render(path)
        (trigger,) = one(objects, "ScaledObject")["spec"]["triggers"]
        query = trigger["metadata"]["query"]
        # KEDA's exact string, evaluated by promtool on the synthetic series: it reads the series the
        # rules record, and it rises with the load and falls with it within one test's timeline
        assert "kdeq:requests_in_flight:sum1m{" in query and "kdeq:requests_in_flight:sum1m" in recorded
        assert query in tested, (path, query)
        by_test: dict[int, list[tuple[float, float]]] = {}
        for index, at, values in tested[query]:
            by_test.setdefault(index, []).append((minutes(at), values[0]))
        totals = [[total for _, total in sorted(timeline)] for timeline in by_test.values()]
        assert any(
            any(a < b for a, b in itertools.pairwise(ts)) and any(a > b for a, b in itertools.pairwise(ts))
            for ts in totals
        ), totals
    # prometheus-adapter's query for the HPA, expanded as the adapter does for the pods kdeq-a and
    # kdeq-b of the namespace kdeq: the test evaluates that very string too
    adapter = yaml.safe_load(
        (K8S / "components" / "autoscaling-hpa" / "prometheus-adapter-values.yaml").read_text()
    )
    (rule,) = adapter["rules"]["custom"]
    series = re.fullmatch(r"\^(.*)\$", rule["name"]["matches"])[1]
    assert series in recorded and rule["seriesQuery"].startswith(series + "{")
    expanded = (
        rule["metricsQuery"]
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", 'namespace="kdeq",pod=~"kdeq-a|kdeq-b"')
        .replace("<<.GroupBy>>", "pod")
    )
    assert "<<" not in expanded and expanded in tested, expanded
    assert len(tested[expanded]) >= 2


def test_scaled_object_targets_a_batch_per_gpu_replica_and_one_or_two_per_cpu_replica(monkeypatch) -> None:
    targets = {}
    for path in ("overlays/cpu", "overlays/gpu"):
        objects = render(path)
        scaled = one(objects, "ScaledObject")["spec"]
        (trigger,) = scaled["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        target = targets[path] = int(trigger["metadata"]["threshold"])
        batch = settings_of(objects, monkeypatch).batch_size(DEVICES[path])
        if path == "overlays/gpu":
            # a full batch a replica: fewer would add replicas that solve half-empty batches
            assert batch > 1 and target == batch
        else:
            assert batch == 1 and 1 <= target <= 2
        # a missing series must be an error KEDA reports, not a 0 that pins the minimum
        assert trigger["metadata"]["ignoreNullValues"] == "false"
        # never to zero (a replica warms its models before serving), so no cooldownPeriod, which
        # KEDA applies only to and from zero
        assert 1 <= scaled["minReplicaCount"] < scaled["maxReplicaCount"]
        assert "cooldownPeriod" not in scaled
    assert targets["overlays/gpu"] > targets["overlays/cpu"]
    # the recorded series are totals; no rule computes a replica count, whose target is the overlay's
    rules = [r for g in yaml.safe_load(AUTOSCALING_RULES.read_text())["groups"] for r in g["rules"]]
    assert all("replicas" not in r["record"] for r in rules)


# --- models from a volume ------------------------------------------------------------------------


def render_with(tmp_path: Path, resource: str, components: list[str]) -> list[dict]:
    """An overlay of ``resource`` (a path under deploy/k8s) with ``components`` added, in the
    overlays' namespace, as a user's overlay would be; rendered and every object schema-checked."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": "kdeq",
                # relative: kustomize refuses an absolute path to another kustomization
                "resources": [os.path.relpath(K8S / resource, overlay)],
                "components": [os.path.relpath(K8S / "components" / c, overlay) for c in components],
            }
        )
    )
    objects = [d for d in yaml.safe_load_all(_render(str(overlay))) if d]
    for obj in objects:
        assert schema_errors(obj) == [], (obj["kind"], schema_errors(obj))
    return objects


def test_models_volume_component_mounts_a_read_only_claim_over_the_image_models(tmp_path) -> None:
    objects = render_with(tmp_path, "overlays/gpu", ["models-volume"])
    claim = one(objects, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"] and claim["metadata"]["namespace"] == "kdeq"
    mounts = {m["mountPath"]: m for m in container(objects)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    models = mounts["/models"]
    assert models["readOnly"] is True
    assert volumes[models["name"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    # the service reads the models from where the image's KDEQ_MODELS_DIR points
    assert "KDEQ_MODELS_DIR=/models" in (ROOT / "Dockerfile").read_text()
    assert "/tmp" in mounts  # the base's mounts are kept
    assert_restricted(objects)


def overlay_with_hpa(tmp_path: Path, path: str) -> list[dict]:
    """The overlay ``path`` with autoscaling-hpa in place of autoscaling-keda, as the docs tell a user
    without KEDA to do: a copy of the overlay's folder, its relative paths pointed back here."""
    overlay = tmp_path / path.replace("/", "-")
    shutil.copytree(K8S / path, overlay)
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    back = os.path.relpath(K8S, overlay)
    kustomization["resources"] = [r.replace("../..", back) for r in kustomization["resources"]]
    components = [c.replace("../..", back) for c in kustomization["components"]]
    keda = f"{back}/components/autoscaling-keda"
    assert keda in components
    kustomization["components"] = [
        f"{back}/components/autoscaling-hpa" if c == keda else c for c in components
    ]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    objects = [d for d in yaml.safe_load_all(_render(str(overlay))) if d]
    for obj in objects:
        assert schema_errors(obj) == [], (obj["kind"], schema_errors(obj))
    return objects


@pytest.mark.parametrize("path", ["overlays/cpu", "overlays/gpu"])
def test_hpa_alternative_scales_like_the_scaled_object_on_the_adapters_metric(tmp_path, path: str) -> None:
    objects = overlay_with_hpa(tmp_path, path)
    assert "ScaledObject" not in [o["kind"] for o in objects]
    hpa = one(objects, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kdeq"}
    # the metric prometheus-adapter serves, from a series the autoscaling rules record per pod
    adapter = yaml.safe_load(
        (K8S / "components" / "autoscaling-hpa" / "prometheus-adapter-values.yaml").read_text()
    )
    (rule,) = adapter["rules"]["custom"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    series = re.fullmatch(r"\^(.*)\$", rule["name"]["matches"])[1]
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    recorded = {
        r["record"]
        for g in one(objects, "PrometheusRule")["spec"]["groups"]
        for r in g["rules"]
        if "record" in r
    }
    assert series in recorded
    # the same target (the overlay's), bounds and behaviour as the overlay's KEDA ScaledObject
    scaled = one(render(path), "ScaledObject")["spec"]
    assert metric["pods"]["target"] == {
        "type": "AverageValue",
        "averageValue": scaled["triggers"][0]["metadata"]["threshold"],
    }
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (scaled["minReplicaCount"], scaled["maxReplicaCount"])
    assert hpa["behavior"] == scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    # the overlays use one autoscaler, never both
    kinds = [o["kind"] for o in render(path)]
    assert ("ScaledObject" in kinds) != ("HorizontalPodAutoscaler" in kinds), path
