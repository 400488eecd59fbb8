"""Issue 36 through the proxy, run for real against the stub engines of proxy_harness.py: batched prompts, P's n=1,
clients that leave mid-request, the forwarded and refused routes."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

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
    proxy_health,
)

# proxy_harness.py's fixtures: its stub engines (their own, for this module) and proxies.
stubs = harness.stubs
make_proxy = harness.make_proxy

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _reset_stubs(request: pytest.FixtureRequest) -> None:
    if "stubs" in request.fixturenames:
        for s in request.getfixturevalue("stubs").values():
            s.reset()


def abandons(url: str) -> dict[str, int]:
    """The proxy's abandons of P's holds by outcome (its /health)."""
    return proxy_health(url)["hold_abandons"]


def outstanding(url: str) -> list[int]:
    health = proxy_health(url)
    return [e["outstanding"] for e in health["prefill"] + health["decode"]]


def wait_for(check: Callable[[], bool], within_s: float, what: Callable[[], object] = lambda: None) -> float:
    """Poll ``check`` until true; fail after ``within_s``. Returns the time it took."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < within_s, what()
        time.sleep(0.02)
    return time.monotonic() - t0


def events_of(content: bytes) -> list[bytes]:
    return [e for e in content.split(b"\n\n") if e]


def data_of(event: bytes) -> Any:
    assert event.startswith(b"data: "), event
    payload = event[len(b"data: "):]
    return payload if payload == b"[DONE]" else json.loads(payload)


# -- P gets n=1 ------------------------------------------------------------------------------------------------


def test_p_gets_one_sequence_d_the_clients_n(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    body = {**COMPLETION, "n": 3, "temperature": 0.7, "best_of": 5, "use_beam_search": False}
    r = httpx.post(url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    pb, db = stubs["P0"].received[0]["body"], stubs["D0"].received[0]["body"]
    assert pb["n"] == 1 and "best_of" not in pb and "use_beam_search" not in pb
    assert {k: v for k, v in db.items() if k != "kv_transfer_params"} == body
    assert len(r.json()["choices"]) == 3


@pytest.mark.parametrize("n", ["2", 0, -1, 10**6, True, 2.5])
def test_bad_n_never_reaches_p(stubs: dict[str, Stub], make_proxy: Callable[..., str], n: object) -> None:
    url = one_pd(stubs, make_proxy)
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "n": n}, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400, "n must be")
    assert r.json()["error"]["param"] == "n" and stubs["P0"].received == []


def test_max_n_and_batch_settings(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy, max_n=2, max_batch_prompts=2)
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "n": 3}, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400, "at most 2", "--max-n")
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": ["a", "b", "c"]}, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400, "at most 2", "--max-batch-prompts")
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": []}, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400, "empty")
    assert stubs["P0"].received == []


# -- batched prompts -------------------------------------------------------------------------------------------


