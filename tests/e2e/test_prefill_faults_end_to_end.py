"""A P that fails D mid-request, on real engines: its hold expires before D claims, it freezes (SIGSTOP) while D
asks it, it is killed while D's claim waits on it. Each time D answers right (the session's D runs with
kv_load_failure_policy=recompute) within the bound docs/reliability.md states, stays up, and uses a P again once it
answers; both sides' KV usage returns to idle. The P is a second one beside the session's (this module kills it).

The newest vLLM runs this module only (tests/conftest.py, NEWEST_VLLM_ONLY): the connector's timers and lifecycle;
D's side of it, a failed load that vLLM recomputes, runs on vLLM 0.23 in test_hostile_params.py."""

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
    moved_since,
    post,
    prefill_on,
    prompt_ids,
    tokens_by_source,
    wait_kv_idle,
)
from tests.support.fault_bounds import FROZEN_P_S, KILLED_P_S, assert_within_doc_bound
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.cluster import PDCluster as Cluster
from vllm_kvp2p.testing.cluster import start_producer
from vllm_kvp2p.testing.server import VllmServer

pytestmark = pytest.mark.e2e

HOLD_TIMEOUT = 3.0


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
    moved = moved_since(cluster, before)

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
