"""``POST /v1/responses`` through the real P/D deployment (the session's ``cluster``): the same answer as one
instance (P itself, asked directly with its own ``cache_salt`` so it does not reuse the P/D prefill), JSON and the
Responses event stream, D pulling the prompt from P, and nothing held on P or D after; and the requests the proxy
refuses before P (a 400 naming the parameter)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from tests.e2e.helpers import Cluster, wait_kv_idle
from vllm_kvp2p.testing.tiny_model import tiny_corpus

pytestmark = pytest.mark.e2e

RESPONSES = "/v1/responses"
MAX_OUTPUT_TOKENS = 10
ONE_INSTANCE_SALT = "responses-one-instance"
Json = dict[str, Any]


def request(case: str, **fields: Any) -> Json:
    corpus = tiny_corpus()
    text = f"({case}) {corpus[len(case) % len(corpus)]}"  # the case first: no prefix shared with another case
    return {"model": "tiny", "input": text, "max_output_tokens": MAX_OUTPUT_TOKENS, "temperature": 0, **fields}


def post(base: str, body: Json) -> tuple[httpx.Response, Json]:
    r = httpx.post(base + RESPONSES, json=body, timeout=120)
    return r, r.json()


def stream(base: str, body: Json) -> tuple[list[str], Json]:
    """The event types in order, and the final ``response.completed`` event's response with its text
    reassembled from the ``response.output_text.delta`` events (``streamed_text``)."""
    types, deltas, completed = [], [], None
    with httpx.stream("POST", base + RESPONSES, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for block in r.read().decode().split("\n\n"):
            data = [line[len("data: "):] for line in block.splitlines() if line.startswith("data: ")]
            if not data:
                continue
            event = json.loads(data[0])
            assert "error" not in event, event
            types.append(event["type"])
            if event["type"] == "response.output_text.delta":
                deltas.append(event["delta"])
            elif event["type"] == "response.completed":
                completed = event["response"]
    assert completed is not None, types
    return types, {**completed, "streamed_text": "".join(deltas)}


def collapsed(types: list[str]) -> list[str]:
    """Event types with runs of the same type as one."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def output_text(response: Json) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


def comparable_usage(response: Json) -> Json:
    """Usage without the prefix-cache hits (P/D's D loaded the prompt, the one instance computed it)."""
    usage = dict(response["usage"])
    usage.pop("input_tokens_details", None)
    return usage


def assert_same_answer(pd: Json, one: Json) -> None:
    assert output_text(pd) == output_text(one) and output_text(pd), (pd["output"], one["output"])
    assert comparable_usage(pd) == comparable_usage(one)
    assert pd["usage"]["output_tokens"] == MAX_OUTPUT_TOKENS
    assert (pd["status"], pd["max_output_tokens"], pd["object"]) == (one["status"], one["max_output_tokens"],
                                                                       "response")


def assert_ends_clean(cluster: Cluster) -> None:
    held = {role: wait_kv_idle(server, timeout=10.0) for role, server in (("P", cluster.prefill),
                                                                           ("D", cluster.decode))}
    assert held == {"P": 0.0, "D": 0.0}, f"KV cache still in use (vllm:kv_cache_usage_perc): {held}"


def pulled_tokens(cluster: Cluster) -> float:
    return cluster.decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def one_instance(body: Json) -> Json:
    return {**body, "cache_salt": ONE_INSTANCE_SALT}


