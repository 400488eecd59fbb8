"""The P/D proxy, run for real (uvicorn on 127.0.0.1) against stub OpenAI-style upstreams (tests/unit/proxy_harness.py):
each request's way through P then D, streamed or not, the errors of either told to the client, /health and
/v1/models, the console script. The prefill retry is in test_proxy_prefill_retry.py, what clients may send in
test_proxy_client_input.py, the pool and the command line in test_proxy_pool_and_cli.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.unit import proxy_harness as harness
from tests.unit.proxy_harness import (
    CLIENT_TIMEOUT,
    COMPLETION,
    Stub,
    assert_openai_error,
    closed_port_url,
    one_pd,
    sse_events,
    stub_json_bytes,
)
from vllm_kvp2p.proxy import PREFILL_KV_TRANSFER_PARAMS

# Generous per-test caps: the bounds that matter are asserted inside the tests; these only stop a hang.
pytestmark = pytest.mark.timeout(30)

# proxy_harness's fixtures: its stub engines (this module's own, reset before each test) and proxies.
stubs = harness.stubs
_reset_stubs = harness._reset_stubs
make_proxy = harness.make_proxy


def test_completions_non_stream(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    t0 = time.monotonic()
    r = httpx.post(
        url + "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer k"}, timeout=CLIENT_TIMEOUT
    )
    took_ms = (time.monotonic() - t0) * 1000.0
    assert r.status_code == 200, r.text
    (p_req,) = stubs["P0"].received
    (d_req,) = stubs["D0"].received
    pb, db = p_req["body"], d_req["body"]
    # P: one token, not streamed, do_remote_decode, min_tokens dropped.
    assert pb["max_tokens"] == 1 and pb["stream"] is False and "min_tokens" not in pb
    assert pb["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    # D: the original request plus exactly P's returned params.
    p_kv = json.loads(stub_json_bytes("P0", pb, "P"))["kv_transfer_params"]
    assert db == {**COMPLETION, "kv_transfer_params": p_kv}
    # Same request id on both, Authorization forwarded.
    rid = p_req["headers"]["x-request-id"]
    assert rid and d_req["headers"]["x-request-id"] == rid and r.headers["x-request-id"] == rid
    assert p_req["headers"]["authorization"] == d_req["headers"]["authorization"] == "Bearer k"
    # Body byte for byte (D's kv_transfer_params stats kept).
    assert r.content == stub_json_bytes("D0", db, "D")
    assert r.json()["kv_transfer_params"] == {"kvp2p_stats": {"decoded_by": "D0", "bytes": 4096}}
    assert r.headers["x-kvp2p-prefill-instance"] == stubs["P0"].url
    assert r.headers["x-kvp2p-decode-instance"] == stubs["D0"].url
    # Reading the prompt before routing, in milliseconds: a part of what the client waited, never more.
    assert 0.0 <= float(r.headers["x-kvp2p-route-ms"]) <= took_ms, (r.headers["x-kvp2p-route-ms"], took_ms)


def test_completions_stream_passthrough(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT, headers={"X-Request-Id": "client-rid-1"}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        got = b"".join(r.iter_bytes())
    assert got == b"".join(sse_events("D0"))
    pb = stubs["P0"].received[0]["body"]
    assert pb["stream"] is False and "stream_options" not in pb and pb["max_tokens"] == 1
    d_req = stubs["D0"].received[0]
    assert d_req["body"]["stream"] is True and d_req["body"]["stream_options"] == {"include_usage": True}
    assert d_req["body"]["max_tokens"] == 17
    assert d_req["body"]["kv_transfer_params"]["remote_engine_id"] == "engine-P0"
    assert stubs["P0"].received[0]["headers"]["x-request-id"] == "client-rid-1"
    assert d_req["headers"]["x-request-id"] == "client-rid-1"


def test_chat_completions(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 40, "min_tokens": 2}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    p_req, d_req = stubs["P0"].received[0], stubs["D0"].received[0]
    assert p_req["path"] == d_req["path"] == "/v1/chat/completions"
    assert p_req["body"]["max_completion_tokens"] == 1 and p_req["body"]["max_tokens"] == 1
    assert "min_tokens" not in p_req["body"]
    assert d_req["body"]["max_completion_tokens"] == 40 and d_req["body"]["min_tokens"] == 2
    assert "max_tokens" not in d_req["body"]
    # Streamed chat too.
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=CLIENT_TIMEOUT) as s:
        assert b"".join(s.iter_bytes()) == b"".join(sse_events("D0"))


def test_concurrent_requests_spread_over_instances(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = make_proxy([stubs["P0"].url, stubs["P1"].url], [stubs["D0"].url, stubs["D1"].url])
    for s in stubs.values():
        s.delay_s = 0.3  # keep requests outstanding so concurrent ones see each other's load
    results: list[int] = []

    def one() -> None:
        results.append(httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT).status_code)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results == [200] * 4
    counts = [len(stubs[n].received) for n in ("P0", "P1", "D0", "D1")]
    assert counts[0] + counts[1] == 4 and counts[2] + counts[3] == 4
    assert all(c >= 1 for c in counts), counts  # exactly 2/2 unless the box is very loaded
    health = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()
    assert [e["outstanding"] for e in health["prefill"] + health["decode"]] == [0, 0, 0, 0]
    assert [e["served"] for e in health["prefill"] + health["decode"]] == counts


def test_least_outstanding_beats_round_robin(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    """While D0 is busy with a stream, new requests all go to idle D1 (round robin would alternate)."""
    url = make_proxy([stubs["P0"].url], [stubs["D0"].url, stubs["D1"].url])
    stubs["D0"].mode = "slow_stream"
    stream_body = {**COMPLETION, "stream": True}
    with (
        httpx.Client(timeout=CLIENT_TIMEOUT) as client,
        client.stream("POST", url + "/v1/completions", json=stream_body) as r,
    ):
        chunks = r.iter_bytes()  # keep a reference: a collected iterator closes the response
        assert next(chunks).startswith(b"data: ")
        assert r.headers["x-kvp2p-decode-instance"] == stubs["D0"].url
        for _ in range(3):
            resp = client.post(url + "/v1/completions", json=COMPLETION)
            assert resp.headers["x-kvp2p-decode-instance"] == stubs["D1"].url
    assert len(stubs["D0"].received) == 1 and len(stubs["D1"].received) == 3


def test_prefill_down_is_502_fast(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    dead = closed_port_url()
    url = make_proxy([dead], [stubs["D0"].url])
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert time.monotonic() - t0 < 3.0
    assert_openai_error(r, 502, "prefill", dead)
    assert stubs["D0"].received == []
    health = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()
    assert health["prefill"][0]["outstanding"] == 0


def test_prefill_500_is_502(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["P0"].mode = "500"
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 502, "prefill", stubs["P0"].url, "500", "engine dead")
    assert stubs["D0"].received == []


def test_prefill_without_kv_params_is_502(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["P0"].mode = "no_kv"
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 502, "kv_transfer_params", "kv_producer", stubs["P0"].url)
    assert stubs["D0"].received == []


def test_prefill_400_passes_through(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["P0"].mode = "400"
    for stream in (False, True):
        r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "prompt too long"
    assert stubs["D0"].received == []


def test_decode_errors(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    for stream in (False, True):
        stubs["D0"].mode = "500"
        r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=CLIENT_TIMEOUT)
        assert_openai_error(r, 502, "decode", stubs["D0"].url, "500")
        stubs["D0"].mode = "400"
        r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["message"] == "prompt too long"
    dead = closed_port_url()
    url2 = make_proxy([stubs["P0"].url], [dead])
    r = httpx.post(url2 + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 502, "decode", dead)
    health = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()
    assert health["decode"][0]["outstanding"] == 0


def test_decode_hang_is_504_within_timeout(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy, timeout_s=0.5)
    stubs["D0"].mode = "hang"
    for stream in (False, True):
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=CLIENT_TIMEOUT)
        elapsed = time.monotonic() - t0
        assert elapsed < 3.0, elapsed
        assert_openai_error(r, 504, "decode", stubs["D0"].url, "timed out")
    # Silence within a stream is bounded too: the stream ends with a timeout error event.
    stubs["D0"].mode = "stall_mid_stream"
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=CLIENT_TIMEOUT)
    assert time.monotonic() - t0 < 3.0
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[0] == sse_events("D0")[0].rstrip(b"\n") and len(events) == 2
    err = json.loads(events[1][len(b"data: ") :])["error"]
    assert err["code"] == 504 and "timed out" in err["message"]
    health = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()
    assert health["decode"][0]["outstanding"] == 0


def test_decode_dies_mid_stream(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["D0"].mode = "die_mid_stream"
    with httpx.stream(
        "POST", url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=CLIENT_TIMEOUT
    ) as r:
        assert r.status_code == 200
        got = b"".join(r.iter_bytes())
    events = [e for e in got.split(b"\n\n") if e]
    assert events[:2] == [e.rstrip(b"\n") for e in sse_events("D0")[:2]]
    assert len(events) == 3
    assert events[2].startswith(b"data: ")
    err = json.loads(events[2][len(b"data: ") :])["error"]
    assert "decode" in err["message"] and stubs["D0"].url in err["message"]
    assert err["code"] == 502
    health = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()
    assert health["decode"][0]["outstanding"] == 0


def test_client_disconnect_releases_decode_slot(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["D0"].mode = "slow_stream"  # ~5 s of events: the client leaves long before the end
    stream_body = {**COMPLETION, "stream": True}
    with (
        httpx.Client(timeout=CLIENT_TIMEOUT) as client,
        client.stream("POST", url + "/v1/completions", json=stream_body) as r,
    ):
        chunks = r.iter_bytes()  # keep a reference: a collected iterator closes the response
        assert next(chunks).startswith(b"data: ")
        health = client.get(url + "/health").json()
        assert health["decode"][0]["outstanding"] == 1, health
    # At once, not when D's ~5 s stream ends: the proxy drops D's connection (vLLM then aborts the request).
    deadline = time.monotonic() + 2.0
    while True:
        health = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()
        if health["decode"][0]["outstanding"] == 0 and stubs["D0"].streams_cut == 1:
            break
        assert time.monotonic() < deadline, (health, stubs["D0"].streams_cut)
        time.sleep(0.05)


def test_health_and_models(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = make_proxy([stubs["P0"].url, stubs["P1"].url], [stubs["D0"].url])
    h = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT)
    assert h.status_code == 200
    body = h.json()
    assert body["status"] == "ok"
    assert [e["url"] for e in body["prefill"]] == [stubs["P0"].url, stubs["P1"].url]
    assert body["decode"] == [{"url": stubs["D0"].url, "outstanding": 0, "pending_tokens": 0, "served": 0,
                               "prefix_hits": 0, "hit_tokens": 0, "queued_prefill_tokens": 0, "queued_prefills": 0,
                               "decodes": 0, "pairing": None, "state": "up", "failures": 0}]
    assert body["routing"] == {"policy": "prefix-aware", "prefix_weight": 1.0, "kv_events": False,
                               "index_blocks": 0, "tokenize_failures": 0, "tokenized_locally": 0,
                               "tokenized_by_p": 0, "tokenizer": None}
    probed = httpx.get(url + "/health", params={"probe": "true"}, timeout=CLIENT_TIMEOUT).json()
    assert all(e["healthy"] for e in probed["prefill"] + probed["decode"])
    m = httpx.get(url + "/v1/models", timeout=CLIENT_TIMEOUT)
    assert m.status_code == 200 and m.json()["data"][0]["id"] == "model-D0"
    # A role with no live instance -> 503 when probing, with the error per instance.
    dead = closed_port_url()
    url2 = make_proxy([dead], [stubs["D0"].url])
    h2 = httpx.get(url2 + "/health", params={"probe": "true"}, timeout=CLIENT_TIMEOUT)
    assert h2.status_code == 503
    assert h2.json()["prefill"][0]["healthy"] is False and "ConnectionRefusedError" in h2.json()["prefill"][0]["error"]
    assert httpx.get(url2 + "/health", timeout=CLIENT_TIMEOUT).status_code == 200  # no probe: just counts


def test_bad_request_body(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    r = httpx.post(url + "/v1/completions", content=b"{not json", timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400, "not valid JSON")
    r = httpx.post(url + "/v1/completions", json=[1, 2], timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400, "JSON object")
    assert stubs["P0"].received == []


@pytest.mark.timeout(45)
def test_console_script_serves_and_imports_light(stubs: dict[str, Stub]) -> None:
    """The ``vllm-kvp2p-proxy`` entry point serves end to end, in a process that never imported vllm or torch."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import sys\n"
        "import vllm_kvp2p.proxy\n"
        "from vllm_kvp2p.proxy.cli import main\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')]\n"
        "if bad: sys.exit(f'heavy imports: {bad}')\n"
        "main(sys.argv[1:])\n"
    )
    p_host, p_port = stubs["P0"].url.removeprefix("http://").split(":")
    cmd = [
        sys.executable,
        "-c",
        code,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--prefiller-hosts",
        p_host,
        "--prefiller-ports",
        p_port,
        "--decode",
        stubs["D1"].url,
        "--timeout",
        "5",
    ]
    repo_root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(cmd, cwd=repo_root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20.0
        while True:
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
            assert time.monotonic() < deadline, "proxy did not come up"
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "D1 answer"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
