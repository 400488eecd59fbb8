"""Request lifecycle on real engines: prefix-cache hits on D, client cancellation, a P that lets its hold expire,
and a P that freezes and is killed while D is pulling from it. After each, the answer is right (D recomputes what
it could not pull, since the session's D runs with kv_load_failure_policy=recompute), D stays up, and both sides'
KV usage returns to idle."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    LOGPROB_TOL,
    baseline,
    completion_body,
    max_logprob_gap,
    metric,
    post,
    prompt_ids,
    wait_kv_idle,
)
from tests.support.fault_bounds import FROZEN_P_S, KILLED_P_S, assert_within_doc_bound
from vllm_kvp2p.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.cluster import PDCluster as Cluster
from vllm_kvp2p.testing.cluster import start_producer
from vllm_kvp2p.testing.server import VllmServer

pytestmark = pytest.mark.e2e

HOLD_TIMEOUT = 3.0


def tokens_by_source(cluster: Cluster) -> dict[str, float]:
    return {s: metric(cluster.decode, "vllm:prompt_tokens_by_source_total", source=s)
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def prefill_on(server: VllmServer, prompt: list[int]) -> dict[str, Any]:
    out = post(server.url + "/v1/completions",
               {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    return out["kv_transfer_params"]


def test_same_prompt_twice_second_is_a_full_local_hit(cluster: Cluster) -> None:
    prompt = prompt_ids(300, seed=31)
    first = post(cluster.proxy_url + "/v1/completions", completion_body(prompt))
    before = tokens_by_source(cluster)
    second = post(cluster.proxy_url + "/v1/completions", completion_body(prompt))
    moved = delta(tokens_by_source(cluster), before)

    single = baseline(cluster, prompt)
    assert max_logprob_gap(first, single) <= LOGPROB_TOL
    assert max_logprob_gap(second, single) <= LOGPROB_TOL
    # All 9 full blocks came from D's own cache; the 12-token tail was computed locally, nothing was pulled.
    assert moved == {"local_cache_hit": 288, "local_compute": 12, "external_kv_transfer": 0}
    assert PULL_REPORT_KEY not in (second.get("kv_transfer_params") or {})
    assert wait_kv_idle(cluster.prefill) == 0.0  # P was released although D pulled nothing


def test_shared_prefix_different_tails_pulls_only_the_tail(cluster: Cluster) -> None:
    prefix = prompt_ids(8 * BLOCK_SIZE, seed=41)
    a = prefix + prompt_ids(100, seed=42)
    b = prefix + prompt_ids(100, seed=43)
    post(cluster.proxy_url + "/v1/completions", completion_body(a))
    before = tokens_by_source(cluster)
    out = post(cluster.proxy_url + "/v1/completions", completion_body(b))
    moved = delta(tokens_by_source(cluster), before)

    assert max_logprob_gap(out, baseline(cluster, b)) <= LOGPROB_TOL
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert report["ok"] and report["blocks"] == -(-len(b) // BLOCK_SIZE) - 8
    assert moved == {"local_cache_hit": 8 * BLOCK_SIZE, "local_compute": 0, "external_kv_transfer": 100}


def test_client_cancelling_mid_stream_leaks_nothing(cluster: Cluster) -> None:
    prompt = prompt_ids(200, seed=51)
    with httpx.stream("POST", cluster.proxy_url + "/v1/completions",
                      json={**completion_body(prompt), "max_tokens": 1500, "stream": True, "logprobs": None},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the client goes away after the first token
    assert wait_kv_idle(cluster.decode) == 0.0
    assert wait_kv_idle(cluster.prefill) == 0.0
    again = post(cluster.proxy_url + "/v1/completions", completion_body(prompt))
    assert max_logprob_gap(again, baseline(cluster, prompt)) <= LOGPROB_TOL


@pytest.fixture(scope="module")
def spare_prefill(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A second P whose holds expire after HOLD_TIMEOUT seconds; the last test kills it."""
    server = start_producer(tiny_model_dir, tmp_path_factory.mktemp("spare") / "prefill.log",
                            env={"VLLM_KVP2P_HOLD_TIMEOUT": str(HOLD_TIMEOUT), "VLLM_KVP2P_TRANSFER_TIMEOUT": "5"})
    try:
        server.start().wait_ready()
        yield server
    finally:
        server.stop()


