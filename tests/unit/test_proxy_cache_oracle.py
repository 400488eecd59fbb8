"""Issue 37 item 4, no cache oracle: the proxy's answers tell no client what is cached unless ``--cache-headers``
says so, and a request vLLM hashes with extra keys (``cache_salt``, a LoRA adapter, multimodal content, prompt
embeddings) is routed by load whatever form its prompt has: :func:`why_not_hashed` (pure, every combination) and
the real :class:`PromptReader`, then the proxy run for real against proxy_harness.py's stub engines."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.unit import proxy_harness as harness
from tests.unit.proxy_harness import CLIENT_TIMEOUT, COMPLETION, Stub
from vllm_kvp2p.proxy.block_hashes import make_hasher
from vllm_kvp2p.proxy.cli import build_parser
from vllm_kvp2p.proxy.prompt_tokens import (
    MODELS_RETRY_S,
    PromptReader,
    base_model_names,
    tokenize_request,
    why_not_hashed,
)
from vllm_kvp2p.proxy.upstream import Answer

# proxy_harness.py's fixtures: its stub engines (their own, for this module) and proxies.
stubs = harness.stubs
make_proxy = harness.make_proxy

pytestmark = pytest.mark.timeout(30)

NOWHERE = [("tcp://127.0.0.1:9", None)]  # KV events configured (prompts read and hashed); nothing arrives
CACHE_HEADERS = ("x-kvp2p-prefill-cached-tokens", "x-kvp2p-decode-cached-tokens")
KEPT_HEADERS = ("x-kvp2p-prefill-instance", "x-kvp2p-decode-instance", "x-kvp2p-route-ms", "x-kvp2p-prefill-ms",
                "x-kvp2p-path")
TOKENS = list(range(70))
TEXT_PART = {"type": "text", "text": "what is in it?"}
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.fixture(autouse=True)
def _reset_stubs(request: pytest.FixtureRequest) -> None:
    if "stubs" in request.fixturenames:
        for s in request.getfixturevalue("stubs").values():
            s.reset()


# -- the decision, pure -----------------------------------------------------------------------------------------

SALTS = (None, "secret-salt", "")
LORA_REQUESTS = (None, {"lora_name": "a", "lora_int_id": 1, "lora_path": "/a"})
EMBEDS = (None, "AAAA")
CONTENTS = ("plain", "text-parts", "bare-text-part", "image", "audio-in-a-later-message", "odd-part", "odd-content")
MODELS = (None, "base", "adapter", ["not", "a", "name"])
BASES = (None, frozenset({"base"}))


def chat_messages(content: str) -> list[dict[str, Any]]:
    return {
        "plain": [{"role": "user", "content": "hi"}],
        "text-parts": [{"role": "user", "content": [TEXT_PART, {"type": "input_text", "text": "x"}]}],
        "bare-text-part": [{"role": "user", "content": [{"text": "hi"}]}],
        "image": [{"role": "user", "content": [TEXT_PART, IMAGE_PART]}],
        "audio-in-a-later-message": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
        "odd-part": [{"role": "user", "content": [{"image_url": {"url": "x"}}]}],  # no type: vLLM guesses media
        "odd-content": [{"role": "user", "content": {"type": "image_url"}}],
    }[content]


@pytest.mark.parametrize(("salt", "lora", "embeds", "content", "model", "bases"),
                         list(itertools.product(SALTS, LORA_REQUESTS, EMBEDS, CONTENTS, MODELS, BASES)))
def test_why_not_hashed_every_combination(
    salt: str | None, lora: dict[str, Any] | None, embeds: str | None, content: str, model: Any,
    bases: frozenset[str] | None,
) -> None:
    """Hashed only when nothing gives vLLM extra keys: no salt (an empty one included: vLLM refuses it anyway), no
    lora_request, no prompt_embeds, text only, and a base model (or no model, or base models unknown). The same
    answer for a completion with a text prompt, with token ids, and for chat: the prompt's form does not matter."""
    extra: dict[str, Any] = {k: v for k, v in (("cache_salt", salt), ("lora_request", lora), ("prompt_embeds", embeds),
                                               ("model", model)) if v is not None}
    adapter = bases is not None and model is not None and model != "base"
    multimodal = content in ("image", "audio-in-a-later-message", "odd-part", "odd-content")
    chat = {"messages": chat_messages(content), **extra}
    expected_chat = salt is None and lora is None and embeds is None and not multimodal and not adapter
    reason = why_not_hashed(chat, bases)
    assert (reason is None) == expected_chat, reason
    assert (tokenize_request("/v1/chat/completions", chat, bases) is None) == (not expected_chat)
    expected = salt is None and lora is None and embeds is None and not adapter  # completions carry no messages
    for prompt in ("some text", TOKENS):
        body = {"prompt": prompt, **extra}
        assert (why_not_hashed(body, bases) is None) == expected
        request = tokenize_request("/v1/completions", body, bases)
        assert (request is None) == (not expected)
        assert request is None or request == prompt or request["prompt"] == prompt
    if salt is not None:
        assert why_not_hashed({"prompt": TOKENS, **extra}, bases) == "cache_salt"  # named first


