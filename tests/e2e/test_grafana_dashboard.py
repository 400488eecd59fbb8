"""deploy/grafana/vllm-kvp2p.json against real engines: Debian's Prometheus scrapes the session's P and D (their
own ``/metrics``), a few P/D requests go through the proxy, and every query of every panel, with Grafana's
variables filled in, returns data through Prometheus's HTTP API. A renamed metric, a wrong label or a panel whose
query Prometheus cannot parse fails here. Grafana itself is not in Debian's archive; its JSON model is checked
for what Grafana needs of it (panels, targets, the variables the queries use)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.helpers import prompt_ids, through_the_proxy
from vllm_kvp2p.testing.cluster import PDCluster
from vllm_kvp2p.testing.server import free_port

pytestmark = pytest.mark.e2e

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "vllm-kvp2p.json"
#: What Grafana puts in for its variables: a rate window of four 1 s scrapes and more, every model.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*"}
#: Every series the connector exports (vllm_kvp2p/connector/metrics.py): each is on the dashboard.
CONNECTOR_SERIES = (
    "kvp2p_pull_seconds", "kvp2p_pull_bytes", "kvp2p_pull_descriptors", "kvp2p_claim_rtt_seconds",
    "kvp2p_pull_failures_total", "kvp2p_pulls_verified_total", "kvp2p_pulls_unverified_total",
    "kvp2p_pulls_sums_lost_total", "kvp2p_holds_created_total", "kvp2p_holds_released_total",
    "kvp2p_holds_expired_total", "kvp2p_holds_abandoned_total", "kvp2p_claims_refused_total",
    "kvp2p_side_channel_dropped_total",
    "kvp2p_blocks_held", "kvp2p_oldest_hold_age_seconds", "kvp2p_table_entries",
)  # fmt: skip
#: Panels whose first query must be above zero after pulls (the rest may rightly be 0: failures, expiries, drops).
MOVED = ("TTFT", "Pulls per second", "Bytes pulled", "Integrity", "Holds created", "Routing hit rate")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(model: dict) -> list[tuple[str, str]]:
    """(panel title, query) for every target, Grafana's variables filled in."""
    out = []
    for panel in model["panels"]:
        for target in panel.get("targets", ()):
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], expr))
    return out


def instant_query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def values(result: list[dict]) -> list[float]:
    return [float(sample["value"][1]) for sample in result]


@pytest.fixture(scope="module")
def prometheus(cluster: PDCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Debian's ``prometheus`` (scripts/setup_debian.sh installs it) scraping P and D every second."""
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus is not installed: run scripts/setup_debian.sh (scripts/test.sh does)"
    where = tmp_path_factory.mktemp("prometheus")
    targets = [s.url.removeprefix("http://") for s in (cluster.prefill, cluster.decode)]
    (where / "prometheus.yml").write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": targets}]}],
    }))
    port = free_port()
    log = (where / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={where / 'prometheus.yml'}",
                             f"--storage.tsdb.path={where / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (where / "prometheus.log").read_text()
            time.sleep(0.2)
        # Both engines scraped once before any request: a counter first seen after it moved has no rate.
        while len(values(instant_query(base, "up == 1"))) < len(targets):
            assert time.monotonic() < deadline, instant_query(base, "up")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def test_the_dashboard_is_a_grafana_model_covering_every_connector_series() -> None:
    model = dashboard()
    assert model["uid"] and model["title"] and model["panels"]
    exprs = [expr for _, expr in queries(model)]
    assert len(exprs) >= 20
    for panel in model["panels"]:
        assert panel["type"] == "row" or panel["targets"], panel["title"]
    used = {name for expr in (t["expr"] for p in model["panels"] for t in p.get("targets", ()))
            for name in re.findall(r"\$\{?(\w+)", expr)}
    defined = {v["name"] for v in model["templating"]["list"]} | {"__rate_interval"}
    assert used <= defined, used - defined
    text = " ".join(exprs)
    missing = [s for s in CONNECTOR_SERIES if s.removesuffix("_total") not in text]
    assert not missing, f"connector series not on the dashboard: {missing}"
    for own in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:num_requests_waiting"):
        assert own in text


def test_every_query_returns_data_after_a_few_pd_requests(cluster: PDCluster, prometheus: str) -> None:
    prompts = [prompt_ids(96 + 37 * i, seed=9300 + i) for i in range(3)]
    for prompt in prompts:
        report, _ = through_the_proxy(cluster, prompt)
        assert report["ok"], report
    through_the_proxy(cluster, prompts[0])  # the same prompt again: P finds it in its prefix cache
    pending = queries(dashboard())
    firsts: dict[str, str] = {}
    for title, expr in pending:
        firsts.setdefault(title, expr)
    must_move = {title: expr for title, expr in firsts.items() if title.startswith(MOVED)}
    deadline = time.monotonic() + 30  # scrapes every second; a rate needs two samples around the requests
    while True:
        results = {expr: instant_query(prometheus, expr) for _, expr in pending}  # each query once per round
        empty = [(title, expr) for title, expr in pending if not results[expr]]
        not_moved = [(title, expr) for title, expr in must_move.items()
                     if not any(v > 0 for v in values(results[expr]))]
        if not empty and not not_moved or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not empty, f"queries with no data: {empty}"
    assert not not_moved, f"queries still at zero after pulls: {not_moved}"


def test_a_renamed_metric_or_a_wrong_label_returns_nothing(prometheus: str) -> None:
    """The check above can fail: what a renamed series or a label no engine has would give the dashboard."""
    (_, expr), *_ = [(t, e) for t, e in queries(dashboard()) if t.startswith("Pulls per second")]
    assert instant_query(prometheus, expr)
    assert not instant_query(prometheus, expr.replace("kvp2p_pull_seconds_count", "kvp2p_pull_second_count"))
    assert not instant_query(prometheus, expr.replace('model_name=~".*"', 'model_name=~"another-model"'))