@pytest.mark.parametrize("conversation", [False, True], ids=["text", "messages"])
def test_json_answer_equals_one_instance(cluster: Cluster, conversation: bool) -> None:
    body = request(f"json-{conversation}", instructions="Answer briefly.", store=True)
    if conversation:  # a conversation sent whole (what the proxy says to do instead of previous_response_id)
        body["input"] = [{"role": "user", "content": body["input"]},
                         {"role": "assistant", "content": "Tell me more."},
                         {"role": "user", "content": "Go on."}]
    pulled = pulled_tokens(cluster)
    r, pd = post(cluster.proxy_url, body)
    assert r.status_code == 200, pd
    assert r.headers["x-kvp2p-prefill-instance"] == cluster.prefill.url
    assert r.headers["x-kvp2p-decode-instance"] == cluster.decode.url
    assert pulled_tokens(cluster) > pulled  # D loaded the prompt from P
    assert isinstance(pd.get("kv_transfer_params"), dict)  # D's, relayed as D answered
    r, one = post(cluster.prefill.url, one_instance(body))
    assert r.status_code == 200, one
    assert_same_answer(pd, one)
    assert_ends_clean(cluster)


def test_stream_equals_one_instance(cluster: Cluster) -> None:
    body = request("stream", stream=True)
    pulled = pulled_tokens(cluster)
    types, pd = stream(cluster.proxy_url, body)
    assert pulled_tokens(cluster) > pulled
    one_types, one = stream(cluster.prefill.url, one_instance(body))
    # The same events, but for how many deltas carry the text (tokens coalesce when the reader lags).
    assert collapsed(types) == collapsed(one_types), (types, one_types)
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert pd["streamed_text"] == one["streamed_text"] == output_text(pd)
    assert_same_answer(pd, one)
    r, whole = post(cluster.prefill.url, one_instance({**body, "stream": False}))  # streamed or not: one answer
    assert output_text(whole) == pd["streamed_text"]
    assert_ends_clean(cluster)


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_0123456789abcdef"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"background": True, "stream": True}, "background"),
    ({"stream": "sometimes"}, "stream"),
    ({"store": "maybe"}, "store"),
    ({"max_output_tokens": "many"}, "max_output_tokens"),
])
def test_refused_before_p(cluster: Cluster, fields: Json, param: str) -> None:
    assert "vllm:prompt_tokens_total" in {key.partition("{")[0] for key in cluster.prefill.metrics()}
    before = cluster.prefill.metric("vllm:prompt_tokens_total")
    r, answer = post(cluster.proxy_url, request("refused", **fields))
    assert r.status_code == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    assert cluster.prefill.metric("vllm:prompt_tokens_total") == before  # P never computed it
    assert_ends_clean(cluster)


def test_refused_like_one_instance(cluster: Cluster) -> None:
    """A value D would refuse is refused by the proxy with vLLM's own message (P, asked for one token, would
    accept it); one vLLM itself refuses for P and D alike is P's answer."""
    for fields in ({"max_output_tokens": 0}, {"max_output_tokens": -3}, {"prompt": {"id": "pmpt_1"}}):
        body = request("refused-like-one", **fields)
        r, pd = post(cluster.proxy_url, body)
        r1, one = post(cluster.prefill.url, one_instance(body))
        assert r.status_code == r1.status_code == 400, (pd, one)
        strip = re.compile(r" \(parameter=[^)]*\)$")  # vLLM's server appends it (and the value) to its messages
        if "prompt" in fields:  # P's own 400 (vLLM 0.23's message quotes the body P got: not compared)
            assert pd["error"]["param"] == one["error"]["param"] == "prompt", (pd, one)
            assert "prompt template is not supported" in pd["error"]["message"], pd
        else:
            assert strip.sub("", pd["error"]["message"]) == strip.sub("", one["error"]["message"]), (pd, one)
    # The previous_response_id the proxy refuses, one instance answers 404 (it is in no engine's store here).
    r1, one = post(cluster.prefill.url, one_instance(request("refused-like-one", previous_response_id="resp_x")))
    assert r1.status_code == 404, one
    assert_ends_clean(cluster)


def test_stored_response_routes_are_not_served(cluster: Cluster) -> None:
    for method, path in (("GET", "/v1/responses/resp_x"), ("POST", "/v1/responses/resp_x/cancel")):
        r = httpx.request(method, cluster.proxy_url + path, timeout=30)
        assert r.status_code == 501 and "send it to an engine" in r.json()["error"]["message"], r.text