def test_base_model_names_from_v1_models() -> None:
    listed = {"data": [{"id": "base", "parent": None}, {"id": "other"}, {"id": "a", "parent": "base"}, {"id": 3},
                       "junk"]}
    assert base_model_names(listed) == frozenset({"base", "other"})
    for bad in (None, [], {"data": None}, {"data": [{"id": "a", "parent": "b"}]}, {"data": []}):
        assert base_model_names(bad) is None


# -- the real PromptReader --------------------------------------------------------------------------------------


class FakeUpstream:
    """Answers ``GET /v1/models`` (``models``: its JSON, or an HTTP status) and records every request."""

    def __init__(self, models: Any = 200) -> None:
        self.models = models
        self.calls: list[tuple[str, str]] = []

    async def request(self, method: str, url: str, timeout_s: float, *, body: Any = None,
                      headers: Any = None) -> Answer:
        self.calls.append((method, url))
        if url.endswith("/v1/models") and not isinstance(self.models, int):
            return Answer.of_json(self.models)
        return Answer(self.models if isinstance(self.models, int) else 404, b"{}", "application/json")


def read(reader: PromptReader, client: FakeUpstream, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    return asyncio.run(reader.blocks(client, lambda: "http://p0", path, body,  # type: ignore[arg-type]
                                     {"X-Request-Id": "r"}, 5.0, "r"))


def test_a_token_id_prompt_with_a_cache_salt_is_not_hashed() -> None:
    """The bug: token ids were returned before the salt was looked at, so a salted prompt was looked up under the
    unsalted hashes of other users' prompts. Now: no blocks, so routed by load; no tokenize, no hash."""
    reader = PromptReader(make_hasher(), timeout_s=2.0, local_tokenizer=None)
    client = FakeUpstream()
    assert read(reader, client, {"prompt": TOKENS, "cache_salt": "s3cret"}) is None
    assert read(reader, client, {"prompt": TOKENS, "lora_request": {"lora_name": "a"}}) is None
    assert read(reader, client, {"prompt": "text", "cache_salt": "s3cret"}) is None
    chat = {"messages": [{"role": "user", "content": [TEXT_PART, IMAGE_PART]}]}
    assert read(reader, client, chat, "/v1/chat/completions") is None
    assert client.calls == []  # neither /tokenize nor anything else asked
    assert (reader.tokenized_by_p, reader.tokenize_failures) == (0, 0)
    blocks = read(reader, client, {"prompt": TOKENS})
    assert blocks is not None and list(blocks.tokens) == TOKENS and blocks.keys_for(32)


def test_a_request_naming_a_lora_adapter_is_routed_by_load() -> None:
    """The base model names come from a P's /v1/models, asked once: a request naming another model (an adapter, as
    vLLM lists them) gets no blocks."""
    reader = PromptReader(make_hasher(), timeout_s=2.0, local_tokenizer=None)
    client = FakeUpstream({"data": [{"id": "base"}, {"id": "adapter", "parent": "base"}]})
    assert read(reader, client, {"model": "adapter", "prompt": TOKENS}) is None
    assert read(reader, client, {"model": "base", "prompt": TOKENS}) is not None
    assert read(reader, client, {"prompt": TOKENS}) is not None  # no model: vLLM's first base model
    assert read(reader, client, {"model": "loaded-later", "prompt": TOKENS}) is None
    assert client.calls == [("GET", "http://p0/v1/models")] and reader.base_models == frozenset({"base"})


def test_without_v1_models_only_the_body_counts_and_it_is_asked_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = PromptReader(make_hasher(), timeout_s=2.0, local_tokenizer=None)
    client = FakeUpstream(503)
    assert read(reader, client, {"model": "adapter", "prompt": TOKENS}) is not None  # unknown: hashed
    assert read(reader, client, {"model": "adapter", "prompt": TOKENS, "cache_salt": "s"}) is None
    assert len(client.calls) == 1  # not again within MODELS_RETRY_S
    import vllm_kvp2p.proxy.prompt_tokens as prompt_tokens

    later = prompt_tokens.time.monotonic() + MODELS_RETRY_S + 1
    monkeypatch.setattr(prompt_tokens.time, "monotonic", lambda: later)
    client.models = {"data": [{"id": "base"}]}
    assert read(reader, client, {"model": "adapter", "prompt": TOKENS}) is None
    assert len(client.calls) == 2 and reader.base_models == frozenset({"base"})


# -- the headers, through the proxy ------------------------------------------------------------------------------


def answers(url: str, stubs: dict[str, Stub]) -> dict[str, httpx.Response]:
    """One answer of every kind the proxy gives after routing."""
    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(url + path, json=body, timeout=CLIENT_TIMEOUT)

    out = {
        "json": post("/v1/completions", {**COMPLETION, "prompt": TOKENS}),
        "text": post("/v1/completions", COMPLETION),
        "chat": post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        "batch": post("/v1/completions", {**COMPLETION, "prompt": [TOKENS, [1, 2, 3]]}),
    }
    with httpx.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True},
                      timeout=CLIENT_TIMEOUT) as r:
        r.read()
        out["stream"] = r
    stubs["D0"].mode = "400"  # D's 4xx passed through carries the routing headers too
    out["d-400"] = post("/v1/completions", COMPLETION)
    stubs["D0"].mode = "ok"
    return out


