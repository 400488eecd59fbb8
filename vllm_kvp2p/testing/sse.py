"""Server-sent events read as the SSE standard splits them: on CR LF, LF or CR only.

httpx's ``iter_lines`` splits text with ``str.splitlines``, which also breaks at U+0085, U+2028, U+2029 and
\\x1c-\\x1e. vLLM writes generated text into its JSON unescaped, and JSON only escapes \\x00-\\x1f, so a token that
decodes to U+0085 or U+2028 (the tiny test model makes them) cuts a ``data:`` line in two and the client's
``json.loads`` fails. Found by bench_ttft_timeline.py on 4096-token prompts; every streamed test and benchmark
reads through this instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx


def sse_lines(resp: httpx.Response) -> Iterator[str]:
    """The response's lines, split only where SSE splits them (``\\r\\n``, ``\\n`` or ``\\r``)."""
    pending = b""
    for chunk in resp.iter_bytes():
        pending += chunk
        # A CR at the very end may be the first half of CR LF: keep it until the next chunk says.
        cut = len(pending) - 1 if pending.endswith(b"\r") else len(pending)
        lines = pending[:cut].replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        pending = lines.pop() + pending[cut:]
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if pending:
        yield pending.rstrip(b"\r").decode("utf-8", errors="replace")
