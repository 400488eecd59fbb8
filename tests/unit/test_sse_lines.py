"""sse_lines splits where SSE does, also across chunk borders, and not at the Unicode line breaks httpx's
iter_lines takes (which is what broke a benchmark's JSON)."""

from __future__ import annotations

import json

import httpx

from vllm_kvp2p.testing.sse import sse_lines

#: JSON escapes \x00-\x1f but not these two: vLLM sends them as they are.
EVENT = 'data: {"text": "a\u2028b\u0085c"}'


def _response(chunks: list[bytes]) -> httpx.Response:
    return httpx.Response(200, content=iter(chunks))


def test_unicode_line_breaks_in_a_json_event_stay_in_it() -> None:
    body = (EVENT + "\n\ndata: [DONE]\n\n").encode()
    assert [json.loads(x[6:]) for x in sse_lines(_response([body])) if x.startswith("data: {")] == \
        [{"text": "a\u2028b\u0085c"}]
    # The control: httpx's own line splitting cuts that event in two.
    assert EVENT not in list(_response([body]).iter_lines())


def test_crlf_lf_and_cr_split_also_across_chunk_borders() -> None:
    chunks = [b"data: 1\r", b"\ndata: 2\n", b"data: 3\r", b"data: 4\r\n\r", b"\n", b"data: 5"]
    assert [x for x in sse_lines(_response(chunks)) if x] == ["data: 1", "data: 2", "data: 3", "data: 4", "data: 5"]
