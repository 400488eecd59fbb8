"""Asking an instance's /metrics what it can pair with (the I/O half of :mod:`pairing`): one GET, never raising
on a transport failure, an error status or text without the metric."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from vllm_kvp2p.proxy.instances import InstancePool
from vllm_kvp2p.proxy.pairing import MAX_METRICS_CHARS, PairingKey, read_metrics
from vllm_kvp2p.proxy.upstream import TRANSPORT_ERRORS, Upstream, describe

logger = logging.getLogger("vllm_kvp2p.proxy")

#: How often every instance's key is read again (an instance may restart with another model or settings).
RELEARN_S = 30.0
#: How soon an instance whose key could not be read is asked again.
RETRY_S = 2.0


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


async def keep_pairings(pools: Sequence[InstancePool], client: Upstream, timeout_s: float) -> None:
    """Read every instance's key at once, then every :data:`RELEARN_S` (an instance without one every
    :data:`RETRY_S`); each :class:`~vllm_kvp2p.proxy.instances.Instance` keeps the last key read (a failed read
    keeps the one before: an instance that stops answering is health's business, not pairing's). Runs until
    cancelled."""
    instances = [inst for pool in pools for inst in pool.instances]
    said: dict[str, str] = {}
    since_all = RELEARN_S
    while True:
        todo = instances if since_all >= RELEARN_S else [i for i in instances if i.pairing is None]
        since_all = 0.0 if todo is instances else since_all
        keys = await asyncio.gather(*(probe_pairing(client, inst.url, timeout_s) for inst in todo))
        for inst, key in zip(todo, keys, strict=True):
            if isinstance(key, PairingKey):
                if inst.pairing != key and inst.pairing is not None:
                    logger.warning("instance %s now reports other pairing values: %s", inst.url, key)
                inst.pairing = key
                said.pop(inst.url, None)
            elif said.get(inst.url) != key:  # once per reason: an instance still starting says it again and again
                said[inst.url] = key
                logger.info("instance %s: no pairing values yet (%s); D's own check decides its pairs meanwhile",
                            inst.url, key)
        await asyncio.sleep(RETRY_S)
        since_all += RETRY_S
