"""Asking an instance's /metrics what it can pair with (the I/O half of :mod:`pairing`): one GET, never raising
on a transport failure, an error status or text without the metric."""

from __future__ import annotations

from vllm_kvp2p.proxy.pairing import MAX_METRICS_CHARS, PairingKey, read_metrics
from vllm_kvp2p.proxy.upstream import TRANSPORT_ERRORS, Upstream, describe


async def probe_pairing(client: Upstream, url: str, timeout_s: float) -> PairingKey | str:
    """``url``'s key (``url`` as :func:`~vllm_kvp2p.proxy.upstream.normalize_url` gives it), or why the proxy
    has none: unreachable, not 200, or :func:`~vllm_kvp2p.proxy.pairing.read_metrics`'s reason."""
    try:
        answer = await client.request("GET", url + "/metrics", timeout_s)
    except TRANSPORT_ERRORS as exc:
        return f"GET {url}/metrics: {describe(exc)}"
    if answer.status != 200:
        return f"GET {url}/metrics: HTTP {answer.status}"
    # Decoded from a bounded prefix: the parse reads no more than MAX_METRICS_CHARS characters anyway.
    return read_metrics(answer.body[:MAX_METRICS_CHARS].decode("utf-8", errors="replace"))


async def learn_pairing(client: Upstream, url: str, timeout_s: float) -> PairingKey | None:
    """``url``'s key, or None when it cannot be learned (:func:`probe_pairing` says why)."""
    key = await probe_pairing(client, url, timeout_s)
    return key if isinstance(key, PairingKey) else None
