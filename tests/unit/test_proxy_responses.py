"""``POST /v1/responses`` through the proxy: the body rules directly (endpoints.py, validation.check_responses), then
the whole flow against the stub engines of proxy_harness.py (P's copy, D's body, JSON and SSE relayed, the 400s)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.unit import proxy_harness as harness
from tests.unit.proxy_harness import CLIENT_TIMEOUT, Stub, assert_openai_error, one_pd, proxy_health
from vllm_kvp2p.proxy.endpoints import ENDPOINTS, PREFILL_KV_TRANSFER_PARAMS
from vllm_kvp2p.proxy.prompt_tokens import tokenize_request
from vllm_kvp2p.proxy.routes import SERVED, not_served
from vllm_kvp2p.proxy.upstream import ProxyError
from vllm_kvp2p.proxy.validation import check_responses

stubs = harness.stubs
make_proxy = harness.make_proxy

pytestmark = pytest.mark.timeout(30)

RESPONSES = "/v1/responses"
REQUEST: dict[str, Any] = {"model": "m", "input": "hello there", "instructions": "be brief", "max_output_tokens": 17,
                           "temperature": 0.0, "include": ["message.output_text.logprobs"], "top_logprobs": 2}


@pytest.fixture(autouse=True)
def _reset_stubs(request: pytest.FixtureRequest) -> None:
    if "stubs" in request.fixturenames:
        for s in request.getfixturevalue("stubs").values():
            s.reset()


def refused(body: dict[str, Any]) -> ProxyError:
    with pytest.raises(ProxyError) as info:
        check_responses(body)
    assert info.value.status == 400 and info.value.err_type == "invalid_request_error"
    return info.value


# -- the rules, directly ---------------------------------------------------------------------------------------


def test_prefill_body_is_one_unstored_unstreamed_token() -> None:
    body = {**REQUEST, "stream": True, "store": True, "background": False, "kv_transfer_params": {"x": 1},
            "n": 3, "stream_options": {"include_obfuscation": False}, "seed": 7}
    p = ENDPOINTS[RESPONSES].prefill_body(body)
    assert "seed" not in p and body["seed"] == 7  # P's token is not used (endpoints.py: vLLM CPU and seeds)
    assert p["max_output_tokens"] == 1 and p["stream"] is False and p["store"] is False and p["background"] is False
    assert p["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    # No completion field is added, and what vLLM's ResponsesRequest ignores (n, stream_options) is left to it.
    assert not {"max_tokens", "max_completion_tokens"} & set(p)
    changed = ("max_output_tokens", "stream", "store", "background", "kv_transfer_params", "seed")
    assert {k: v for k, v in p.items() if k not in changed} == {k: v for k, v in body.items() if k not in changed}
    assert body["max_output_tokens"] == 17 and body["stream"] is True and body["kv_transfer_params"] == {"x": 1}
    assert "max_output_tokens" in ENDPOINTS[RESPONSES].prefill_body({"input": "x"})  # set even when absent


def test_routes_table() -> None:
    assert SERVED[RESPONSES] == "POST" and set(ENDPOINTS) <= set(SERVED)
    assert not ENDPOINTS[RESPONSES].batched and ENDPOINTS["/v1/completions"].batched
    assert not_served("GET", RESPONSES).status == 405
    for path in ("/v1/responses/resp_1", "/v1/responses/resp_1/cancel", "/v1/responses/resp_1/input_items"):
        assert not_served("GET", path).status == 501  # a stored response: on the one engine that stored it
    # Routed by load: vLLM's /tokenize does not take a Responses input.
    assert tokenize_request(RESPONSES, {**REQUEST, "input": [{"role": "user", "content": "x"}]}) is None


@pytest.mark.parametrize("value", ["resp_123", "", 5])
def test_previous_response_id_is_refused(value: object) -> None:
    err = refused({**REQUEST, "previous_response_id": value})
    assert err.param == "previous_response_id"
    assert "one engine" in err.message and "`input`" in err.message


@pytest.mark.parametrize("value", [True, "yes", 1, "true"])
def test_background_is_refused(value: object) -> None:
    err = refused({**REQUEST, "background": value})
    assert err.param == "background" and "not supported by the P/D proxy" in err.message


@pytest.mark.parametrize(("field", "value", "message"), [
    ("background", "maybe", "background must be a boolean"),
    ("stream", "maybe", "stream must be a boolean"),
    ("stream", 2, "stream must be a boolean"),
    ("store", [], "store must be a boolean"),
    ("max_output_tokens", "many", "max_output_tokens must be an integer"),
    ("max_output_tokens", 2.5, "max_output_tokens must be an integer"),
    ("max_output_tokens", 0, "max_tokens must be at least 1, got 0."),  # vLLM's own message
    ("max_output_tokens", -4, "max_tokens must be at least 1, got -4."),
])
def test_values_p_does_not_see_are_checked(field: str, value: object, message: str) -> None:
    err = refused({**REQUEST, field: value})
    assert err.param == field and message in err.message


@pytest.mark.parametrize("extra", [
    {}, {"previous_response_id": None}, {"background": False}, {"background": None}, {"background": "no"},
    {"stream": True}, {"stream": None}, {"stream": "false"}, {"store": True}, {"store": None}, {"store": 0},
    {"max_output_tokens": None}, {"max_output_tokens": "5"}, {"max_output_tokens": 5.0}, {"max_output_tokens": 1},
    {"previous_input_messages": [{"role": "user", "content": "x"}]},  # stateless (harmony messages)
])
def test_what_vllm_accepts_passes(extra: dict[str, Any]) -> None:
    check_responses({**REQUEST, **extra})


def test_completion_rules_unchanged() -> None:
    p = ENDPOINTS["/v1/chat/completions"].prefill_body({"messages": [], "n": 2, "min_tokens": 1, "stream": True})
    assert (p["n"], p["max_tokens"], p["max_completion_tokens"], p["stream"]) == (1, 1, 1, False)
    assert "min_tokens" not in p and "store" not in p and "max_output_tokens" not in p


# -- through the proxy (stub engines) --------------------------------------------------------------------------


def test_p_then_d_json(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    body = {**REQUEST, "store": True}
    r = httpx.post(url + RESPONSES, json=body, headers={"X-Request-Id": "r-1", "Authorization": "Bearer k"},
                   timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    (p_req,), (d_req,) = stubs["P0"].received, stubs["D0"].received
    assert p_req["path"] == d_req["path"] == RESPONSES
    assert p_req["body"] == {**body, "max_output_tokens": 1, "stream": False, "store": False, "background": False,
                             "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    # D: the client's body as it is (store: true included: D's engine decides), P's kv_transfer_params.
    assert {k: v for k, v in d_req["body"].items() if k != "kv_transfer_params"} == body
    assert d_req["body"]["kv_transfer_params"]["remote_engine_id"] == "engine-P0"
    for req in (p_req, d_req):
        assert req["headers"]["x-request-id"] == "r-1" and req["headers"]["authorization"] == "Bearer k"
    # D's answer byte for byte (the stub's oddly indented JSON), with the proxy's headers.
    assert r.content == harness.stub_json_bytes("D0", d_req["body"], "D")
    assert r.headers["x-kvp2p-prefill-instance"] == stubs["P0"].url
    assert r.headers["x-kvp2p-decode-instance"] == stubs["D0"].url and r.headers["x-request-id"] == "r-1"
    assert [e["outstanding"] for e in proxy_health(url)["prefill"] + proxy_health(url)["decode"]] == [0, 0]


def test_p_then_d_stream(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    r = httpx.post(url + RESPONSES, json={**REQUEST, "stream": True}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.content == b"".join(harness.sse_events("D0"))  # relayed as D sent it
    assert stubs["P0"].received[0]["body"]["stream"] is False
    assert stubs["D0"].received[0]["body"]["stream"] is True


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"stream": "sometimes"}, "stream"),
    ({"store": "maybe"}, "store"),
])
def test_refused_before_p(stubs: dict[str, Stub], make_proxy: Callable[..., str], extra: dict[str, Any],
                          param: str) -> None:
    url = one_pd(stubs, make_proxy)
    r = httpx.post(url + RESPONSES, json={**REQUEST, **extra}, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"] == param
    assert stubs["P0"].received == [] and stubs["D0"].received == []


def test_upstream_answers_and_failures(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["P0"].mode = "400"  # P refuses (e.g. a prompt too long): its answer as it is, D never asked
    r = httpx.post(url + RESPONSES, json=REQUEST, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400, "prompt too long")
    stubs["P0"].mode = "no_kv"  # a P without the kvp2p producer role
    r = httpx.post(url + RESPONSES, json=REQUEST, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 502, "no kv_transfer_params")
    assert stubs["D0"].received == []


def test_other_methods_and_stored_response_routes(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    r = httpx.get(url + RESPONSES, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 405, "only POST")
    for method, path in (("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel")):
        r = httpx.request(method, url + path, timeout=CLIENT_TIMEOUT)
        assert_openai_error(r, 501, "does not disaggregate", "engine")
    assert stubs["P0"].received == [] and stubs["D0"].received == []
