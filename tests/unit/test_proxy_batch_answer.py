"""A non-streamed batch's answer has bounded headers, whatever its size (issue 45, item 5).

The finding: the answer joined one header value per prompt (``X-KVP2P-Prefill-Instance``, ``-Decode-Instance``,
``-Route-Ms``, ``-Prefill-Ms``), so with 65-character instance URLs (a Kubernetes service name) a batch of 1,024
prompts carried ~140 KB of headers: the OpenAI Python SDK (httpx, h11's 16 KiB bound on a head) could not read it
(``APIConnectionError``) and re-sent the request twice, each time re-running all 1,024 P/D flows; aiohttp (8 KiB a
header line) failed from 150 prompts. Now the batch answers as it streams: ``X-Request-Id`` and
``X-KVP2P-Batch-Prompts`` only, each prompt's instances and times in the body
(``kv_transfer_params.kvp2p_routes``).

Real clients (the ``openai`` package, aiohttp) against the real proxy under uvicorn, in front of the stub engines
of proxy_harness.py served under a path prefix that makes their URLs 65 characters long (no DNS needed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import httpx
import openai
import pytest

from tests.unit import proxy_harness as harness
from tests.unit.proxy_harness import CLIENT_TIMEOUT, COMPLETION, ServerThread, Stub, make_stub_app

make_proxy = harness.make_proxy  # proxy_harness.py's fixture: the real proxy under uvicorn

pytestmark = pytest.mark.timeout(120)

URL_CHARS = 65
BATCH = 1024
#: The whole head of a batch's answer: a status line and a few short headers, whatever the batch's size.
MAX_HEAD_BYTES = 1024


class UnderPrefix:
    """An ASGI app served under a path prefix (as behind an ingress): ``/prefix/v1/completions`` is the app's
    ``/v1/completions``."""

    def __init__(self, app: Any, prefix: str) -> None:
        self.app, self.prefix = app, prefix

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if not path.startswith(self.prefix):
                await send({"type": "http.response.start", "status": 404, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            scope = {**scope, "path": path[len(self.prefix):] or "/"}
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def long_stubs() -> Iterator[dict[str, Stub]]:
    """A P and a D whose URLs are :data:`URL_CHARS` characters long: 127.0.0.1, the port and a path prefix."""
    out: dict[str, Stub] = {}
    for name in ("P0", "D0"):
        stub = Stub(name, name[0])
        server = ServerThread(make_stub_app(stub))  # bound now: its port decides the prefix's length
        base = f"http://127.0.0.1:{server.port}/"
        prefix = "/" + f"kvp2p-{name.lower()}-svc-".ljust(URL_CHARS - len(base), "x")
        server.server.config.app = UnderPrefix(make_stub_app(stub), prefix)
        stub.server = server.start()
        stub.server.url = base.rstrip("/") + prefix
        assert len(stub.url) == URL_CHARS
        out[name] = stub
    yield out
    for stub in out.values():
        assert stub.server is not None
        stub.server.stop()


def head_bytes(headers: httpx.Headers) -> int:
    return sum(len(k) + len(v) + 4 for k, v in headers.raw)


def test_the_openai_sdk_reads_a_batch_of_1024_prompts_with_65_character_instance_urls(
    long_stubs: dict[str, Stub], make_proxy: Callable[..., str]
) -> None:
    p, d = long_stubs["P0"], long_stubs["D0"]
    url = make_proxy([p.url], [d.url], max_batch_concurrency=64, timeout_s=30.0)
    prompts = [f"prompt {i}" for i in range(BATCH)]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60.0, max_retries=2)
    raw = client.completions.with_raw_response.create(model="m", prompt=prompts, max_tokens=4)
    completion = raw.parse()
    # Once: the SDK did not have to re-send (before, every attempt failed and re-ran all 1,024 flows).
    assert len(p.received) == BATCH and len(d.received) == BATCH
    assert [c.index for c in completion.choices] == list(range(BATCH))
    assert raw.headers["x-kvp2p-batch-prompts"] == str(BATCH)
    assert head_bytes(raw.headers) < MAX_HEAD_BYTES, dict(raw.headers)
    # Each prompt's instances and times: in the body, in prompt order.
    routes = completion.model_extra["kv_transfer_params"]["kvp2p_routes"]
    assert len(routes) == BATCH
    assert all(r["prefill_instance"] == p.url and r["decode_instance"] == d.url for r in routes)
    assert all(float(r["route_ms"]) >= 0 and float(r["prefill_ms"]) >= 0 for r in routes)


def test_aiohttp_reads_a_large_batchs_answer(long_stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    """aiohttp refuses a header line over 8,190 bytes: before, a batch of 150 such prompts."""
    p, d = long_stubs["P0"], long_stubs["D0"]
    for stub in (p, d):
        stub.reset()
    url = make_proxy([p.url], [d.url], max_batch_concurrency=64, timeout_s=30.0)

    async def read() -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as session, session.post(
                url + "/v1/completions", json={**COMPLETION, "prompt": [f"p{i}" for i in range(200)]}) as resp:
            return resp.status, await resp.json()

    status, data = asyncio.run(read())
    assert status == 200 and len(data["choices"]) == 200
    assert len(data["kv_transfer_params"]["kvp2p_routes"]) == 200


def test_a_batch_answer_keeps_only_the_batch_headers(
    long_stubs: dict[str, Stub], make_proxy: Callable[..., str]
) -> None:
    """The shape of the streamed answer's head: the request id and the part count, nothing per prompt."""
    p, d = long_stubs["P0"], long_stubs["D0"]
    url = make_proxy([p.url], [d.url])
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": ["a", "b"]},
                   headers={"X-Request-Id": "b-1"}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    kvp2p = sorted(k for k in r.headers if k.startswith("x-kvp2p-"))
    assert kvp2p == ["x-kvp2p-batch-prompts"] and r.headers["x-request-id"] == "b-1"