def test_claim_after_hold_expired_is_refused_and_d_recomputes(cluster: Cluster, spare_prefill: VllmServer) -> None:
    prompt = prompt_ids(150, seed=61)
    params = prefill_on(spare_prefill, prompt)
    assert wait_kv_idle(spare_prefill, timeout=HOLD_TIMEOUT + 10) == 0.0  # P expired the hold and freed the blocks
    before = tokens_by_source(cluster)
    out = post(cluster.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
    moved = delta(tokens_by_source(cluster), before)

    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and "refused" in report["reason"] and "expired" in report["reason"]
    assert max_logprob_gap(out, baseline(cluster, prompt)) <= LOGPROB_TOL  # recomputed, not read from freed blocks
    assert moved["local_compute"] >= len(prompt) - BLOCK_SIZE
    assert wait_kv_idle(cluster.decode) == 0.0




def test_frozen_prefill_costs_one_side_channel_timeout_and_is_used_again_once_it_thaws(
        cluster: Cluster, spare_prefill: VllmServer) -> None:
    prompt = prompt_ids(200, seed=81)
    params = prefill_on(spare_prefill, prompt)
    pgid = os.getpgid(spare_prefill.pid)
    os.killpg(pgid, signal.SIGSTOP)  # frozen: its side channel still accepts connections, but never answers
    try:
        t0 = time.monotonic()
        out = post(cluster.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
        took = time.monotonic() - t0
    finally:
        os.killpg(pgid, signal.SIGCONT)
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and report["failure"] == "unreachable", report
    assert_within_doc_bound(took, FROZEN_P_S, "a frozen P")  # before: 12.2 s (the claim's timeout, then the release's)
    assert max_logprob_gap(out, baseline(cluster, prompt)) <= LOGPROB_TOL
    # Thawed: the next request from it pulls again (the probe of the suspect P is answered).
    prompt = prompt_ids(200, seed=82)
    out = post(cluster.decode.url + "/v1/completions",
               completion_body(prompt, kv_transfer_params=prefill_on(spare_prefill, prompt)))
    assert out["kv_transfer_params"][PULL_REPORT_KEY]["ok"], out["kv_transfer_params"]
    assert max_logprob_gap(out, baseline(cluster, prompt)) <= LOGPROB_TOL


def test_prefill_killed_while_decode_pulls(cluster: Cluster, spare_prefill: VllmServer) -> None:
    prompt = prompt_ids(220, seed=71)
    params = prefill_on(spare_prefill, prompt)
    later_prompt = prompt_ids(160, seed=72)
    later_params = prefill_on(spare_prefill, later_prompt)  # D gets these only after P is dead
    pgid = os.getpgid(spare_prefill.pid)
    os.killpg(pgid, signal.SIGSTOP)  # P freezes: D's claim hangs on it
    result: dict[str, Any] = {}

    def decode() -> None:
        t0 = time.monotonic()
        result["out"] = post(cluster.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
        result["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=decode)
    thread.start()
    time.sleep(1.0)
    os.killpg(pgid, signal.SIGKILL)  # ...then dies with the pull in flight
    thread.join(timeout=60)
    assert not thread.is_alive(), "D hung on a dead P"

    report = result["out"]["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"]
    # Frozen while D's claim waits on it, then killed: no worse than a frozen P.
    assert_within_doc_bound(result["seconds"], FROZEN_P_S, "a P frozen, then killed, mid-claim")
    assert max_logprob_gap(result["out"], baseline(cluster, prompt)) <= LOGPROB_TOL
    # A request for the dead P: its port refuses, D answers at once (before: 10.1 s).
    t0 = time.monotonic()
    out = post(cluster.decode.url + "/v1/completions", completion_body(later_prompt, kv_transfer_params=later_params))
    took = time.monotonic() - t0
    assert not out["kv_transfer_params"][PULL_REPORT_KEY]["ok"]
    assert_within_doc_bound(took, KILLED_P_S, "a killed P")
    assert max_logprob_gap(out, baseline(cluster, later_prompt)) <= LOGPROB_TOL
    assert httpx.get(cluster.decode.url + "/health", timeout=5).status_code == 200
    assert wait_kv_idle(cluster.decode) == 0.0
