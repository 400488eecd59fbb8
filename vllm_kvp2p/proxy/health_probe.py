"""Asking instances' ``/health`` (the I/O half of :mod:`health`), and the proxy's own ``/health``.

:func:`probe_skipped` runs for the proxy's lifetime and, every second, asks each instance that :mod:`health`
skips whether it is back; it only delivers the answers (``InstancePool.probed``), the state machine decides.
:func:`probe_health` is one such question, also asked of every instance by ``/health?probe=true``
(:func:`health_report`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

from vllm_kvp2p.proxy.health import Health
from vllm_kvp2p.proxy.instances import InstancePool
from vllm_kvp2p.proxy.prompt_tokens import reader_snapshot
from vllm_kvp2p.proxy.upstream import TRANSPORT_ERRORS, Upstream, describe

if TYPE_CHECKING:
    from vllm_kvp2p.proxy.app import PDProxy

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


async def health_report(proxy: PDProxy, probe: bool) -> JSONResponse:
    """Instances and their outstanding counts, and the prefill retry count; with ``probe``, also each
    backend's own /health.

    Probing answers 503 when a whole role (all P or all D) is down, since no request can succeed then.
    """
    prefill = proxy.prefill.snapshot()
    decode = proxy.decode.snapshot()
    status_code = 200
    body: dict[str, Any] = {
        "status": "ok",
        "prefill": prefill,
        "decode": decode,
        "prefill_retries": proxy.prefill_retries,
        "routing": {
            "policy": proxy.prefill.policy.value,
            "prefix_weight": proxy.prefill.prefix_weight,
            "kv_events": proxy.prompts is not None,
            "index_blocks": sum(len(i.cache) for pool in (proxy.prefill, proxy.decode) for i in pool.instances),
            **reader_snapshot(proxy.prompts),
        },
    }
    if probe:
        entries = [*prefill, *decode]
        results = await asyncio.gather(
            *(probe_health(proxy.client, str(e["url"]), proxy.health_probe_timeout_s) for e in entries))
        for entry, (ok, err) in zip(entries, results, strict=True):
            entry["healthy"] = ok
            if err is not None:
                entry["error"] = err
        if not any(e["healthy"] for e in prefill) or not any(e["healthy"] for e in decode):
            body["status"] = "unhealthy"
            status_code = 503
    return JSONResponse(body, status_code)
