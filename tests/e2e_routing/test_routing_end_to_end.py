"""Routing by what each instance holds, with real engines publishing real KV events (vLLM's ZMQ publisher).

In order (they share the engines and build on each other's caches): a served prompt appears in the proxy's index
on the P that served it; a second prompt with that prefix goes to that P and hits its prefix cache, where the
least-outstanding control sends it to the other P and hits nothing (a salted prompt with that prefix is routed by
load, nothing counted); a text prompt is tokenized by a P and routed alike; after the P evicts, the index follows;
a killed P is skipped after one failed request and routed to again within seconds of its restart, its index
rebuilt from its new publisher. The proxies run with ``--cache-headers`` (conftest.py): the tests read the counts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.helpers import LOGPROB_TOL, baseline, completion_body, max_logprob_gap, prompt_ids
from tests.e2e_routing.conftest import CACHE_HEADERS, HASH_SEED, RoutingCluster
from vllm_kvp2p.proxy.local_tokenizer import LocalTokenizer
from vllm_kvp2p.testing.cluster import ProxyProcess

BLOCK = 32
HITS = "vllm:prefix_cache_hits_total"


def route(url: str, prompt: list[int] | str, **extra: Any) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json=completion_body(prompt, **extra), timeout=120)  # type: ignore[arg-type]
    assert r.status_code == 200, r.text
    return r


def health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/health", timeout=10).json()


def instance(cluster: RoutingCluster, role: str, url: str) -> dict[str, Any]:
    (entry,) = [e for e in health(cluster.proxy_url)[role] if e["url"] == url]
    return entry


def wait_for(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.1)


def by_url(cluster: RoutingCluster, url: str) -> Any:
    (server,) = [s for s in (*cluster.producers, cluster.decode) if s.url == url]
    return server


def test_a_served_prompt_is_indexed_on_the_p_that_served_it(routing_cluster: RoutingCluster) -> None:
    c = routing_cluster
    prompt = prompt_ids(200, seed=1)  # 6 full blocks
    # What each P's index holds already (test_kv_both_end_to_end.py runs on these engines before this module).
    before = {e["url"]: e["cache"]["blocks"] for e in health(c.proxy_url)["prefill"]}
    r = route(c.proxy_url, prompt)
    p_url = r.headers["x-kvp2p-prefill-instance"]
    assert r.headers["x-kvp2p-prefill-cached-tokens"] == "0"
    assert max_logprob_gap(r.json(), baseline(c, prompt)) <= LOGPROB_TOL
    holder = wait_for(lambda: (e := instance(c, "prefill", p_url))["cache"]["blocks"] >= 6 and e, 10, "P's events")
    assert holder["cache"]["hashes_match"] is True  # the proxy's hashes equal the engine's
    (other,) = [e for e in health(c.proxy_url)["prefill"] if e["url"] != p_url]
    assert other["cache"]["blocks"] == before[other["url"]]  # nothing of this prompt indexed on the other P
    # D keeps the blocks it pulled in its prefix cache and says so in its own events.
    d = wait_for(lambda: (e := instance(c, "decode", c.decode.url))["cache"]["blocks"] >= 6 and e, 10, "D's events")
    assert d["cache"]["hashes_match"] is True


def test_same_prefix_goes_to_the_holder_and_hits_its_cache_where_least_outstanding_does_not(
    routing_cluster: RoutingCluster,
) -> None:
    c = routing_cluster
    prefix = prompt_ids(192, seed=2)  # 6 full blocks
    before = {e["url"]: e["cache"]["blocks"] for e in health(c.proxy_url)["prefill"]}
    first = route(c.proxy_url, prefix + prompt_ids(20, seed=3))
    holder = first.headers["x-kvp2p-prefill-instance"]
    wait_for(lambda: instance(c, "prefill", holder)["cache"]["blocks"] >= before[holder] + 6, 10, "prompt indexed")
    hits_before = {p.url: p.metric(HITS) for p in c.producers}
    for k in range(3):
        prompt = prefix + prompt_ids(30, seed=10 + k)
        r = route(c.proxy_url, prompt)
        assert r.headers["x-kvp2p-prefill-instance"] == holder, k
        assert r.headers["x-kvp2p-prefill-cached-tokens"] == str(len(prefix))
        assert r.headers["x-kvp2p-decode-cached-tokens"] == str(len(prefix))  # D pulled that prefix before
        assert max_logprob_gap(r.json(), baseline(c, prompt)) <= LOGPROB_TOL
    gained = {p.url: p.metric(HITS) - hits_before[p.url] for p in c.producers}
    assert gained[holder] >= 3 * len(prefix), gained
    # Another user's salted prompt with that prefix is not looked up under the unsalted hashes (token ids too):
    # routed by load, nothing counted as cached (it was the prefix's length: an oracle through the salt).
    r = route(c.proxy_url, prefix + prompt_ids(30, seed=13), cache_salt="another-user")
    assert [r.headers[f"x-kvp2p-{role}-cached-tokens"] for role in ("prefill", "decode")] == ["0", "0"]

    # Control: least-outstanding alternates, so the same pattern lands every other request on the P without the
    # prefix, which computes it again.
    prefix = prompt_ids(192, seed=4)
    places, hits = [], []
    for k in range(2):
        before = {p.url: p.metric(HITS) for p in c.producers}
        r = route(c.control.url, prefix + prompt_ids(30, seed=20 + k))  # type: ignore[union-attr]
        url = r.headers["x-kvp2p-prefill-instance"]
        places.append(url)
        hits.append(by_url(c, url).metric(HITS) - before[url])
    assert places[0] != places[1] and hits[1] < len(prefix), (places, hits)


def test_text_prompts_are_tokenized_by_a_p_and_routed_by_prefix(routing_cluster: RoutingCluster) -> None:
    c = routing_cluster
    text = " ".join(f"word{i}" for i in range(150))
    first = route(c.proxy_url, text + " first ending")
    holder = first.headers["x-kvp2p-prefill-instance"]
    n = len(c.producers[0].tokenize(text))
    wait_for(lambda: instance(c, "prefill", holder)["cache"]["blocks"] >= n // BLOCK, 10, "the text prompt indexed")
    second = route(c.proxy_url, text + " another ending")
    assert second.headers["x-kvp2p-prefill-instance"] == holder
    assert int(second.headers["x-kvp2p-prefill-cached-tokens"]) >= (n // BLOCK - 1) * BLOCK
    assert health(c.proxy_url)["routing"]["tokenize_failures"] == 0


def test_a_proxy_with_the_engines_tokenizer_gets_their_tokens_without_asking(
    routing_cluster: RoutingCluster, tmp_path: Path
) -> None:
    """``--tokenizer``: the proxy's tokens for text prompts equal the engine's ``/tokenize`` (with and without
    special tokens, odd text included), and a proxy using them routes a shared text prefix to its holder with no
    round trip to a P."""
    c = routing_cluster
    p = c.producers[0]
    local = LocalTokenizer(str(p.model_path))
    texts = ("The cat sat on the mat.", "  two  spaces\tand a tab\n", "ünïcødé ✓ 🙂", " ".join(["x"] * 900))
    for text in texts:
        for special in (True, False):
            assert local.tokens({"prompt": text, "add_special_tokens": special}) == p.tokenize(
                text, add_special_tokens=special), (text, special)
    proxy = ProxyProcess.start(
        [s.url for s in c.producers], [c.decode.url], tmp_path / "local-tokenizer-proxy.log",
        extra_args=("--prefill-kv-events", *(c.endpoints(s) for s in c.producers),
                    "--decode-kv-events", c.endpoints(c.decode), "--hash-seed", HASH_SEED,
                    "--tokenizer", str(p.model_path), *CACHE_HEADERS))
    try:
        text = " ".join(f"item{i}" for i in range(150))
        n = len(p.tokenize(text))
        holder = route(proxy.url, text + " one ending").headers["x-kvp2p-prefill-instance"]
        wait_for(lambda: [e for e in health(proxy.url)["prefill"] if e["url"] == holder][0]["cache"]["blocks"]
                 >= n // BLOCK, 10, "the text prompt indexed")
        second = route(proxy.url, text + " another ending")
        assert second.headers["x-kvp2p-prefill-instance"] == holder
        assert int(second.headers["x-kvp2p-prefill-cached-tokens"]) >= (n // BLOCK - 1) * BLOCK
        routing = health(proxy.url)["routing"]
        assert (routing["tokenized_locally"], routing["tokenized_by_p"], routing["tokenize_failures"]) == (2, 0, 0)
    finally:
        proxy.stop()


def test_the_index_follows_evictions(routing_cluster: RoutingCluster) -> None:
    c = routing_cluster
    p = c.producers[0]
    prompt = prompt_ids(160, seed=5)  # 5 blocks
    p.completion(prompt, max_tokens=1)  # served by P0 directly: cached there, and published
    keys_held = wait_for(lambda: instance(c, "prefill", p.url)["cache"]["blocks"], 10, "P0 indexed")
    assert keys_held >= 5
    # 64 blocks in all: a dozen other prompts of 9 blocks evict the oldest, ours among them.
    for k in range(12):
        p.completion(prompt_ids(300, seed=100 + k), max_tokens=1)
    # 5 + 108 blocks stored: without the removals applied the index would hold far more than the 64 P has.
    entry = wait_for(lambda: 48 <= (e := instance(c, "prefill", p.url))["cache"]["blocks"] <= 64 and e, 10, "removals")
    assert entry["cache"]["resets"] == 0
    # The proxy no longer counts the evicted prefix on P0.
    r = route(c.proxy_url, prompt + prompt_ids(40, seed=6))
    assert r.headers["x-kvp2p-prefill-cached-tokens"] == "0"


def test_a_killed_p_is_skipped_after_one_failed_request_and_used_again_after_its_restart(
    routing_cluster: RoutingCluster,
) -> None:
    c = routing_cluster
    victim, survivor = c.producers[1], c.producers[0]
    victim.kill()
    places = []
    for k in range(6):
        r = route(c.proxy_url, prompt_ids(70, seed=300 + k))
        places.append(r.headers["x-kvp2p-prefill-instance"])
    assert places == [survivor.url] * 6  # the first one that tried the victim was retried on the survivor
    h = health(c.proxy_url)
    (dead,) = [e for e in h["prefill"] if e["url"] == victim.url]
    assert dead["state"] == "skipped" and dead["failures"] == 1, dead  # one failed request, then skipped
    assert h["prefill_retries"] <= 1

    victim.start()
    victim.wait_ready()
    back = time.monotonic()
    wait_for(lambda: instance(c, "prefill", victim.url)["state"] == "up", 5, "the restarted P probed back")
    seen = []
    for k in range(4):
        seen.append(route(c.proxy_url, prompt_ids(70, seed=400 + k)).headers["x-kvp2p-prefill-instance"])
    assert victim.url in seen, seen
    assert time.monotonic() - back < 30
    # Its new publisher's events reach the index again (ZMQ resubscribes; seq restarted at 0).
    wait_for(lambda: instance(c, "prefill", victim.url)["cache"]["blocks"] >= 2, 10, "the restarted P's events")
