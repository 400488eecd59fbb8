"""FastAPI proxy for disaggregated prefill (P) / decode (D) with the kvp2p connector.

Per request: a prefill instance computes the prompt's KV cache (``max_tokens=1``, ``do_remote_decode``) and
answers with ``kv_transfer_params`` telling where those blocks live; a decode instance then gets the original
request plus those params, pulls the blocks over Mooncake, and generates the answer, which the proxy relays
unchanged (SSE bytes as they arrive, or D's JSON with D's status).

Modelled on vLLM's NIXL ``toy_proxy_server.py``, with what that one lacks for production: one shared pooled
client, routing by cached prefix and load from the engines' KV events (docs/routing.md) that skips an instance
that failed and probes it back, bounded time everywhere, upstream failures mapped to OpenAI-shaped 502/504
errors naming the instance (4xx passed through), mid-stream failures ending the SSE stream with an error event,
and outstanding counts released on every path, client disconnects included.

The prefill step is retried once, on another P when there is one, when P went away before answering (connection
refused, reset, or closed without a response): it is idempotent (a lost answer only leaves a hold on P, which
P's hold timeout frees), so a P that died or restarted costs the client nothing. Timeouts are not retried (a
slow P would get the same work twice), nor HTTP answers (a 4xx/5xx comes from a live P); the retry gets only
what is left of the request's deadline. Retries are logged and counted in /health (``prefill_retries``).

The same flow serves ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/responses``; what differs per route
(P's copy of the body, the checks) is endpoints.py's table. Before any P is asked the request is checked
(validation.py: what P will not see must be what D accepts); a batch of prompts runs as one such flow per prompt
(batch_flow.py). docs/api.md has the whole contract.

Import-light on purpose: no vllm, no torch, so the proxy runs on a small CPU-only box.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from vllm_kvp2p.proxy.batch import batch_prompts
from vllm_kvp2p.proxy.batch_flow import run_batch
from vllm_kvp2p.proxy.decode_step import DecodeStep
from vllm_kvp2p.proxy.disaggregation import Mode, Objectives, ObjectivesError
from vllm_kvp2p.proxy.endpoints import ENDPOINTS
from vllm_kvp2p.proxy.endpoints import PREFILL_KV_TRANSFER_PARAMS as PREFILL_KV_TRANSFER_PARAMS  # re-exported
from vllm_kvp2p.proxy.health import Health
from vllm_kvp2p.proxy.health_probe import probe_skipped
from vllm_kvp2p.proxy.hold_abandon import HoldAbandoner, authenticator_from_env, reports_its_pull
from vllm_kvp2p.proxy.instances import InstancePool, Lease, PromptBlocks
from vllm_kvp2p.proxy.pairing_probe import keep_pairings
from vllm_kvp2p.proxy.placement import Placement, Placer, StreamTimes
from vllm_kvp2p.proxy.prompt_tokens import PromptReader
from vllm_kvp2p.proxy.upstream import (
    ERROR_BODY_SNIPPET,
    TRANSPORT_ERRORS,
    Answer,
    PassThrough,
    PrefillLost,
    ProxyError,
    Relay,
    Upstream,
    check_status,
    forwarded_headers,
    upstream_failure,
    went_away,
)
from vllm_kvp2p.proxy.validation import Limits, lax_bool

logger = logging.getLogger("vllm_kvp2p.proxy")

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_HEALTH_PROBE_TIMEOUT_S = 5.0
#: How many prompts of one batched request are in flight at once (``--max-batch-concurrency``).
DEFAULT_MAX_BATCH_CONCURRENCY = 8
#: Prefills run to P's answer after their client left, at once (their holds are then abandoned); more are aborted.
DEFAULT_MAX_ORPHAN_PREFILLS = 64
#: The prompt tokens the proxy counted as cached on P and on D: sent only with ``--cache-headers`` (an oracle over
#: other clients' prompts: guess a prefix, read how much of it is cached).
#: A request's own latency objectives for ``--disaggregate auto`` (``ttft=300ms,tpot=15ms``, as ``--slo``).
SLO_HEADER = "X-KVP2P-SLO"
CACHE_HEADERS = ("X-KVP2P-Prefill-Cached-Tokens", "X-KVP2P-Decode-Cached-Tokens")


class PDProxy(DecodeStep):
    """State shared by all requests: the instance pools, the HTTP client and the limits.

    ``prefill=None`` is the proxy of ordinary instances (``--instances``): no P step, each request goes whole to
    the instance ``decode``'s routing chooses (what P/D is measured against, benchmarks/bench_goodput.py)."""

    def __init__(
        self,
        prefill: InstancePool | None,
        decode: InstancePool,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        health_probe_timeout_s: float,
        max_connections: int | None,
        prompts: PromptReader | None = None,
        limits: Limits | None = None,
        max_batch_concurrency: int = DEFAULT_MAX_BATCH_CONCURRENCY,
        cache_headers: bool = False,
        max_orphan_prefills: int = DEFAULT_MAX_ORPHAN_PREFILLS,
        placer: Placer | None = None,
    ) -> None:
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if max_batch_concurrency < 1:
            raise ValueError(f"max_batch_concurrency={max_batch_concurrency}: must be >= 1")
        self.prefill = prefill
        self.decode = decode
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.health_probe_timeout_s = health_probe_timeout_s
        self.max_connections = max_connections
        #: Set when prefix-aware routing has KV events to route by: prompts are then tokenized and hashed.
        self.prompts = prompts
        #: Bounds on a request's n and batch (validation.py), and how many prompts of one batch run at once.
        self.limits = limits or Limits()
        self.max_batch_concurrency = max_batch_concurrency
        #: Whether answers carry :data:`CACHE_HEADERS` (``--cache-headers``): off, a client cannot learn from them
        #: which prefixes other clients' prompts share. The log line has the counts either way.
        self.cache_headers = cache_headers
        #: Prefill requests retried because their first P went away before answering (see the module doc).
        self.prefill_retries = 0
        self._client: Upstream | None = None
        self._tasks: list[asyncio.Task[None]] = []
        #: P's holds the proxy will deliver to no D are abandoned through it (set while the app runs, with a P step).
        self._abandoner: HoldAbandoner | None = None
        #: Prefills whose client left, run to their answer so that their holds can be abandoned (at most
        #: ``max_orphan_prefills``; past it they are aborted, counted in ``orphans_aborted``).
        self._orphans: set[asyncio.Future[Any]] = set()
        self.max_orphan_prefills = max_orphan_prefills
        self.orphans_aborted = 0
        #: Where each request runs (--disaggregate; placement.py): by default P/D for every request when there is
        #: a P step, whole requests otherwise (``prefill`` is ``decode`` for --kv-both instances).
        self.placer = placer or Placer(prefill, decode, Mode.NEVER if prefill is None else Mode.ALWAYS)

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the one pooled client (per event loop, hence here and not in ``__init__``)."""
        self._client = Upstream(
            read_timeout_s=self.timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            max_connections=self.max_connections,
        )

        if self.prefill is not None:
            self._abandoner = HoldAbandoner(auth=authenticator_from_env())
            logger.info("P's holds the proxy does not deliver are abandoned over P's side channel, %s", "sealed with "
                        "the shared secret" if self._abandoner.sealed else "unsealed (no VLLM_KVP2P_SECRET here: a P "
                        "with a secret takes them, but a P of several ranks then cannot be reached; docs/security.md)")
        self._tasks.append(asyncio.create_task(
            probe_skipped(self.pools, self.client, self.health_probe_timeout_s), name="kvp2p-proxy-probe"))
        if self.prefill is not None:  # which P and D can exchange KV (pairing.py): the placement never pairs others
            self._tasks.append(asyncio.create_task(
                keep_pairings(self.pools, self.client, self.health_probe_timeout_s), name="kvp2p-proxy-pairing"))
        if self.prompts is not None:
            from vllm_kvp2p.proxy.kv_event_feed import start_feeds  # zmq only when events are configured

            self._tasks.extend(start_feeds(self.pools, self.prompts.hasher))

    async def stop(self) -> None:
        """Stop the background tasks, close pooled connections on shutdown."""
        for task in [*self._tasks, *self._orphans]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._orphans, return_exceptions=True)
        self._tasks.clear()
        if self._abandoner is not None:  # what is queued still goes out (bounded); P's hold_timeout bounds the rest
            await asyncio.to_thread(self._abandoner.close)
            self._abandoner = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    def abandons(self) -> dict[str, int]:
        """Abandons sent to P by outcome (:mod:`hold_abandon`), and how many wait to be sent (``queued``)."""
        if self._abandoner is None:
            return {}
        return {**self._abandoner.counts(), "queued": self._abandoner.pending,
                "prefills_run_for_left_clients": len(self._orphans), "prefills_aborted": self.orphans_aborted}

    @property
    def pools(self) -> tuple[InstancePool, ...]:
        """P's pool (when there is a P step) and D's: one pool when they are the same (--kv-both)."""
        return (self.decode,) if self.prefill is None or self.prefill is self.decode else (self.prefill, self.decode)

    @property
    def _p_pool(self) -> InstancePool:
        """P's pool, in the P step (never reached by the proxy of ordinary instances)."""
        if self.prefill is None:
            raise RuntimeError("a P step in the proxy of ordinary instances")
        return self.prefill

    @property
    def client(self) -> Upstream:
        """The shared client; only valid while the app is running (inside its lifespan)."""
        if self._client is None:
            raise RuntimeError("proxy client used outside the app lifespan")
        return self._client

    # -- request flow ----------------------------------------------------------------------------------------

    @staticmethod
    def prefill_body(body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
        """The copy of a completion (or ``chat``) request sent to P: one sequence of one token, no streaming,
        ``do_remote_decode`` (:data:`~vllm_kvp2p.proxy.endpoints.ENDPOINTS` has every route's rules)."""
        return ENDPOINTS["/v1/chat/completions" if chat else "/v1/completions"].prefill_body(body)

    async def _prefill(
        self, url: str, path: str, body: dict[str, Any], headers: dict[str, str], deadline: float, rid: str
    ) -> dict[str, Any]:
        """Run the prefill on ``url``; return the ``kv_transfer_params`` that D needs.

        Raises :class:`PrefillLost` if P went away before answering, any other :class:`ProxyError` otherwise.
        """
        try:
            resp = await self.client.request("POST", url + path, self._remaining(deadline), body=body, headers=headers)
        except TRANSPORT_ERRORS as exc:
            err = upstream_failure("prefill", url, exc, self.timeout_s)
            raise (PrefillLost(err, exc) if went_away(exc) else err) from exc
        check_status("prefill", url, resp, {"X-Request-Id": rid})
        try:
            data = resp.json()
        except ValueError as exc:
            raise ProxyError(
                502,
                f"prefill instance {url} returned invalid JSON: {resp.text[:ERROR_BODY_SNIPPET]}",
                "upstream_error",
            ) from exc
        kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not isinstance(kv, dict) or not kv:
            raise ProxyError(
                502,
                f"prefill instance {url} returned no kv_transfer_params: is it running with "
                "--kv-transfer-config using the kvp2p connector and kv_role kv_producer (or kv_both)?",
                "kv_transfer_error",
            )
        return kv

    async def _attempt(
        self, lease: Lease, path: str, body: dict[str, Any], headers: dict[str, str], deadline: float, rid: str
    ) -> dict[str, Any]:
        """One prefill on the leased P, its outcome told to the pool (health), the lease released."""
        try:
            kv = await self._prefill(lease.url, path, body, headers, deadline, rid)
        except ProxyError as exc:
            self._outcome(self._p_pool, lease.url, exc)
            raise
        except PassThrough:
            self._p_pool.answered(lease.url)
            raise
        except BaseException:
            self._p_pool.abandoned(lease.url)
            raise
        else:
            self._p_pool.answered(lease.url)
            return kv
        finally:
            self._p_pool.release(lease)

    async def _prefill_with_retry(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        deadline: float,
        rid: str,
        prompt: PromptBlocks | None,
        placement: Placement,
    ) -> tuple[Lease, dict[str, Any]]:
        """Prefill on the P ``placement`` chose, once more on another P if that one went away before answering.

        Returns the lease of the P that answered (already released) and its ``kv_transfer_params``. Both attempts
        share ``deadline``.
        """
        first = placement.prefill
        assert first is not None
        try:
            kv = await self._attempt(first, path, body, headers, deadline, rid)
        except PrefillLost as exc:
            lost = exc
        else:
            self.placer.prefill_answered(placement)
            return first, kv
        retry = self.placer.retry_prefill(placement, prompt)
        self.prefill_retries += 1
        logger.warning(
            "request %s: prefill instance %s went away before answering (%s); retrying once on %s",
            rid,
            first.url,
            lost.cause,
            retry.url,
        )
        try:
            kv = await self._attempt(retry, path, body, headers, deadline, rid)
        except ProxyError as exc:
            raise ProxyError(
                exc.status, f"{exc.message} (after a retry; first: {lost.message})", exc.err_type
            ) from exc
        self.placer.prefill_answered(placement)
        return retry, kv

    async def handle(self, raw: bytes, client_headers: Mapping[str, str], path: str) -> Answer | Relay:
        """Full P then D flow for one request to ``path``, one of :data:`~vllm_kvp2p.proxy.endpoints.ENDPOINTS`
        (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``): ``raw`` is its body, ``client_headers``
        its headers (lower-case names). A batch of prompts runs as one flow per prompt (:mod:`batch_flow`).
        Cancelling it (the client went away) drops every upstream connection it has open."""
        rid = client_headers.get("x-request-id") or str(uuid.uuid4())
        try:
            body = self._parse(raw, path)
            headers = {"X-Request-Id": rid, **forwarded_headers(client_headers)}
            run_one = functools.partial(self.run_one, objectives=self._objectives(client_headers))
            prompts = batch_prompts(body) if ENDPOINTS[path].batched else None
            if prompts is not None:
                return await run_batch(run_one, self.limits, self.max_batch_concurrency, body, prompts, headers,
                                       path, rid)
            return await run_one(body, headers, path, rid)
        except ProxyError as exc:
            logger.warning("request %s: %s", rid, exc.message)
            return exc.to_answer(rid)
        except PassThrough as exc:
            logger.info("request %s: upstream answered %d, passed through", rid, exc.answer.status)
            return exc.answer

    def _objectives(self, client_headers: Mapping[str, str]) -> Objectives | None:
        """A request's own objectives (``X-KVP2P-SLO``, as ``--slo``), for ``--disaggregate auto``; else None."""
        text = client_headers.get(SLO_HEADER.lower())
        if text is None:
            return None
        try:
            return Objectives.parse(text[:200], setting=SLO_HEADER)
        except ObjectivesError as exc:
            raise ProxyError(400, str(exc), "invalid_request_error") from None

    def _parse(self, raw: bytes, path: str) -> dict[str, Any]:
        """``raw`` as ``path``'s request: parsed within the proxy's bounds and checked, before any P is asked
        (:meth:`Endpoint.parse <vllm_kvp2p.proxy.endpoints.Endpoint.parse>`)."""
        return ENDPOINTS[path].parse(raw, self.limits)

    async def run_one(self, body: dict[str, Any], headers: dict[str, str], path: str, rid: str,
                      objectives: Objectives | None = None) -> Answer | Relay:
        """P then D for one prompt, or D alone (placement.py); raises :class:`ProxyError` / :class:`PassThrough`
        for the client's answer."""
        received = time.monotonic()
        deadline = time.monotonic() + self.timeout_s
        stream = bool(lax_bool(body.get("stream", False)))

        prompt = await self._prompt_blocks(path, body, headers, deadline, rid)
        t0 = time.monotonic()
        route_ms = (t0 - received) * 1000.0  # the prompt's tokens and hashes (routing happens below)
        placement = self.placer.place(prompt, objectives)
        relayed = False  # a relay ends the placement when it closes; otherwise this does, however it ends
        try:
            answer = await self._run_placed(placement, body, headers, path, rid, stream, deadline, prompt, route_ms,
                                            t0)
            relayed = isinstance(answer, Relay)
            return answer
        finally:
            if not relayed:
                self.placer.done(placement)

    async def _run_placed(
        self, placement: Placement, body: dict[str, Any], headers: dict[str, str], path: str, rid: str,
        stream: bool, deadline: float, prompt: PromptBlocks | None, route_ms: float, t0: float,
    ) -> Answer | Relay:
        info_headers = {"X-Request-Id": rid, "X-KVP2P-Route-Ms": f"{route_ms:.1f}",
                        "X-KVP2P-Path": f"{placement.path}; reason={placement.reason}"}
        d_body = dict(body)
        kv: dict[str, Any] | None = None
        if placement.prefill is not None:
            p_body = ENDPOINTS[path].prefill_body(body)
            try:
                p_lease, kv = await self._prefill_to_the_end(path, p_body, headers, deadline, rid, prompt, placement)
            except BaseException:
                if placement.decode is not None:
                    self.decode.release(placement.decode)
                raise
            prefill_ms = (time.monotonic() - t0) * 1000.0
            d_body["kv_transfer_params"] = kv
            info_headers.update({"X-KVP2P-Prefill-Instance": p_lease.url, "X-KVP2P-Prefill-Ms": f"{prefill_ms:.1f}"})
        # From here P holds the prompt's KV: unless D's whole answer reports its pull (D's connector claimed or
        # released the hold), P is told to abandon it; a relay does so when it closes, however it ends (a stream
        # carries no report). An abandon frees only a hold no reader touched: vllm_kvp2p/proxy/hold_abandon.py.
        handed_over = False
        try:
            d_lease = self.placer.lease_decode(placement, prompt)
            info_headers["X-KVP2P-Decode-Instance"] = d_lease.url
            if kv is None:
                logger.info("request %s %s: instance %s (%d tokens cached; %s); prompt read in %.1f ms",
                            rid, path, d_lease.url, d_lease.cached_tokens, placement.reason, route_ms)
            else:
                if self.cache_headers:
                    info_headers.update(zip(CACHE_HEADERS, (str(p_lease.cached_tokens), str(d_lease.cached_tokens)),
                                            strict=True))
                logger.info(
                    "request %s %s: prefill %s (%.1f ms, %d tokens cached) -> decode %s (%d cached; %s); prompt read "
                    "in %.1f ms", rid, path, p_lease.url, prefill_ms, p_lease.cached_tokens, d_lease.url,
                    d_lease.cached_tokens, placement.reason, route_ms,
                )
            if not stream:
                try:
                    answer: Answer | Relay = await self._decode_json(d_lease.url, path, d_body, headers, deadline,
                                                                     info_headers)
                finally:
                    self.decode.release(d_lease)
                if kv is not None and not reports_its_pull(answer.body):  # e.g. D's verdict refused the params
                    self._abandon(kv)
            else:
                times = StreamTimes(asked_ms=time.monotonic() * 1000.0)

                def closed() -> None:
                    self._abandon(kv)
                    self.placer.stream_ended(placement, times)
                    self.placer.done(placement)

                try:
                    answer = await self._decode_stream(d_lease, path, d_body, headers, deadline, info_headers, rid,
                                                       on_close=closed, times=(placement, times))
                except BaseException:
                    self.decode.release(d_lease)
                    raise
            handed_over = True
            return answer
        finally:
            if not handed_over:
                self._abandon(kv)

    async def _prefill_to_the_end(
        self, path: str, body: dict[str, Any], headers: dict[str, str], deadline: float, rid: str,
        prompt: PromptBlocks | None, placement: Placement,
    ) -> tuple[Lease, dict[str, Any]]:
        """:meth:`_prefill_with_retry`, run to P's answer even if the client leaves meanwhile: then the hold P made
        is abandoned as soon as its params arrive. Aborting P's request instead would race P's answer (a prefill
        that finished just before the abort holds its KV for hold_timeout with nobody knowing its params); the price
        is the rest of one prefill per leaving client, which a client that stayed would have cost as well."""
        task = asyncio.ensure_future(self._prefill_with_retry(path, body, headers, deadline, rid, prompt,
                                                              placement))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                self._abandon_result(task)
            elif len(self._orphans) >= self.max_orphan_prefills:
                # Bounded: a client may not make P run prefills for nobody without end by leaving at once. Past the
                # bound P's request is aborted, as before abandons existed (the race with P's answer is then
                # hold_timeout's to end).
                task.cancel()
                self.orphans_aborted += 1
            else:
                self._orphans.add(task)
                task.add_done_callback(self._abandon_result)
            raise

    def _abandon_result(self, task: asyncio.Future[tuple[Lease, dict[str, Any]]]) -> None:
        """A prefill whose client left: abandon the hold its answer names (none if it failed)."""
        self._orphans.discard(task)
        if task.cancelled() or task.exception() is not None:
            return
        self._abandon(task.result()[1])

    def _abandon(self, kv: dict[str, Any] | None) -> None:
        """Tell P that nobody will pull the hold ``kv`` names (vllm_kvp2p/proxy/hold_abandon.py)."""
        if kv is not None and self._abandoner is not None:
            self._abandoner.abandon(kv)

    async def _prompt_blocks(
        self, path: str, body: dict[str, Any], headers: dict[str, str], deadline: float, rid: str
    ) -> PromptBlocks | None:
        """The prompt's blocks for routing by cached prefix (``None``: route by load; see :mod:`prompt_tokens`)."""
        if self.prompts is None:
            return None
        return await self.prompts.blocks(self.client, self._tokenize_url, path, body, headers,
                                         self._remaining(deadline), rid)

    def _tokenize_url(self) -> str:
        """The P to ask for a prompt's tokens: the least busy that is up (a skipped one would only cost the
        timeout)."""
        return min(self.pools[0].instances, key=lambda i: (i.health.state is not Health.UP, i.outstanding)).url
