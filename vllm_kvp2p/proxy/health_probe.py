"""Asking instances' ``/health`` (the I/O half of :mod:`health`).

:func:`probe_skipped` runs for the proxy's lifetime and, every second, asks each instance that :mod:`health`
skips whether it is back; it only delivers the answers (``InstancePool.probed``), the state machine decides.
:func:`probe_health` is one such question, also asked of every instance by the proxy's own ``/health?probe=true``
(:func:`vllm_kvp2p.proxy.server.health_report`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from vllm_kvp2p.proxy.health import Health
from vllm_kvp2p.proxy.instances import InstancePool
from vllm_kvp2p.proxy.upstream import TRANSPORT_ERRORS, Upstream, describe

logger = logging.getLogger("vllm_kvp2p.proxy")

#: How often the proxy asks a skipped instance's /health whether it is back.
PROBE_INTERVAL_S = 1.0


async def probe_health(client: Upstream, url: str, timeout_s: float) -> tuple[bool, str | None]:
    """Is ``url``'s ``/health`` answering 200 within ``timeout_s``? And if not, why not."""
    try:
        resp = await client.request("GET", url + "/health", timeout_s)
    except TRANSPORT_ERRORS as exc:
        return False, describe(exc)
    if resp.status != 200:
        return False, f"HTTP {resp.status}"
    return True, None


async def probe_skipped(pools: Sequence[InstancePool], client: Upstream, timeout_s: float) -> None:
    """Every :data:`PROBE_INTERVAL_S`, probe each instance that is not up and report the answer to its pool."""
    while True:
        await asyncio.sleep(PROBE_INTERVAL_S)
        down = [(pool, inst.url) for pool in pools for inst in pool.instances if inst.health.state is not Health.UP]
        if not down:
            continue
        results = await asyncio.gather(*(probe_health(client, url, timeout_s) for _, url in down))
        for (pool, url), (ok, err) in zip(down, results, strict=True):
            pool.probed(url, ok, err)
            if ok:
                logger.info("instance %s answers /health again: routed to again", url)
