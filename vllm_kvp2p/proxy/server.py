"""The proxy's app: its instance pools, routing settings (docs/routing.md) and request bounds, and its routes
(docs/api.md): all on bare ASGI (:mod:`asgi`) but ``/health``, which FastAPI serves with the lifespan
(:func:`health_report`; the instances' own ``/health`` is asked by :mod:`health_probe`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from vllm_kvp2p.proxy.app import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_HEALTH_PROBE_TIMEOUT_S,
    DEFAULT_MAX_BATCH_CONCURRENCY,
    DEFAULT_MAX_ORPHAN_PREFILLS,
    DEFAULT_TIMEOUT_S,
    PDProxy,
)
from vllm_kvp2p.proxy.asgi import ProxyASGI
from vllm_kvp2p.proxy.block_hashes import DEFAULT_ALGORITHM, make_hasher
from vllm_kvp2p.proxy.cache_index import DEFAULT_MAX_BLOCKS
from vllm_kvp2p.proxy.disaggregation import DEFAULT_THRESHOLD_TOKENS, Mode, Objectives
from vllm_kvp2p.proxy.health_probe import probe_health
from vllm_kvp2p.proxy.instances import InstancePool
from vllm_kvp2p.proxy.local_tokenizer import LocalTokenizer
from vllm_kvp2p.proxy.placement import Placer
from vllm_kvp2p.proxy.prompt_tokens import DEFAULT_TOKENIZE_TIMEOUT_S, PromptReader, reader_snapshot
from vllm_kvp2p.proxy.routing import Policy
from vllm_kvp2p.proxy.upstream import normalize_url
from vllm_kvp2p.proxy.validation import DEFAULT_MAX_BATCH_PROMPTS, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_N, Limits

logger = logging.getLogger("vllm_kvp2p.proxy")


def create_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    health_probe_timeout_s: float = DEFAULT_HEALTH_PROBE_TIMEOUT_S,
    probe_backends_on_health: bool = False,
    max_connections: int | None = None,
    routing: Policy = Policy.PREFIX_AWARE,
    prefix_weight: float = 1.0,
    prefill_events: Sequence[tuple[str, str | None] | None] | None = None,
    decode_events: Sequence[tuple[str, str | None] | None] | None = None,
    hash_algo: str = DEFAULT_ALGORITHM,
    hash_seed: str | None = None,
    index_max_blocks: int = DEFAULT_MAX_BLOCKS,
    tokenize_timeout_s: float = DEFAULT_TOKENIZE_TIMEOUT_S,
    tokenizer: str | None = None,
    max_n: int = DEFAULT_MAX_N,
    max_batch_prompts: int = DEFAULT_MAX_BATCH_PROMPTS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_batch_concurrency: int = DEFAULT_MAX_BATCH_CONCURRENCY,
    cache_headers: bool = False,
    max_orphan_prefills: int = DEFAULT_MAX_ORPHAN_PREFILLS,
    kv_both: bool = False,
    disaggregate: Mode | None = None,
    objectives: Objectives | None = None,
    threshold: int = DEFAULT_THRESHOLD_TOKENS,
) -> ProxyASGI:
    """Build the proxy app for the given P and D instances (urls like ``http://host:port`` or ``host:port``).

    ``timeout_s`` bounds everything up to D's first response byte (prefill included) and any silence between
    two stream chunks; ``connect_timeout_s`` bounds each TCP connect. ``GET /health?probe=true`` (or every
    /health if ``probe_backends_on_health``) also checks the backends. ``max_connections=None`` means no cap
    on pooled upstream connections (each streaming request holds one for its whole duration).

    ``routing`` chooses the policy (routing.py). ``prefill_events`` / ``decode_events`` give, per instance in
    order, its KV-event publisher and replay endpoints (``None``: that instance publishes none); with any of
    them and ``prefix-aware`` routing the proxy keeps a cache index and hashes prompts with ``hash_algo`` and
    ``hash_seed`` (the engines' ``--prefix-caching-hash-algo`` and ``PYTHONHASHSEED``; raises
    :class:`~vllm_kvp2p.proxy.block_hashes.HashSettingsError` for settings that could never match them).
    ``tokenizer`` (the engines' tokenizer files) lets the proxy tokenize text completion prompts itself rather
    than ask a P's ``/tokenize`` (raises :class:`~vllm_kvp2p.proxy.local_tokenizer.TokenizerSettingsError`).
    ``max_n`` bounds the sequences of one request (its ``n``, times its prompts when it is a batch),
    ``max_batch_prompts`` the prompts of one batched completion request (400 past either, before any P is asked),
    ``max_body_bytes`` a request's body (413 past it); a batch runs ``max_batch_concurrency`` prompts at once
    (docs/api.md).
    ``cache_headers`` adds ``X-KVP2P-Prefill-Cached-Tokens`` / ``X-KVP2P-Decode-Cached-Tokens`` to every answer:
    off by default, since any client could then learn which prefixes other clients' prompts share.
    ``prefill_urls`` empty makes the proxy of ordinary instances: each request goes whole to one of
    ``decode_urls`` (``--instances``), unless ``kv_both``: then ``decode_urls`` are instances that may each
    prefill for another and decode (``--kv-both``). ``disaggregate`` (default: ``auto`` for ``kv_both``,
    ``always`` with a P step, ``never`` without), ``objectives`` and ``threshold`` decide per request
    (placement.py, disaggregation.py). The :class:`PDProxy` is available as ``app.proxy``.
    """
    if not prefill_urls and prefill_events:
        raise ValueError("KV events for prefill instances, but there are none")
    if not 0 <= prefix_weight <= 100:
        raise ValueError(f"prefix_weight={prefix_weight}: allowed 0..100")
    if tokenize_timeout_s <= 0:
        raise ValueError("tokenize_timeout_s must be positive")
    if kv_both and prefill_urls:
        raise ValueError("kv_both instances are given in decode_urls alone")
    mode = disaggregate or (Mode.AUTO if kv_both else Mode.ALWAYS if prefill_urls else Mode.NEVER)
    with_events = routing is Policy.PREFIX_AWARE and any(e for e in (*(prefill_events or ()), *(decode_events or ())))
    # auto decides by the prompt's tokens, so it reads them even without KV events to match its hashes against.
    hasher = make_hasher(hash_algo, hash_seed) if with_events or mode is Mode.AUTO else None

    def pool(urls: Sequence[str], events: Sequence[tuple[str, str | None] | None] | None) -> InstancePool:
        return InstancePool(
            [normalize_url(u) for u in urls],
            policy=routing,
            prefix_weight=prefix_weight,
            events=events if with_events else None,
            max_blocks=index_max_blocks,
        )

    decode = pool(decode_urls, decode_events)
    # --kv-both: one pool in both roles; --instances: no P step.
    prefill = decode if kv_both else pool(prefill_urls, prefill_events) if prefill_urls else None
    proxy = PDProxy(
        prefill,
        decode,
        timeout_s=timeout_s,
        connect_timeout_s=connect_timeout_s,
        health_probe_timeout_s=health_probe_timeout_s,
        max_connections=max_connections,
        # Loaded only when prompts are hashed at all: without KV events the tokens would be unused.
        prompts=None if hasher is None else PromptReader(
            hasher, timeout_s=tokenize_timeout_s, local_tokenizer=LocalTokenizer(tokenizer) if tokenizer else None),
        limits=Limits(max_n=max_n, max_batch_prompts=max_batch_prompts, max_body_bytes=max_body_bytes),
        max_batch_concurrency=max_batch_concurrency,
        max_orphan_prefills=max_orphan_prefills,
        cache_headers=cache_headers,
        placer=Placer(prefill, decode, mode, objectives, threshold),
    )
    if routing is Policy.PREFIX_AWARE and hasher is None:
        logger.info(
            "prefix-aware routing without KV events (--prefill-kv-events / --decode-kv-events): routed by load only"
        )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        logger.info(
            "P/D proxy: prefill %s, decode %s, routing %s, disaggregate %s%s%s",
            "none (ordinary instances, whole requests to the decode pool)" if proxy.prefill is None
            else "the same kv_both instances" if kv_both else list(proxy.prefill.urls),
            list(proxy.decode.urls),
            routing.value,
            mode.value,
            "" if mode is not Mode.AUTO else f" by {objectives}" if objectives
            else f" by a {threshold}-token threshold",
            "" if hasher is None or not with_events else f" by KV events (hash {hasher.algorithm})",
        )
        try:
            yield
        finally:
            await proxy.stop()

    # No docs routes: every path but /health is answered before FastAPI (asgi.py, routes.py).
    app = FastAPI(title="vllm-kvp2p P/D proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health(probe: bool | None = None) -> JSONResponse:
        return await health_report(proxy, probe_backends_on_health if probe is None else probe)

    return ProxyASGI(proxy, app)


async def health_report(proxy: PDProxy, probe: bool) -> JSONResponse:
    """Instances and their outstanding counts, and the prefill retry count; with ``probe``, also each
    backend's own /health.

    Probing answers 503 when a whole role (all P or all D) is down, since no request can succeed then.
    """
    prefill = [] if proxy.prefill is None or proxy.prefill is proxy.decode else proxy.prefill.snapshot()
    decode = proxy.decode.snapshot()
    status_code = 200
    body: dict[str, Any] = {
        "status": "ok",
        "prefill": prefill,
        "decode": decode,
        "prefill_retries": proxy.prefill_retries,
        "hold_abandons": proxy.abandons(),
        "placement": proxy.placer.snapshot(),
        "routing": {
            "policy": proxy.decode.policy.value,
            "prefix_weight": proxy.decode.prefix_weight,
            "kv_events": proxy.prompts is not None,
            "index_blocks": sum(len(i.cache) for pool in proxy.pools for i in pool.instances),
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
        if (prefill and not any(e["healthy"] for e in prefill)) or not any(
                e["healthy"] for e in decode):
            body["status"] = "unhealthy"
            status_code = 503
    return JSONResponse(body, status_code)
