"""Large, deep and multiplied request bodies (issue 45, item 8), through the real proxy under uvicorn in front of
the stub engines of proxy_harness.py.

The findings: one 62 MiB body stalled the proxy for every client (``/health`` 6 ms -> 2,308 ms: parsed, validated
and re-serialised on its event loop); a batch multiplied the bound on ``n`` (1,024 prompts x n = 16,384 accepted as
one request of 16.7 M sequences); a 1,000,000-deep nested JSON body got HTTP 500 with a ``RecursionError``
traceback in the proxy's log. Now: a body over ``--max-body-bytes`` (default 8 MiB, the largest real prompt: a
1,000,000-token prompt as token ids) is a 413 naming the setting, refused before it is read whole; the sequences
of one request (prompts x n) are bounded by ``--max-n``; nesting deeper than the proxy's bound is a 400 that says
so.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.unit import proxy_harness as harness
from tests.unit.proxy_harness import CLIENT_TIMEOUT, COMPLETION, Stub, assert_openai_error, one_pd

stubs = harness.stubs
make_proxy = harness.make_proxy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _reset_stubs(request: pytest.FixtureRequest) -> None:
    if "stubs" in request.fixturenames:
        for s in request.getfixturevalue("stubs").values():
            s.reset()


def nested(depth: int) -> bytes:
    """A completion body with a field the proxy passes on unread, ``depth`` lists deep."""
    return b'{"model": "m", "max_tokens": 4, "prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"


# -- nesting ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("depth", "says"), [
    (1_000_000, "1000001 JSON arrays and objects"),  # refused by their count, before the parser sees them
    (5_000, "nests JSON arrays and objects too deeply"),  # past Python's recursion limit
    (200, "more than 128 levels deep"),  # parsed, deeper than the proxy's bound
], ids=["1e6-deep", "5000-deep", "200-deep"])
def test_a_deeply_nested_body_is_a_400_that_says_so(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], caplog: pytest.LogCaptureFixture, depth: int, says: str
) -> None:
    """1,000,000 and 5,000 deep: json's parser hits Python's recursion limit (before: a 500 and a traceback in the
    log); 200 deep: parsed, but deeper than the proxy takes (before: sent on to P and D)."""
    caplog.set_level(logging.INFO)
    url = one_pd(stubs, make_proxy)
    r = httpx.post(url + "/v1/completions", content=nested(depth), timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400, says)
    assert stubs["P0"].received == [] and stubs["D0"].received == []
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info], caplog.text
    # The control: JSON nested as real requests nest (chat content parts, tool schemas) goes through.
    tools = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": tools}}]}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT).status_code == 200


# -- prompts x n -----------------------------------------------------------------------------------------------


def test_a_batch_times_n_is_bounded_by_max_n(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    """The sequences one request asks for are its prompts times n: before, each prompt's n was checked alone, so
    1,024 prompts x n = 16,384 passed as 16.7 M sequences."""
    url = one_pd(stubs, make_proxy, max_n=8)
    body = {**COMPLETION, "prompt": ["a", "b", "c"], "n": 3, "temperature": 0.7}
    r = httpx.post(url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT)
    message = assert_openai_error(r, 400, "9 sequences", "--max-n")
    assert "3 prompts" in message and r.json()["error"]["param"] == "n"
    assert stubs["P0"].received == []
    r = httpx.post(url + "/v1/completions", json={**body, "n": 2, "prompt": ["a", "b", "c", "d"]},
                   timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8  # 8 sequences: the bound itself


# -- the body's size -------------------------------------------------------------------------------------------


def test_a_body_over_max_body_bytes_is_a_413_naming_the_setting(
    stubs: dict[str, Stub], make_proxy: Callable[..., str]
) -> None:
    limit = 64 * 1024
    url = one_pd(stubs, make_proxy, max_body_bytes=limit)
    fill = limit - len(json.dumps({**COMPLETION, "prompt": ""}))
    at_limit = json.dumps({**COMPLETION, "prompt": "x" * fill}).encode()
    assert len(at_limit) == limit
    assert httpx.post(url + "/v1/completions", content=at_limit, timeout=CLIENT_TIMEOUT).status_code == 200
    over = json.dumps({**COMPLETION, "prompt": "x" * (fill + 1)}).encode()
    for chunked in (False, True):  # Content-Length known (refused before reading), or not (refused past it)
        content = iter([over]) if chunked else over
        r = httpx.post(url + "/v1/completions", content=content, timeout=CLIENT_TIMEOUT)
        message = assert_openai_error(r, 413, str(limit), "--max-body-bytes")
        assert r.json()["error"]["param"] is None, message
    assert len(stubs["P0"].received) == 1  # only the body at the limit
    # The forwarded routes take the same bound.
    r = httpx.post(url + "/tokenize", content=over, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 413, "--max-body-bytes")


def test_health_answers_while_a_62_mib_body_arrives(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    """The finding's body (62 MiB; here of token ids, the costliest JSON per byte to parse, check and re-send): before,
    the proxy read it whole and worked through it on its loop, every other client waiting (its /health took
    seconds); now it is refused once past the default bound, and /health stays prompt. A generous bound, not a
    speed figure: it stops a stall of seconds, not a slow machine."""
    url = one_pd(stubs, make_proxy)
    body = b'{"model": "m", "max_tokens": 4, "prompt": [' + b"123456, " * (62 * 2**20 // 8) + b"7]}"
    assert len(body) >= 62 * 2**20
    result: list[httpx.Response | Exception] = []

    def send() -> None:
        try:
            result.append(httpx.post(url + "/v1/completions", content=iter([body[i:i + 2**20] for i in
                                                                             range(0, len(body), 2**20)]),
                                     timeout=httpx.Timeout(60.0)))
        except httpx.HTTPError as exc:
            result.append(exc)

    sender = threading.Thread(target=send)
    worst = 0.0
    with httpx.Client(timeout=httpx.Timeout(30.0)) as client:
        assert client.get(url + "/health").status_code == 200  # connected before the body starts
        sender.start()
        while sender.is_alive():
            t0 = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.02)
        t0 = time.monotonic()
        assert client.get(url + "/health").status_code == 200
        worst = max(worst, time.monotonic() - t0)
    sender.join()
    print(f"/health's slowest round trip while a {len(body) >> 20} MiB body arrived: {worst * 1000:.0f} ms")
    (answer,) = result
    assert isinstance(answer, httpx.Response), answer
    assert_openai_error(answer, 413, "--max-body-bytes")
    assert worst < 1.0
    assert stubs["P0"].received == []


def test_arrays_and_objects_are_counted_outside_strings() -> None:
    """The count that bounds a body before it is parsed: brackets inside strings (escaped quotes and backslashes
    around them) are not containers. Checked against the parsed JSON, on bodies whose plain bracket count is over
    the bound (so the exact count is the one used)."""
    import random

    from vllm_kvp2p.proxy.json_body import MAX_CONTAINERS, containers_in

    def count(value: object) -> int:
        if isinstance(value, dict):
            return 1 + sum(count(v) for v in value.values())
        if isinstance(value, list):
            return 1 + sum(count(v) for v in value)
        return 0

    rng = random.Random(45)
    pieces = ["[", "]", "{", "}", '"', "\\", "\\\\", '\\"', "a", "é", "\\u005b"]
    for _ in range(20):
        strings = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))) for _ in range(50)]
        body = {"x": [[s, {"k": [s]}] for s in strings], "s": "[{" * (MAX_CONTAINERS // 2 + 1)}
        raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode()
        assert containers_in(raw) == count(json.loads(raw))