def test_batch_non_stream_merged_like_one_instance(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = make_proxy([stubs["P0"].url, stubs["P1"].url], [stubs["D0"].url, stubs["D1"].url])
    body = {**COMPLETION, "prompt": ["a", "b", "c"], "n": 2, "temperature": 0.7}
    r = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "batch-1"}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [(c["index"], c["echo"]) for c in data["choices"]] == [
        (0, "a"), (1, "a"), (2, "b"), (3, "b"), (4, "c"), (5, "c")]
    assert data["usage"] == {"prompt_tokens": 15, "total_tokens": 15 + 3 * 17 * 2, "completion_tokens": 51,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    assert data["id"] == "cmpl-stub" and data["object"] == "text_completion"
    parts = data["kv_transfer_params"]["kvp2p_parts"]
    assert len(parts) == 3 and all(p["kvp2p_stats"]["bytes"] == 4096 for p in parts)
    assert r.headers["x-request-id"] == "batch-1" and r.headers["x-kvp2p-batch-prompts"] == "3"
    routes = data["kv_transfer_params"]["kvp2p_routes"]  # each prompt's instances, in the body (not headers)
    assert len(routes) == 3 and {r["decode_instance"] for r in routes} <= {stubs["D0"].url, stubs["D1"].url}
    assert "x-kvp2p-decode-instance" not in r.headers
    p_reqs = stubs["P0"].received + stubs["P1"].received
    d_reqs = stubs["D0"].received + stubs["D1"].received
    assert sorted(q["body"]["prompt"] for q in p_reqs) == ["a", "b", "c"]
    assert all(q["body"]["n"] == 1 for q in p_reqs) and all(q["body"]["n"] == 2 for q in d_reqs)
    assert sorted(q["headers"]["x-request-id"] for q in d_reqs) == ["batch-1-0", "batch-1-1", "batch-1-2"]
    assert outstanding(url) == [0, 0, 0, 0]


def test_batch_of_token_lists_and_single_element_lists(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": [[1, 2], [3]]}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200 and [c["echo"] for c in r.json()["choices"]] == [[1, 2], [3]]
    assert [q["body"]["prompt"] for q in stubs["P0"].received] in ([[1, 2], [3]], [[3], [1, 2]])
    for single in (["a"], [[1, 2, 3]]):  # one prompt: passed as it is, vLLM answers it as one
        stubs["D0"].received.clear()
        r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": single}, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 200 and "kvp2p_parts" not in r.json()["kv_transfer_params"]
        assert [q["body"]["prompt"] for q in stubs["D0"].received] == [single]


@pytest.mark.parametrize("continuous", [False, True])
def test_batch_stream_merged_like_one_instance(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], continuous: bool
) -> None:
    url = make_proxy([stubs["P0"].url], [stubs["D0"].url, stubs["D1"].url])
    for d in ("D0", "D1"):
        stubs[d].mode = "openai_stream"
    options = {"include_usage": True, "continuous_usage_stats": continuous}
    body = {**COMPLETION, "prompt": ["a", "b", "c"], "n": 2, "temperature": 0.7, "stream": True,
            "stream_options": options}
    r = httpx.post(url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [data_of(e) for e in events_of(r.content)]
    assert events[-1] == b"[DONE]" and b"[DONE]" not in events[:-1]
    chunks, usage_chunk = events[:-2], events[-2]
    assert len({c["id"] for c in [*chunks, usage_chunk]}) == 1  # one id for the whole batch
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
        "prompt_tokens": 15, "total_tokens": 27, "completion_tokens": 12}
    assert len(chunks) == 3 * 2 * 2
    for c in chunks:
        (choice,) = c["choices"]
        prompt, k, _ = choice["text"].split("/")
        assert choice["index"] == "abc".index(prompt) * 2 + int(k)
        assert ("usage" in c) == continuous  # each chunk's own usage, as it came
    # Without include_usage, no usage chunk: just [DONE].
    r = httpx.post(url + "/v1/completions", json={**body, "stream_options": None}, timeout=CLIENT_TIMEOUT)
    events = [data_of(e) for e in events_of(r.content)]
    assert events[-1] == b"[DONE]" and all(e["choices"] for e in events[:-1])
    assert outstanding(url) == [0, 0, 0]


def test_batch_concurrency_is_bounded(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy, max_batch_concurrency=2)
    stubs["D0"].delay_s = 0.4
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": list("abcd")}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert time.monotonic() - t0 >= 0.8  # two rounds of two: all four at once would take ~0.4 s


def test_batch_part_failure_is_one_error_and_cancels_the_rest(
    stubs: dict[str, Stub], make_proxy: Callable[..., str]
) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["D0"].by_prompt.update({"b": "500", "c": "slow"})
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": ["a", "b", "c"]}, timeout=CLIENT_TIMEOUT)
    assert time.monotonic() - t0 < 3.0  # not the slow part's 4 s
    assert_openai_error(r, 502, "prompt 1 of the batch failed", "decode", "500")
    wait_for(lambda: stubs["D0"].cancelled == 1, 2.0, lambda: stubs["D0"].cancelled)  # "c" dropped at once
    assert outstanding(url) == [0, 0]
    # An upstream 4xx keeps its status and says which prompt.
    stubs["D0"].by_prompt.clear()
    stubs["P0"].by_prompt["b"] = "400"
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": ["a", "b"]}, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400, "prompt 1 of the batch failed: prompt too long")


def test_batch_stream_failure_before_and_after_the_first_byte(
    stubs: dict[str, Stub], make_proxy: Callable[..., str]
) -> None:
    url = one_pd(stubs, make_proxy)
    body = {**COMPLETION, "prompt": ["a", "b"], "stream": True}
    # Before anything was sent: a normal error answer; the slow part runs on P to its answer, whose hold the proxy
    # then abandons (P's request is not cut: an abort would race P's answer and leave a hold nobody knows of).
    stubs["P0"].by_prompt.update({"a": "slow", "b": "500"})
    r = httpx.post(url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 502, "prompt 1 of the batch failed", "prefill")
    wait_for(lambda: abandons(url).get("invalid") == 1, 6.0, lambda: proxy_health(url))  # the stub's params
    assert stubs["P0"].cancelled == 0
    # Mid-stream: what was sent stays sent, then one error event and the end; the other stream is cut.
    stubs["P0"].by_prompt.clear()
    stubs["D0"].by_prompt.update({"a": "slow_stream", "b": "die_mid_stream"})
    r = httpx.post(url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200
    events = events_of(r.content)
    error = data_of(events[-1])["error"]
    assert "prompt 1 of the batch failed" in error["message"] and error["code"] == 502
    assert all("error" not in data_of(e) for e in events[:-1]) and b"[DONE]" not in r.content
    wait_for(lambda: stubs["D0"].streams_cut == 1, 2.0, lambda: stubs["D0"].streams_cut)
    wait_for(lambda: outstanding(url) == [0, 0], 2.0)


# -- clients that leave ----------------------------------------------------------------------------------------


def leave_mid_request(url: str, body: dict[str, Any], arrived: Callable[[], bool]) -> None:
    """Send ``body`` to ``url``'s /v1/completions on a raw socket; close it once ``arrived()``."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
        wait_for(arrived, 5.0)


@pytest.mark.parametrize(("slow", "stream"), [("P0", False), ("D0", False), ("P0", True)])
def test_client_leaving_cancels_the_request_upstream(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], slow: str, stream: bool
) -> None:
    """The stub is slow: the client leaves while the proxy waits on it. D's connection is dropped at once (the stub
    sees it, as vLLM does and aborts) and the hold its params name abandoned; P's request runs to its answer (an
    abort would race it), and the hold it names is abandoned then. Every count is released."""
    url = one_pd(stubs, make_proxy)
    stubs[slow].delay_s = 1.0
    leave_mid_request(url, {**COMPLETION, "stream": stream}, lambda: bool(stubs[slow].received))
    if slow == "D0":
        wait_for(lambda: stubs[slow].cancelled == 1, 2.0, lambda: (stubs[slow].cancelled, proxy_health(url)))
    wait_for(lambda: abandons(url).get("invalid") == 1, 3.0, lambda: proxy_health(url))  # the stub's params
    wait_for(lambda: outstanding(url) == [0, 0], 2.0, lambda: proxy_health(url))
    if slow == "P0":
        assert stubs["P0"].cancelled == 0 and stubs["D0"].received == []


def test_prefills_run_for_clients_that_left_are_bounded(stubs: dict[str, Stub], make_proxy: Callable[..., str]
                                                         ) -> None:
    """A client may not make P run prefills for nobody without end by leaving at once: past --max-orphan-prefills
    (here 1) P's request is aborted as it was before abandons existed, and counted."""
    url = one_pd(stubs, make_proxy, max_orphan_prefills=1)
    stubs["P0"].delay_s = 1.0
    for i in range(3):
        leave_mid_request(url, {**COMPLETION, "prompt": f"p{i}"}, lambda n=i + 1: len(stubs["P0"].received) == n)
    wait_for(lambda: stubs["P0"].cancelled == 2, 3.0, lambda: (stubs["P0"].cancelled, abandons(url)))
    wait_for(lambda: abandons(url).get("invalid") == 1, 3.0, lambda: abandons(url))  # the one run to its answer
    assert abandons(url)["prefills_aborted"] == 2 and stubs["D0"].received == []
    wait_for(lambda: outstanding(url) == [0, 0], 2.0, lambda: proxy_health(url))