@pytest.mark.parametrize("events", [False, True], ids=["by-load", "by-kv-events"])
def test_the_default_proxy_tells_no_client_what_is_cached(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], caplog: pytest.LogCaptureFixture, events: bool
) -> None:
    """No X-KVP2P-*-Cached-Tokens on any answer, not even "0" (batches included: their body carries each part's
    headers); the instances and times stay, and the proxy's log line keeps the counts."""
    caplog.set_level(logging.INFO, logger="vllm_kvp2p.proxy")
    kwargs: dict[str, Any] = {"prefill_events": NOWHERE, "decode_events": NOWHERE} if events else {}
    url = make_proxy([stubs["P0"].url], [stubs["D0"].url], **kwargs)
    got = answers(url, stubs)
    assert [r.status_code for r in got.values()] == [200, 200, 200, 200, 200, 400]
    for kind, r in got.items():
        assert not any(h in r.headers for h in CACHE_HEADERS), (kind, dict(r.headers))
        if kind not in ("stream", "batch"):
            assert all(h in r.headers for h in KEPT_HEADERS), (kind, dict(r.headers))
    routes = got["batch"].json()["kv_transfer_params"]["kvp2p_routes"]  # a batch's: one per prompt, in its body
    assert [sorted(r) for r in routes] == [sorted(h.removeprefix("x-kvp2p-").replace("-", "_")
                                                  for h in KEPT_HEADERS)] * 2
    counts = [m for m in caplog.messages if re.search(r" ms, 0 tokens cached\) -> decode \S+ \(0 cached; ", m)]
    assert len(counts) == 7, caplog.messages  # one per prompt routed (the batch's two included)


def test_with_cache_headers_every_answer_says_what_is_cached(
    stubs: dict[str, Stub], make_proxy: Callable[..., str]
) -> None:
    url = make_proxy([stubs["P0"].url], [stubs["D0"].url], prefill_events=NOWHERE, decode_events=NOWHERE,
                     cache_headers=True)
    got = answers(url, stubs)
    for kind in ("json", "text", "chat", "d-400"):
        assert [got[kind].headers.get(h) for h in CACHE_HEADERS] == ["0", "0"], kind
    routes = got["batch"].json()["kv_transfer_params"]["kvp2p_routes"]
    assert [[r[h.removeprefix("x-kvp2p-").replace("-", "_")] for h in CACHE_HEADERS] for r in routes] == [
        ["0", "0"], ["0", "0"]]
    assert got["stream"].headers.get(CACHE_HEADERS[0]) == "0"


def test_a_multimodal_chat_request_is_not_tokenized(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    """Through the proxy: a text chat prompt is tokenized by a P (then hashed), one with an image is not asked
    about at all; a salted token-id prompt and an adapter's neither (nothing to ask: routed by load)."""
    stubs["P0"].serves_tokenize = True
    url = make_proxy([stubs["P0"].url], [stubs["D0"].url], prefill_events=NOWHERE, decode_events=NOWHERE)
    chat = {"model": "m", "messages": [{"role": "user", "content": [TEXT_PART]}]}
    for body in (chat, {**chat, "messages": [{"role": "user", "content": [TEXT_PART, IMAGE_PART]}]},
                 {**chat, "cache_salt": "s3cret"}, {**chat, "model": "m-lora"}):
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 200, r.text
    assert [q["path"] for q in stubs["P0"].received] == ["/tokenize"] + ["/v1/chat/completions"] * 4
    routing = harness.proxy_health(url)["routing"]
    assert (routing["tokenized_by_p"], routing["tokenize_failures"]) == (1, 0)


def test_cli_cache_headers_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_kvp2p.proxy import cli

    parser = build_parser()
    assert parser.parse_args(["--prefill", "p:1", "--decode", "d:1"]).cache_headers is False
    assert parser.parse_args(["--prefill", "p:1", "--decode", "d:1", "--cache-headers"]).cache_headers is True
    assert "other clients" in parser.format_help()
    seen: dict[str, Any] = {}

    def fake_create_app(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(cli, "create_app", fake_create_app)
    for argv, expected in ((["--cache-headers"], True), ([], False)):
        with pytest.raises(SystemExit):
            cli.main(["--prefill", "p:1", "--decode", "d:1", *argv])
        assert seen["cache_headers"] is expected
