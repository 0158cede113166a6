"""The deployment files as data, for the tests of deploy/."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
RULES_FILE = DEPLOY / "prometheus" / "pagedllm-rules.yaml"
SCRAPE_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD_FILE = DEPLOY / "grafana" / "pagedllm.json"


def kubernetes_documents() -> dict[str, dict]:
    """Every manifest under deploy/kubernetes by ``Kind/name`` (the kustomization as ``Kustomization``)."""
    documents = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document["kind"] == "Kustomization":
                documents["Kustomization"] = document
            else:
                documents[f"{document['kind']}/{document['metadata']['name']}"] = document
    return documents


def adapter_rules() -> list[dict]:
    """The rules of Prometheus Adapter's configuration in prometheus-adapter-rules.yaml."""
    config_map = yaml.safe_load((KUBERNETES / "prometheus-adapter-rules.yaml").read_text())
    return yaml.safe_load(config_map["data"]["config.yaml"])["rules"]


def dashboard() -> dict:
    return json.loads(DASHBOARD_FILE.read_text())


def rules() -> list[dict]:
    """Every recording and alerting rule of the rules file."""
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]