def test_client_leaving_cancels_every_part_of_a_batch(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["D0"].mode = "slow"
    leave_mid_request(url, {**COMPLETION, "prompt": ["a", "b", "c"]}, lambda: len(stubs["D0"].received) == 3)
    wait_for(lambda: stubs["D0"].cancelled == 3, 2.0, lambda: stubs["D0"].cancelled)
    wait_for(lambda: outstanding(url) == [0, 0], 2.0, lambda: proxy_health(url))


# -- routes ----------------------------------------------------------------------------------------------------


def test_tokenize_and_detokenize_go_to_a_decoder(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["D0"].serves_tokenize = True
    auth = {"Authorization": "Bearer k"}
    r = httpx.post(url + "/tokenize", json={"model": "m", "prompt": "hi"}, headers=auth, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200 and r.json()["tokens"] == [1, 2, 3] and r.json()["by"] == "D0"
    r = httpx.post(url + "/detokenize", json={"model": "m", "tokens": [1, 2]}, headers=auth, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200 and r.json() == {"prompt": "text of [1, 2]", "by": "D0"}
    assert [(q["path"], q["body"], q["headers"]["authorization"]) for q in stubs["D0"].received] == [
        ("/tokenize", {"model": "m", "prompt": "hi"}, "Bearer k"), ("/detokenize", {"model": "m", "tokens": [1, 2]},
                                                                     "Bearer k")]
    assert stubs["P0"].received == []
    stubs["D0"].serves_tokenize = False
    assert httpx.post(url + "/tokenize", json={}, timeout=CLIENT_TIMEOUT).status_code == 404  # D's own answer
    dead = closed_port_url()
    r = httpx.post(make_proxy([stubs["P0"].url], [dead]) + "/tokenize", json={}, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 502, "decode", dead)
    assert outstanding(url) == [0, 0]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/responses/resp_1/cancel", "/v1/audio/transcriptions",
                                  "/pooling", "/score", "/rerank", "/v1/score", "/v1/rerank", "/classify",
                                  "/v1/completions/render"])
def test_vllm_routes_not_disaggregated_are_501(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], path: str
) -> None:
    url = one_pd(stubs, make_proxy)
    r = httpx.post(url + path, json={"model": "m", "input": "x"}, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 501, "does not disaggregate", "engine")
    assert stubs["P0"].received == [] and stubs["D0"].received == []


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/nothing"), ("POST", "/foo"), ("GET", "/docs"),
                                              ("GET", "/openapi.json")])
def test_unknown_paths_are_404_listing_the_routes(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], method: str, path: str
) -> None:
    url = one_pd(stubs, make_proxy)
    r = httpx.request(method, url + path, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 404, "no such route", "POST /v1/completions", "GET /health", "POST /tokenize")
    r = httpx.get(url + "/tokenize", timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 405, "only POST")
    assert r.headers["allow"] == "POST"
    assert httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).status_code == 200


def test_n_with_greedy_sampling_never_reaches_p(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    """vLLM refuses n > 1 at temperature 0 on D; P, asked for n=1, would have held the prompt for nobody."""
    url = one_pd(stubs, make_proxy)
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "n": 3, "temperature": 0}, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400, "n must be 1 when using greedy sampling, got 3.")
    assert r.json()["error"]["param"] == "n" and stubs["P0"].received == []
