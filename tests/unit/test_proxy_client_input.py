"""What a client may send the proxy, run for real against the stub engines (tests/unit/proxy_harness.py): prompts
without token ids (routed by load) or tokenized by a local tokenizer, absurd prompts, a body over the cap, a
route asked with another method, hostile header bytes. Each is answered, or refused before any P is asked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.unit import proxy_harness as harness
from tests.unit.proxy_harness import (
    CLIENT_TIMEOUT,
    COMPLETION,
    Stub,
    one_pd,
    proxy_health,
)
from vllm_kvp2p.proxy import create_app
from vllm_kvp2p.testing.tiny_model import write_tokenizer_files

# Generous per-test caps: the bounds that matter are asserted inside the tests; these only stop a hang.
pytestmark = pytest.mark.timeout(30)

# proxy_harness's fixtures: its stub engines (this module's own, reset before each test) and proxies.
stubs = harness.stubs
_reset_stubs = harness._reset_stubs
make_proxy = harness.make_proxy


def test_prompts_without_tokens_are_routed_by_load_and_answered(
    stubs: dict[str, Stub], make_proxy: Callable[..., str]
) -> None:
    """Prefix-aware routing with KV events configured: a text prompt whose /tokenize fails (these stubs have none)
    is still answered, routed by load, and counted; a token-id prompt needs no /tokenize at all."""
    nowhere = [("tcp://127.0.0.1:9", None)]  # ZMQ connects lazily: nothing listens, nothing arrives
    url = make_proxy([stubs["P0"].url], [stubs["D0"].url], prefill_events=nowhere, decode_events=nowhere,
                     cache_headers=True)
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200 and r.headers["x-kvp2p-prefill-cached-tokens"] == "0"
    routing = proxy_health(url)["routing"]
    assert routing["kv_events"] is True and routing["tokenize_failures"] == 1
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": list(range(70))}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200
    health = proxy_health(url)
    assert health["routing"]["tokenize_failures"] == 1
    assert health["prefill"][0]["pending_tokens"] == 0 and health["prefill"][0]["cache"]["hashes_match"] is None
    # Settings that could never match the engines' hashes refuse to build the proxy.
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        create_app([stubs["P0"].url], [stubs["D0"].url], prefill_events=nowhere, hash_algo="xxhash")


def test_a_local_tokenizer_spares_the_tokenize_round_trip(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], tmp_path: Path
) -> None:
    """With ``tokenizer``, a text completion prompt is tokenized in the proxy (these stubs have no /tokenize, so a
    round trip would count a failure); a chat request still asks a P (the engine's template decides its tokens)."""
    write_tokenizer_files(tmp_path, vocab=512, max_pos=1024)
    nowhere = [("tcp://127.0.0.1:9", None)]
    url = make_proxy([stubs["P0"].url], [stubs["D0"].url], prefill_events=nowhere, decode_events=nowhere,
                     tokenizer=str(tmp_path))
    assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT).status_code == 200
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=CLIENT_TIMEOUT).status_code == 200
    routing = proxy_health(url)["routing"]
    assert routing["tokenizer"] == str(tmp_path)
    assert (routing["tokenized_locally"], routing["tokenized_by_p"], routing["tokenize_failures"]) == (1, 0, 1)
    # Without KV events prompts are not hashed, so the tokenizer is not even loaded.
    plain = make_proxy([stubs["P0"].url], [stubs["D0"].url], tokenizer=str(tmp_path / "missing"))
    assert proxy_health(plain)["routing"]["tokenizer"] is None


@pytest.mark.parametrize(
    ("prompt", "status"),
    [(list(range(300_000)), 200), ([2**62, 0], 200), ("ünïcødé ✓ " * 2000, 200), ({"a": 1}, 200), (7, 200),
     (None, 200), (list(range(-5, 300_000)), 400), ([2**62, -(2**62)], 400), ([1, True, 2], 400), ([1, "2"], 400)],
    ids=["huge", "extreme-ints", "non-ascii", "dict", "int", "none", "negative", "extreme-negative", "bools",
         "mixed"],
)
def test_absurd_prompts_are_answered_and_routing_stays_bounded(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], prompt: object, status: int
) -> None:
    """Whatever a client puts in ``prompt``, prefix-aware routing either hashes a bounded prefix of a plain int list
    (at most MAX_PROMPT_BLOCKS blocks) or routes by load; the request is passed on and answered. Token-id lists
    vLLM would refuse (negative ids) and ones it would read otherwise than JSON says (bools, strings) are the
    proxy's 400 naming ``prompt``, before any P is asked (validation.py)."""
    from vllm_kvp2p.proxy.prompt_tokens import tokenize_request

    kind = tokenize_request("/v1/completions", {"model": "m", "prompt": prompt})
    assert kind is prompt or isinstance(kind, dict) or kind is None
    assert isinstance(kind, list) == (isinstance(prompt, list) and all(type(t) is int for t in prompt))
    nowhere = [("tcp://127.0.0.1:9", None)]
    url = make_proxy([stubs["P0"].url], [stubs["D0"].url], prefill_events=nowhere, decode_events=nowhere)
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": prompt}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "prompt" and stubs["P0"].received == []
    assert proxy_health(url)["prefill"][0]["pending_tokens"] == 0  # released whatever was counted


def test_oversized_body_is_413_and_never_reaches_p(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    """A body over the proxy's cap (--max-body-bytes, 8 MiB) gets a clear 413 without being read whole or sent
    anywhere (tests/unit/test_proxy_large_bodies.py: the bound's reasons)."""
    from vllm_kvp2p.proxy.validation import DEFAULT_MAX_BODY_BYTES

    url = one_pd(stubs, make_proxy)
    r = httpx.post(url + "/v1/completions", content=b"x" * (DEFAULT_MAX_BODY_BYTES + 1), timeout=CLIENT_TIMEOUT)
    assert r.status_code == 413 and "request body over" in r.json()["error"]["message"]
    assert stubs["P0"].received == [] and stubs["D0"].received == []
    assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT).status_code == 200


def test_completion_routes_take_only_post(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    r = httpx.get(url + "/v1/completions", timeout=CLIENT_TIMEOUT)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "only POST" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/nothing", timeout=CLIENT_TIMEOUT).status_code == 404  # the rest: FastAPI's
    assert stubs["P0"].received == []


@pytest.mark.parametrize(
    "value", [b"\xc3\xbcnic\xc3\xb8de-\xff", b"x" * 8000, b"-1", b""], ids=["non-ascii", "huge", "negative", "empty"])
def test_hostile_request_id_and_authorization_headers(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], value: bytes
) -> None:
    """Whatever bytes a client puts in X-Request-Id or Authorization, the request is answered (streamed too)."""
    url = one_pd(stubs, make_proxy)
    headers = {"X-Request-Id": value, "Authorization": value}
    r = httpx.post(url + "/v1/completions", json=COMPLETION, headers=headers, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    with httpx.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True}, headers=headers,
                      timeout=CLIENT_TIMEOUT) as s:
        assert s.status_code == 200 and b"[DONE]" in s.read()
    assert proxy_health(url)["decode"][0]["outstanding"] == 0
