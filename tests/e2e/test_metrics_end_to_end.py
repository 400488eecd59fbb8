"""The connector's metrics on the real engines' /metrics (vLLM's own connector-stats path, its labels) and in
vLLM's periodic "KV Transfer metrics" log line: each figure moves by what the requests did, and only then."""

from __future__ import annotations

import time

import pytest

from tests.e2e.helpers import Cluster, completion_body, post, prompt_ids, settle, wait_kv_idle
from tests.e2e.test_hostile_params import fabricated_params
from vllm_kvp2p.testing.soak_tables import nudge

pytestmark = pytest.mark.e2e

AGE_PAUSE_S = 2.0  # how long a hold is left waiting between two readings of its age


def test_a_pd_request_moves_the_pull_and_hold_figures(cluster: Cluster) -> None:
    d, p = cluster.decode, cluster.prefill
    pulls, created, released = (d.metric("vllm:kvp2p_pull_seconds_count"),
                                p.metric("vllm:kvp2p_holds_created_total"),
                                p.metric("vllm:kvp2p_holds_released_total"))
    pulled_bytes = d.metric("vllm:kvp2p_pull_bytes_sum")
    descriptors, claims = d.metric("vllm:kvp2p_pull_descriptors_count"), d.metric("vllm:kvp2p_claim_rtt_seconds_count")
    descriptors_sum = d.metric("vllm:kvp2p_pull_descriptors_sum")
    prompt = prompt_ids(5 * 32 + 3, seed=9191)
    out = post(cluster.proxy_url + "/v1/completions", completion_body(prompt))
    report = out["kv_transfer_params"]["kvp2p_pull"]
    assert report["ok"], report
    assert settle(lambda: d.metric("vllm:kvp2p_pull_seconds_count"), pulls + 1) == pulls + 1
    assert d.metric("vllm:kvp2p_pull_bytes_sum") - pulled_bytes == report["bytes"]
    # One pull: one observation of its descriptors (as many as its report says) and one claim (one P rank).
    assert d.metric("vllm:kvp2p_pull_descriptors_count") - descriptors == 1
    assert d.metric("vllm:kvp2p_pull_descriptors_sum") - descriptors_sum == report["descriptors"] >= 1, report
    assert d.metric("vllm:kvp2p_claim_rtt_seconds_count") - claims == 1
    assert settle(lambda: p.metric("vllm:kvp2p_holds_created_total"), created + 1) == created + 1
    assert settle(lambda: p.metric("vllm:kvp2p_holds_released_total"), released + 1) == released + 1
    # vLLM's labels: the model and the engine.
    keys = [k for k in d.metrics() if k.startswith("vllm:kvp2p_pull_seconds_count")]
    assert keys and all('model_name="' in k and 'engine="' in k for k in keys), keys


def test_blocks_held_gauge_rises_with_a_hold_and_returns_to_zero(cluster: Cluster) -> None:
    p = cluster.prefill
    assert wait_kv_idle(p) == 0.0
    assert settle(lambda: p.metric("vllm:kvp2p_blocks_held"), 0.0) == 0.0
    prompt = prompt_ids(3 * 32, seed=9292)
    params = post(p.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                              "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]
    held = settle(lambda: p.metric("vllm:kvp2p_blocks_held"), 3.0)
    assert held == 3.0, held  # the prompt's 3 blocks, waiting for D
    age = p.metric("vllm:kvp2p_oldest_hold_age_seconds")  # exported (absent fails), and the age of a fresh hold
    assert 0.0 <= age < 60.0, age
    # The hold waits; the gauge moves when P steps, so a plain request of P's own (no hold) makes it step: the age
    # it then shows is that of the same hold, older by at least the pause (a gauge stuck at 0 fails here).
    time.sleep(AGE_PAUSE_S)
    nudge(p)
    aged = p.metric("vllm:kvp2p_oldest_hold_age_seconds")
    assert AGE_PAUSE_S <= aged - age < 60.0, (age, aged)
    assert p.metric("vllm:kvp2p_blocks_held") == 3.0  # the nudge held nothing
    out = post(cluster.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
    assert out["kv_transfer_params"]["kvp2p_pull"]["ok"]
    assert settle(lambda: p.metric("vllm:kvp2p_blocks_held"), 0.0) == 0.0


def test_invalid_params_count_once_by_reason(cluster: Cluster) -> None:
    d = cluster.decode
    name = "vllm:kvp2p_pull_failures_total"
    before = d.metric(name, reason="invalid_params")
    others = d.metric(name) - before
    prompt = prompt_ids(96, seed=9393)
    out = post(d.url + "/v1/completions",
               completion_body(prompt, kv_transfer_params=fabricated_params(prompt, 14600, tp_size=-3)))
    assert out["kv_transfer_params"]["kvp2p_pull"]["failure"] == "invalid_params"
    assert settle(lambda: d.metric(name, reason="invalid_params"), before + 1) == before + 1
    assert d.metric(name) - d.metric(name, reason="invalid_params") == others  # no other reason moved


def test_the_periodic_log_line_reports_the_pulls(cluster: Cluster) -> None:
    """vLLM logs its stats every 10 s (VLLM_LOG_STATS_INTERVAL); the pulls above are in one of those lines."""
    def lines() -> list[str]:
        log = cluster.decode.log_path.read_text(errors="replace")
        return [line for line in log.splitlines() if "KV Transfer metrics:" in line and "Pulls=" in line]

    deadline = time.monotonic() + 25
    while not lines() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert lines(), cluster.decode.log_path
