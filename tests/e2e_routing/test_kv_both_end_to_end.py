"""Issue 46 item 3: the connector stays correct on every path the proxy's placement can take, with real engines.

The package's two P engines run as ``kv_both`` (conftest.py), so each can prefill for the other and decode what
the other prefilled. Checked here, every answer against one instance's (greedy, logprobs within float noise):

* an instance that is P for one request and D for another at the same time (each holds a prompt while it pulls
  another's from the other), directly and through ``vllm-kvp2p-proxy --kv-both --disaggregate always``; a
  corrupted pull changes the answer (the comparison can fail);
* a request computed where it decodes (``--disaggregate never``, and ``auto`` below its threshold) leaves nothing
  held on any instance, where the same prompt through ``always`` creates a hold (the counter can move);
* the prefix cache across paths: a prompt computed locally and then pulled for is found cached on D; a prompt P
  holds and then sent to P itself without params is served from the held blocks, and the hold still ends when
  its D pulls, or as soon as the proxy abandons it (not at the 30 s hold timeout).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.helpers import LOGPROB_TOL, completion_body, max_logprob_gap, post, prompt_ids, settle
from tests.e2e_routing.conftest import RoutingCluster
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.proxy.hold_abandon import HoldAbandoner
from vllm_kvp2p.testing.cluster import ProxyProcess
from vllm_kvp2p.testing.server import VllmServer
from vllm_kvp2p.testing.sse import sse_lines

#: Below the proxies' --disaggregate-threshold (auto computes it where it decodes) and above it (P/D).
SHORT, LONG = 40, 100
THRESHOLD = "64"
#: The engines' hold timeout is 30 s (conftest.py): a hold ended within this was ended by a pull or an abandon.
SETTLE_S = 8.0


@pytest.fixture(scope="module")
def both(routing_cluster: RoutingCluster, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[dict[str, ProxyProcess]]:
    """One proxy per --disaggregate mode in front of the two kv_both engines."""
    logs = tmp_path_factory.mktemp("kv-both-proxies")
    urls = [p.url for p in routing_cluster.producers]
    started: dict[str, ProxyProcess] = {}
    try:
        for mode in ("always", "never", "auto"):
            started[mode] = ProxyProcess.start([], [], logs / f"{mode}.log", extra_args=(
                "--kv-both", *urls, "--disaggregate", mode, "--disaggregate-threshold", THRESHOLD))
        yield started
    finally:
        for proxy in started.values():
            proxy.stop()


def single(cluster: RoutingCluster, prompt: list[int]) -> dict[str, Any]:
    """One instance's answer (its own prefill, nothing cached from other tests)."""
    return post(cluster.producers[0].url + "/v1/completions", completion_body(prompt, cache_salt="single-instance"))


