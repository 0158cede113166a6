"""deploy/kubernetes: every built-in kind validated offline against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields are errors), and the manifests agreeing with
the server they run: its flags, its metrics, its API key variable.

The ServiceMonitor is a Prometheus Operator CRD, absent from those schemas: it is checked
as YAML for the fields the CRD requires and for pointing at the Service's port."""

from __future__ import annotations

import argparse
import re

import pytest

from pagedllm.entrypoints.openai.cli_args import API_KEY_ENV, add_serve_args, validate_serve_args
from pagedllm.metrics import ServerMetrics
from tests.deploy.manifests import KUBERNETES, REPO, adapter_rules, kubernetes_documents

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (it is in the test extra)")

DOCUMENTS = kubernetes_documents()
BUILT_IN = [key for key, doc in DOCUMENTS.items()
            if key != "Kustomization" and "monitoring.coreos.com" not in doc["apiVersion"]]


def container() -> dict:
    (only,) = DOCUMENTS["Deployment/pagedllm"]["spec"]["template"]["spec"]["containers"]
    return only


def serve_args() -> argparse.Namespace:
    """The container's arguments as ``pagedllm serve`` (the image's entry point) parses them."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(container()["args"])
    validate_serve_args(args)
    return args


def exported_metric_names() -> set[str]:
    """Sample names of /metrics (``_total``, ``_bucket``... included), from the server's own registry."""
    text = ServerMetrics("m").render()[0].decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_the_manifests_hold_every_part_of_a_deployment():
    assert {"Deployment/pagedllm", "Service/pagedllm", "PersistentVolumeClaim/pagedllm-model-cache",
            "ServiceMonitor/pagedllm", "HorizontalPodAutoscaler/pagedllm",
            "ConfigMap/prometheus-adapter", "Kustomization"} <= set(DOCUMENTS)


@pytest.mark.parametrize("key", BUILT_IN)
def test_manifest_is_valid_against_the_kubernetes_schema(key):
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(DOCUMENTS[key], version, strict=True)


def test_schema_validation_rejects_an_unknown_field():
    """The strict check is not vacuous: a misspelt field fails."""
    deployment = DOCUMENTS["Deployment/pagedllm"]
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_service_monitor_has_the_fields_its_crd_requires_and_scrapes_the_service():
    monitor = DOCUMENTS["ServiceMonitor/pagedllm"]
    service = DOCUMENTS["Service/pagedllm"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"]
    spec = monitor["spec"]
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port_names = {port["name"] for port in service["spec"]["ports"]}
    assert spec["endpoints"]
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+[smh]", endpoint["interval"])


def test_kustomization_lists_every_manifest_of_the_app():
    """The adapter's rule lives in the adapter's namespace and is applied on its own."""
    kustomization = DOCUMENTS["Kustomization"]
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in KUBERNETES.glob("*.yaml")}
    assert listed <= on_disk
    assert on_disk - listed == {"kustomization.yaml", "prometheus-adapter-rules.yaml"}
    assert [image["name"] for image in kustomization["images"]] == [container()["image"].split(":")[0]]


def test_container_port_and_probes_match_the_server_flags():
    args = serve_args()
    ports = {port["name"]: port["containerPort"] for port in container()["ports"]}
    assert ports == {"http": args.port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        http_get = container()[probe]["httpGet"]
        assert http_get == {"path": "/health", "port": "http"}, probe
    startup = container()["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading takes minutes"
    service_ports = DOCUMENTS["Service/pagedllm"]["spec"]["ports"]
    assert [port["targetPort"] for port in service_ports] == ["http"]


def test_grace_period_covers_the_pre_stop_pause_and_the_shutdown_timeout():
    args = serve_args()
    assert args.shutdown_timeout == 30.0  # the server's default, set explicitly
    pod = DOCUMENTS["Deployment/pagedllm"]["spec"]["template"]["spec"]
    pre_stop = container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["terminationGracePeriodSeconds"]
    # The rest of the period is for the engine core to stop after the last request.
    assert pre_stop + args.shutdown_timeout + 5 <= grace <= pre_stop + args.shutdown_timeout + 30


def test_pod_asks_for_a_gpu_shared_memory_and_the_model_cache():
    resources = container()["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"]
    pod = DOCUMENTS["Deployment/pagedllm"]["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container()["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    env = {item["name"]: item for item in container()["env"]}
    cache = volumes[mounts[env["HF_HOME"]["value"]]]
    claim = cache["persistentVolumeClaim"]["claimName"]
    assert f"PersistentVolumeClaim/{claim}" in DOCUMENTS
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"HF_HOME={env['HF_HOME']['value']}" in dockerfile
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert f"USER {pod['securityContext']['runAsUser']}:" in dockerfile


def test_api_key_comes_from_a_secret_in_the_variable_the_server_reads():
    env = {item["name"]: item for item in container()["env"]}
    assert "secretKeyRef" in env[API_KEY_ENV]["valueFrom"]
    assert "--api-key" not in " ".join(container()["args"])


def test_autoscaler_reads_an_exported_metric_through_the_adapter_rule():
    hpa = DOCUMENTS["HorizontalPodAutoscaler/pagedllm"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == DOCUMENTS["Deployment/pagedllm"]["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    custom_name = metric["pods"]["metric"]["name"]
    assert ":" not in custom_name  # the custom metrics API refuses ':' in names
    (rule,) = [rule for rule in adapter_rules() if rule["name"]["as"] == custom_name]
    series = re.fullmatch(r"\^(.+)\$", rule["name"]["matches"]).group(1)
    assert series == "pagedllm:num_requests_waiting"
    assert series in exported_metric_names()
    assert rule["seriesQuery"].startswith(series + "{")
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
