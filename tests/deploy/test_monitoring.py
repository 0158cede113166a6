"""The dashboard, the Prometheus rules, the adapter rule and ``--metrics-compat vllm``
against a real Prometheus scraping a live ``pagedllm serve``.

Prometheus (Debian's ``prometheus`` package: ``prometheus`` and ``promtool``) scrapes the
server every second with deploy/prometheus/prometheus.yml's job and rules; after a short
load, every dashboard query and every rule expression is evaluated through the HTTP API and
must return data, so a metric renamed in the server fails here, not on a dashboard in
production. Alert expressions are false on a healthy server: they must be valid queries
whose every series exists. Without the binaries the tests skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from pagedllm.metrics import VLLM_NAMES
from tests.deploy.manifests import (
    RULES_FILE, SCRAPE_CONFIG, adapter_rules, dashboard, kubernetes_documents, rules,
)
from tests.server.conftest import MODEL_NAME, free_port, started_server, wait_for

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="Prometheus is not installed (apt-get install prometheus; .ci/run installs it)")

# Grafana's variables as the queries are run here; [1m] covers the whole short run.
VARIABLES = {"$__rate_interval": "1m", "${model_name}": MODEL_NAME, "$model_name": MODEL_NAME}


def substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


class Prometheus:
    """A ``prometheus`` process on a free loopback port, its storage in ``root``."""

    def __init__(self, root: Path, target_port: int) -> None:
        config = yaml.safe_load(SCRAPE_CONFIG.read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(RULES_FILE)]
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{target_port}"]}]
        self.config_path = root / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.log_path = root / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.config_path}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10.0)
        if not wait_for(self._ready, 30.0, 0.2):
            self.stop()
            raise RuntimeError(f"Prometheus did not start:\n{self.log_path.read_text()}")

    def _ready(self) -> bool:
        try:
            return self.http.get("/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict]:
        """The instant vector (or scalar, as one item) of ``expr``; an invalid query fails."""
        body = self.http.get("/api/v1/query", params={"query": expr}).json()
        assert body["status"] == "success", (expr, body)
        data = body["data"]
        return data["result"] if data["resultType"] == "vector" else [data["result"]]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def send_load(base_url: str) -> None:
    """Completions (one prompt twice, for prefix-cache hits; one streamed) and chats."""
    shared = "A shared prefix that is long enough to fill a few KV blocks of the cache. " * 3
    chat = {"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=base_url, timeout=60.0) as http:
        for prompt in (shared, shared, "Once upon a time"):
            response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt,
                                                          "max_tokens": 8, "temperature": 0})
            assert response.status_code == 200, response.text
        body = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 8, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert any(line == "data: [DONE]" for line in response.iter_lines())
        for _ in range(2):
            assert http.post("/v1/chat/completions", json=chat).status_code == 200


@pytest.fixture(scope="module")
def monitored(server_model_dir, tmp_path_factory):
    """(server, prometheus) after the load, once Prometheus holds its last values and has
    evaluated the rules over them."""
    with started_server(server_model_dir, tmp_path_factory, "monitored-server",
                        "--metrics-compat", "vllm") as server:
        prometheus = Prometheus(tmp_path_factory.mktemp("prometheus"), server.port)
        try:
            assert wait_for(lambda: prometheus.value('up{job="pagedllm"}') == 1.0, 30.0, 0.2), \
                prometheus.log_path.read_text()
            send_load(server.base_url)
            generated = server.metric("pagedllm:generation_tokens_total")
            assert wait_for(lambda: prometheus.value("pagedllm:generation_tokens_total") == generated,
                            30.0, 0.2)
            assert wait_for(lambda: (prometheus.value("model_name:pagedllm_generation_tokens:rate1m")
                                     or 0) > 0, 30.0, 0.2)
            yield server, prometheus
        finally:
            prometheus.stop()


def test_promtool_accepts_the_rules_and_the_scrape_config():
    for command in (["check", "rules", str(RULES_FILE)], ["check", "config", str(SCRAPE_CONFIG)]):
        result = subprocess.run([PROMTOOL, *command], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_dashboard_query_returns_data(monitored):
    _, prometheus = monitored
    board = dashboard()
    exprs = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    assert len(exprs) >= 15
    empty = [expr for expr in exprs if not prometheus.query(substitute(expr))]
    assert empty == []


def test_dashboard_variables_and_panels_use_the_datasource_variable(monitored):
    _, prometheus = monitored
    board = dashboard()
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    query = variables["model_name"]["query"]["query"]
    metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", query).groups()
    values = prometheus.http.get(f"/api/v1/label/{label}/values", params={"match[]": metric}).json()
    assert values["data"] == [MODEL_NAME]
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert '{model_name=~"$model_name"}' in target["expr"] or "model_name=~" in target["expr"]
    titles = " ".join(panel["title"].lower() for panel in board["panels"])
    for topic in ("throughput", "time to first token", "time per output token", "end-to-end",
                  "waiting", "kv cache", "prefix cache", "preemptions", "finish reason"):
        assert topic in titles


def test_every_recording_rule_returns_data_and_is_recorded(monitored):
    _, prometheus = monitored
    recording = [rule for rule in rules() if "record" in rule]
    assert recording
    for rule in recording:
        assert prometheus.query(rule["expr"]), rule["record"]
        assert prometheus.query(rule["record"]), rule["record"]


def test_alert_expressions_are_valid_and_read_existing_series(monitored):
    _, prometheus = monitored
    alerts = [rule for rule in rules() if "alert" in rule]
    assert len(alerts) >= 4
    selector = re.compile(r'\b((?:pagedllm:|model_name:)[\w:]+|up)\b(\{[^}]*\})?')
    for rule in alerts:
        assert prometheus.query(rule["expr"]) == [], f"{rule['alert']} fires on a healthy server"
        selectors = [name + (matchers or "") for name, matchers in selector.findall(rule["expr"])]
        assert selectors, rule["alert"]
        missing = [s for s in selectors if not prometheus.query(s)]
        assert missing == [], rule["alert"]
    loaded = prometheus.http.get("/api/v1/rules").json()["data"]["groups"]
    health = {rule["name"]: rule["health"] for group in loaded for rule in group["rules"]}
    assert len(health) == len(rules())
    assert set(health.values()) == {"ok"}, health


def test_adapter_rule_query_returns_the_waiting_queue(monitored):
    """The adapter's metricsQuery with its template filled as the adapter fills it for one
    model (here without the namespace and pod labels that Kubernetes' scrape adds)."""
    _, prometheus = monitored
    (rule,) = adapter_rules()
    series = re.fullmatch(r"\^(.+)\$", rule["name"]["matches"]).group(1)
    query = (rule["metricsQuery"].replace("<<.Series>>", series)
             .replace("<<.LabelMatchers>>", f'model_name="{MODEL_NAME}"')
             .replace("<<.GroupBy>>", "model_name"))
    assert prometheus.query(query)


def test_probe_and_health_check_paths_answer_on_the_live_server(monitored):
    server, _ = monitored
    (container,) = kubernetes_documents()["Deployment/pagedllm"]["spec"]["template"]["spec"]["containers"]
    paths = {container[probe]["httpGet"]["path"]
             for probe in ("startupProbe", "readinessProbe", "livenessProbe")}
    for path in paths:
        assert httpx.get(server.base_url + path, timeout=10.0).status_code == 200, path


def test_metrics_compat_vllm_exports_the_same_series_under_vllm_names(monitored):
    server, prometheus = monitored
    samples = server.metrics()
    compared = 0
    for key, value in samples.items():
        name, labels = (key.split("{", 1) + [""])[:2]
        family = next((f for f in VLLM_NAMES if name == f or name.startswith(f + "_")), None)
        if family is None or name.startswith(family + "_") and name[len(family):] not in (
                "_total", "_bucket", "_count", "_sum"):
            continue
        for vllm_family in VLLM_NAMES[family]:
            vllm_key = vllm_family + name[len(family):] + ("{" + labels if labels else "")
            assert samples[vllm_key] == value, vllm_key
            compared += 1
    assert compared > 50  # histogram buckets included
    for family, names in VLLM_NAMES.items():
        if family.startswith("pagedllm:spec_decode"):
            continue  # only a speculative server has them (tests/server/test_speculative_server.py)
        for vllm_name in names:
            assert any(key.startswith(vllm_name) for key in samples), vllm_name
    assert not any(key.startswith("vllm:num_requests_waiting_for_grammar") for key in samples)
    # A vLLM dashboard's query works unchanged against the compatible names.
    assert prometheus.query('histogram_quantile(0.95, sum by (le) '
                            '(rate(vllm:time_to_first_token_seconds_bucket[1m])))')
    assert prometheus.value(f'vllm:num_requests_waiting{{model_name="{MODEL_NAME}"}}') == 0.0