def prefill_on(server: VllmServer, prompt: list[int]) -> dict[str, Any]:
    out = post(server.url + "/v1/completions",
               {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    return out["kv_transfer_params"]


def decode_on(server: VllmServer, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    """D's answer; its pull report, when it pulled anything, says the pull succeeded."""
    out = post(server.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
    report = (out.get("kv_transfer_params") or {}).get(PULL_REPORT_KEY)
    assert report is None or report["ok"], report
    return out


def counter(servers: list[VllmServer], name: str) -> float:
    return sum(s.metric(name) for s in servers)


def nothing_held(cluster: RoutingCluster) -> None:
    held = settle(lambda: counter(cluster.producers, "vllm:kvp2p_blocks_held"), 0.0, SETTLE_S)
    assert held == 0.0, f"{held} blocks still held {SETTLE_S} s after the last request (the hold timeout is 30 s)"


def test_each_instance_is_p_and_d_of_the_other_at_once(routing_cluster: RoutingCluster) -> None:
    p0, p1 = routing_cluster.producers
    x, y, w, z = (prompt_ids(LONG, seed) for seed in (4601, 4602, 4603, 4604))
    held_x, held_y, held_w = prefill_on(p0, x), prefill_on(p1, y), prefill_on(p1, w)
    assert counter([p0], "vllm:kvp2p_blocks_held") > 0 and counter([p1], "vllm:kvp2p_blocks_held") > 0
    # p0 decodes y (pulled from p1) while it holds x; p1 decodes x while it holds w; both at once.
    with ThreadPoolExecutor(2) as pool:
        got_y = pool.submit(decode_on, p0, y, held_y)
        got_x = pool.submit(decode_on, p1, x, held_x)
        answers = {tuple(y): got_y.result(), tuple(x): got_x.result()}
    answers[tuple(w)] = decode_on(p0, w, held_w)
    for prompt, out in answers.items():
        gap = max_logprob_gap(out, single(routing_cluster, list(prompt)))
        assert gap <= LOGPROB_TOL, gap
    nothing_held(routing_cluster)
    # The comparison can fail: a pull changed after it landed (D's test hook) gives another answer.
    corrupted = post(p1.url + "/v1/completions",
                     completion_body(z, kv_transfer_params={**prefill_on(p0, z), "kvp2p_test_corrupt": True}))
    assert corrupted["kv_transfer_params"][PULL_REPORT_KEY]["ok"]
    assert max_logprob_gap(corrupted, single(routing_cluster, z)) > 100 * LOGPROB_TOL
    nothing_held(routing_cluster)


def stream_text(url: str, prompt: list[int]) -> tuple[str, httpx.Headers]:
    with httpx.stream("POST", url + "/v1/completions", json=completion_body(prompt, stream=True, logprobs=None),
                      timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in sse_lines(r) if line.startswith("data: {")]
        return "".join(e["choices"][0]["text"] for e in events if e.get("choices")), r.headers


@pytest.mark.parametrize(("mode", "length", "path"), [
    ("always", SHORT, "pd"), ("always", LONG, "pd"), ("never", LONG, "local"), ("auto", SHORT, "local"),
    ("auto", LONG, "pd"),
])
def test_every_path_answers_as_one_instance(routing_cluster: RoutingCluster, both: dict[str, ProxyProcess],
                                            mode: str, length: int, path: str) -> None:
    seed = 4700 + 10 * ("always", "never", "auto").index(mode) + length  # a prompt no engine has cached
    prompt, streamed = prompt_ids(length, seed), prompt_ids(length, seed + 1000)
    url = both[mode].url
    r = httpx.post(url + "/v1/completions", json=completion_body(prompt), timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvp2p-path"].startswith(f"{path};"), r.headers["x-kvp2p-path"]
    if path == "pd":
        assert r.headers["x-kvp2p-prefill-instance"] != r.headers["x-kvp2p-decode-instance"]
        assert r.json()["kv_transfer_params"][PULL_REPORT_KEY]["ok"]
    else:
        assert "x-kvp2p-prefill-instance" not in r.headers
    gap = max_logprob_gap(r.json(), single(routing_cluster, prompt))
    assert gap <= LOGPROB_TOL, gap
    text, headers = stream_text(url, streamed)
    assert headers["x-kvp2p-path"].startswith(f"{path};")
    assert text == single(routing_cluster, streamed)["choices"][0]["text"]
    nothing_held(routing_cluster)


def test_computed_where_it_decodes_leaves_nothing_held(routing_cluster: RoutingCluster,
                                                      both: dict[str, ProxyProcess]) -> None:
    engines = routing_cluster.producers
    created = counter(engines, "vllm:kvp2p_holds_created_total")
    for mode, length in (("never", LONG), ("never", SHORT), ("auto", SHORT)):
        r = httpx.post(both[mode].url + "/v1/completions", json=completion_body(prompt_ids(length, 4630)),
                       timeout=120)
        assert r.status_code == 200 and r.headers["x-kvp2p-path"].startswith("local;")
    assert counter(engines, "vllm:kvp2p_holds_created_total") == created
    assert counter(engines, "vllm:kvp2p_blocks_held") == 0
    # The control: the same prompt through P/D creates a hold (the counter can move), ended by D's pull.
    r = httpx.post(both["always"].url + "/v1/completions", json=completion_body(prompt_ids(LONG, 4630)), timeout=120)
    assert r.status_code == 200
    assert settle(lambda: counter(engines, "vllm:kvp2p_holds_created_total"), created + 1, SETTLE_S) == created + 1
    nothing_held(routing_cluster)


def test_the_prefix_cache_works_across_paths(routing_cluster: RoutingCluster) -> None:
    p0, p1 = routing_cluster.producers
    hits = "vllm:prefix_cache_hits_total"
    # Computed locally on p0, then prefilled on p1 and pulled by p0: p0 finds the prompt's blocks cached.
    q = prompt_ids(LONG, 4640)
    post(p0.url + "/v1/completions", completion_body(q))
    before = p0.metric(hits)
    out = decode_on(p0, q, prefill_on(p1, q))
    assert p0.metric(hits) - before >= 96, "p0 computed q before: its 3 full blocks are cached"
    assert PULL_REPORT_KEY not in (out.get("kv_transfer_params") or {}), "nothing to pull: p0 has every full block"
    assert max_logprob_gap(out, single(routing_cluster, q)) <= LOGPROB_TOL
    # Held by p0 for a D, then sent to p0 itself without params: served from the held blocks; the hold still
    # ends when its D pulls.
    r = prompt_ids(LONG, 4641)
    held = prefill_on(p0, r)
    before = p0.metric(hits)
    local = post(p0.url + "/v1/completions", completion_body(r))
    assert p0.metric(hits) - before >= 96
    assert max_logprob_gap(local, single(routing_cluster, r)) <= LOGPROB_TOL
    assert max_logprob_gap(decode_on(p1, r, held), local) <= LOGPROB_TOL
    nothing_held(routing_cluster)
    # Held by p0, then computed elsewhere without params (the proxy placed it locally on p1): the proxy's
    # abandon ends the hold at once, not P's hold timeout.
    s = prompt_ids(LONG, 4642)
    held = prefill_on(p0, s)
    post(p1.url + "/v1/completions", completion_body(s))
    abandoned = p0.metric("vllm:kvp2p_holds_abandoned_total")
    abandoner = HoldAbandoner()
    try:
        abandoner.abandon(held)
        assert settle(lambda: p0.metric("vllm:kvp2p_holds_abandoned_total"), abandoned + 1, SETTLE_S) == abandoned + 1
    finally:
        abandoner.close()
    nothing_held(routing_cluster)
