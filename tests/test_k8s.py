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


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        missing_tool("kubectl not installed (it renders the kustomizations: Debian package kubectl)")
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
        res = container(objects)["resources"]
        # memory is bounded; the CPU is not (a quota throttles solves mid-batch)
        assert "memory" in res["limits"] and "cpu" not in res["limits"]
        assert "cpu" in res["requests"] and "memory" in res["requests"]
        # the overlay's patch replaced the device; the other settings are the base's
        base = env(render("base"))
        assert {k: v for k, v in env(objects).items() if k != "KDEQ_DEVICE"} == {
            k: v for k, v in base.items() if k != "KDEQ_DEVICE"
        }


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


def test_autoscaling_rule_unit_test_passes_and_notices_a_changed_rule(tmp_path) -> None:
    tool = promtool()
    rules = PROM / "rules" / "kdeq-autoscaling.yml"
    done = subprocess.run([tool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    test = PROM / "tests" / "kdeq-autoscaling.test.yml"
    done = subprocess.run(
        [tool, "test", "rules", test.name], cwd=test.parent, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    # the test bites: the same test against a rule with another per-replica target fails
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    text = rules.read_text()
    assert "kdeq:queue_depth:sum1m / 2)" in text
    (tmp_path / "rules" / rules.name).write_text(
        text.replace("kdeq:queue_depth:sum1m / 2)", "kdeq:queue_depth:sum1m / 3)")
    )
    shutil.copy(test, tmp_path / "tests" / test.name)
    done = subprocess.run(
        [tool, "test", "rules", test.name],
        cwd=tmp_path / "tests",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr


def test_scaled_object_and_recording_rule_agree_on_target_and_bounds() -> None:
    rules = yaml.safe_load((PROM / "rules" / "kdeq-autoscaling.yml").read_text())["groups"][0]["rules"]
    desired = next(r["expr"] for r in rules if r["record"] == "kdeq:autoscaling:desired_replicas")
    target, low, high = re.fullmatch(
        r"clamp\(ceil\(kdeq:queue_depth:sum1m / (\d+)\), (\d+), (\d+)\)", desired
    ).groups()
    for path in ("overlays/cpu", "overlays/gpu"):
        scaled = one(render(path), "ScaledObject")["spec"]
        (trigger,) = scaled["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["threshold"] == target
        assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (int(low), int(high))
        # never to zero: a replica warms its models before serving
        assert scaled["minReplicaCount"] >= 1
        # the query reads the recorded series, so the rule's unit test covers what KEDA sees
        assert "kdeq:queue_depth:sum1m{" in trigger["metadata"]["query"]


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


def test_hpa_alternative_scales_like_the_scaled_object_on_the_adapters_metric(tmp_path) -> None:
    objects = render_with(tmp_path, "base", ["monitoring", "autoscaling-hpa"])
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
    assert rule["seriesQuery"].startswith(series + "{")
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    recorded = {
        r["record"]
        for g in one(objects, "PrometheusRule")["spec"]["groups"]
        for r in g["rules"]
        if "record" in r
    }
    assert series in recorded
    # the same target, bounds and behaviour as the KEDA ScaledObject
    scaled = one(render("overlays/gpu"), "ScaledObject")["spec"]
    assert metric["pods"]["target"] == {
        "type": "AverageValue",
        "averageValue": scaled["triggers"][0]["metadata"]["threshold"],
    }
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (scaled["minReplicaCount"], scaled["maxReplicaCount"])
    assert hpa["behavior"] == scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    # the overlays use one autoscaler, never both
    for path in ("overlays/cpu", "overlays/gpu"):
        kinds = [o["kind"] for o in render(path)]
        assert ("ScaledObject" in kinds) != ("HorizontalPodAutoscaler" in kinds), path
