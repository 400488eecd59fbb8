"""Requests, baselines and metrics shared by the end-to-end tests."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from vllm_kvp2p.testing.cluster import PDCluster as Cluster
from vllm_kvp2p.testing.server import VllmServer

BLOCK_SIZE = 32  # vllm_kvp2p.testing.server.DEFAULT_ARGS
VOCAB = 512
NUM_LAYERS, KV_HEADS, HEAD_SIZE, DTYPE_BYTES = 2, 2, 64, 4
BYTES_PER_BLOCK = NUM_LAYERS * KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * DTYPE_BYTES  # K and V, all layers
MAX_TOKENS = 12
LOGPROB_TOL = 1e-4  # float32 noise between a one-shot prefill and D's recompute of the last prompt token


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    r = httpx.post(url, json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def completion_body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1, **extra}


def baseline(cluster: Cluster, prompt: list[int]) -> dict[str, Any]:
    return post(cluster.prefill.url + "/v1/completions", completion_body(prompt, cache_salt="single-instance"))


def tokens_and_logprobs(resp: dict[str, Any]) -> tuple[list[str], list[float]]:
    lp = resp["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def max_logprob_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    ta, la = tokens_and_logprobs(a)
    tb, lb = tokens_and_logprobs(b)
    if ta != tb:
        return math.inf
    return max(abs(x - y) for x, y in zip(la, lb))


def metric(server: VllmServer, name: str, **labels: str) -> float:
    return server.metric(name, **labels)


def settle(read: Callable[[], float], expected: float, timeout: float = 30.0) -> float:
    """``read()`` once it equals ``expected`` (or its last value after ``timeout``; the default: vLLM hands stats
    to its logger every engine step, and the engines here step while they work)."""
    deadline = time.monotonic() + timeout
    value = read()
    while value != expected and time.monotonic() < deadline:
        time.sleep(0.2)
        value = read()
    return value


def wait_kv_idle(server: VllmServer, timeout: float = 30.0) -> float:
    """P's KV usage after its holds are released (vLLM reports 0.0 when no block is held)."""
    deadline = time.monotonic() + timeout
    usage = metric(server, "vllm:kv_cache_usage_perc")
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        usage = metric(server, "vllm:kv_cache_usage_perc")
    return usage


PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def prefill_then_decode(cluster: Cluster, prompt: list[int], **extra: object) -> dict[str, Any]:
    """P prefills (one token, ``do_remote_decode``), then D finishes the request with P's params plus ``extra`` (the
    test hooks' keys), without the proxy: D's answer, its pull report under PULL_REPORT_KEY."""
    p = post(cluster.prefill.url + "/v1/completions",
             {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    return post(cluster.decode.url + "/v1/completions",
                completion_body(prompt, kv_transfer_params={**p["kv_transfer_params"], **extra}))


def assert_in_flight_change_caught(cluster: Cluster, prompt: list[int]) -> None:
    """D with ``integrity=full`` and the test hooks: one byte changed in what D read, before its check (the
    ``"in_flight"`` hook, as a faulty link would), fails the load as ``corrupted``, says so in D's log, and D
    recomputes the single instance's answer."""
    from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY

    out = prefill_then_decode(cluster, prompt, kvp2p_test_corrupt="in_flight")
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and report["failure"] == "corrupted", report
    assert "differ from P's" in report["reason"], report
    assert max_logprob_gap(out, baseline(cluster, prompt)) <= LOGPROB_TOL  # recomputed: the right answer
    log = cluster.decode.log_path.read_text(errors="replace")
    assert "failed (corrupted)" in log and "TEST HOOK: changed the byte" in log


def tokens_by_source(cluster: Cluster) -> dict[str, float]:
    """D's ``vllm:prompt_tokens_by_source_total`` per source: where the prompt tokens of its requests came from."""
    return {s: metric(cluster.decode, "vllm:prompt_tokens_by_source_total", source=s) for s in PROMPT_SOURCES}


def moved_since(cluster: Cluster, before: dict[str, float]) -> dict[str, float]:
    """How many prompt tokens D computed, found cached and loaded since ``before`` (a ``tokens_by_source``)."""
    return {s: v - before[s] for s, v in tokens_by_source(cluster).items()}


def prefill_on(server: VllmServer, prompt: list[int]) -> dict[str, Any]:
    """P's half alone: ``server`` prefills ``prompt`` for a remote decode and returns the params D needs."""
    out = post(server.url + "/v1/completions",
               {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    return out["kv_transfer_params"]


def through_the_proxy(cluster: Cluster, prompt: list[int]) -> tuple[dict[str, Any], dict[str, float]]:
    """One request through the proxy, its answer checked against the single instance (P itself): D's pull report
    and how many of the prompt's tokens D computed and loaded for it."""
    from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY

    before = tokens_by_source(cluster)
    pd = post(cluster.proxy_url + "/v1/completions", completion_body(prompt))
    single = baseline(cluster, prompt)
    assert max_logprob_gap(pd, single) <= LOGPROB_TOL, (tokens_and_logprobs(pd), tokens_and_logprobs(single))
    moved = moved_since(cluster, before)
    return pd["kv_transfer_params"][PULL_REPORT_KEY], moved
