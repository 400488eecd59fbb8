"""The proxy of ordinary instances (``vllm-kvp2p-proxy --instances``): no P step, each request goes whole to the
instance routing chooses, by outstanding requests as in P/D mode. What benchmarks/bench_goodput.py puts two
ordinary instances behind, to compare P/D with them. Stub upstreams from proxy_harness.py."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest

from tests.unit import proxy_harness as harness
from tests.unit.proxy_harness import CLIENT_TIMEOUT, COMPLETION, Stub, sse_events
from vllm_kvp2p.proxy.cli import build_parser, resolve_instances

# proxy_harness.py's fixtures: its stub engines (their own, for this module, reset before each test) and proxies.
stubs = harness.stubs
make_proxy = harness.make_proxy
_reset_stubs = harness._reset_stubs


def test_a_request_goes_whole_to_one_instance_without_a_p_step(stubs: dict[str, Stub],
                                                               make_proxy: Callable[..., str]) -> None:
    url = make_proxy([], [stubs["D0"].url])
    resp = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert resp.status_code == 200, resp.text
    (got,) = stubs["D0"].received
    assert got["body"] == COMPLETION  # as the client sent it: no kv_transfer_params, its own max_tokens
    assert "x-kvp2p-prefill-instance" not in resp.headers
    assert resp.headers["x-kvp2p-decode-instance"] == stubs["D0"].url
    assert not stubs["P0"].received and not stubs["P1"].received
    with httpx.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True},
                      timeout=CLIENT_TIMEOUT) as s:
        assert b"".join(s.iter_bytes()) == b"".join(sse_events("D0"))


def test_concurrent_requests_go_to_the_least_busy_instance(stubs: dict[str, Stub],
                                                           make_proxy: Callable[..., str]) -> None:
    url = make_proxy([], [stubs["D0"].url, stubs["D1"].url])
    for s in stubs.values():
        s.delay_s = 0.3  # requests stay outstanding, so concurrent ones see each other's load
    codes: list[int] = []
    threads = [threading.Thread(target=lambda: codes.append(
        httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT).status_code)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert codes == [200] * 4
    counts = [len(stubs[n].received) for n in ("D0", "D1")]
    assert sum(counts) == 4 and min(counts) >= 1, counts
    health = httpx.get(url + "/health", params={"probe": "true"}, timeout=CLIENT_TIMEOUT)
    assert health.status_code == 200 and health.json()["prefill"] == [], health.json()
    assert [e["served"] for e in health.json()["decode"]] == counts


def test_instances_exclude_the_p_and_d_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(["--instances", "http://a:1", "http://b:2"])
    assert resolve_instances(args, parser) == ([], ["http://a:1", "http://b:2"])
    for extra in (["--prefill", "http://p:1"], ["--decode", "http://d:1"], ["--prefill-kv-events", "tcp://p:5"]):
        with pytest.raises(SystemExit):
            resolve_instances(parser.parse_args(["--instances", "http://a:1", *extra]), parser)
