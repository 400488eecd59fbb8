"""The proxy's abandons: P's holds whose params the proxy will deliver to no decoder, freed in seconds instead of
at P's ``hold_timeout``.

A P/D flow ends in one of two ways once P has answered with ``kv_transfer_params``: D's engine got the request
and its connector claimed or released P's hold, or not (D's API server refused the body, D could not be reached,
the client left before D's engine saw it, a part of a batch was cancelled, D's verdict refused the params without
contacting P). The proxy cannot always tell from outside D, and need not: it sends P an
:class:`~vllm_kvp2p.contract.protocol.Abandon` for every flow that did not end with D's answer reporting its pull, and P
frees the hold only if no reader has touched it (lifecycle/producer.py decides). So the abandon is harmless where
D's engine has the request and frees the hold where it never will.

Authority: the params (their hold id and mac). With ``VLLM_KVP2P_SECRET`` (or ``_FILE``) set as on the engines,
every frame is sealed; without it, a P with a secret takes the abandon unsealed (and nothing else), but does not
remember one for a hold it has not heard of yet (P learns a hold an engine step after it answered), so the sender
asks again a few times (:data:`UNKNOWN_RETRIES_S`). A P of several ranks keeps a hold on each: the sender asks its
entry point for the rank table once per P incarnation (as D does, lifecycle/rank_table.py), which needs the secret
where P has one.

One sender thread, in order, each message bounded by ``timeout_s``; a P endpoint that could not be reached is
skipped for :data:`UNREACHABLE_FOR_S` (its holds end at ``hold_timeout``), so a dead or frozen P costs one timeout
per period, not one per abandon, and does not hold up the other P's. At most ``max_queued`` abandons wait (more are
dropped and counted). Every outcome is counted (:meth:`HoldAbandoner.counts`, the proxy's ``/health``). A proxy
restarted mid-flight forgets what it had not sent: ``hold_timeout`` bounds those.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.config import secret_from_environment
from vllm_kvp2p.contract.protocol import (
    ANY_PORT,
    PULL_REPORT_KEY,
    Abandon,
    Abandoned,
    AbandonOutcome,
    RemotePrefill,
)
from vllm_kvp2p.contract.side_channel import SideChannelClient, SideChannelError, Unauthenticated
from vllm_kvp2p.decode.rank_tables import RankTables, Unavailable
from vllm_kvp2p.lifecycle.failure import Failure
from vllm_kvp2p.lifecycle.rank_table import Endpoint
from vllm_kvp2p.log import WarningPace

logger = logging.getLogger("vllm_kvp2p.proxy")

#: Seconds one message may take (all attempts): a dead P refuses at once, a frozen one costs this.
DEFAULT_ABANDON_TIMEOUT_S = 2.0
#: Abandons waiting to be sent: a burst of leaving clients.
MAX_QUEUED = 4096
#: P endpoints remembered as not answering, at most.
MAX_UNREACHABLE = 256
#: Seconds a P endpoint that did not answer is skipped (its holds end at hold_timeout, as they would anyway).
UNREACHABLE_FOR_S = 5.0
#: When to ask again, after the first, a P that has not heard of the hold and did not remember an unsealed abandon.
UNKNOWN_RETRIES_S = (0.05, 0.15, 0.4, 1.0)
#: Seconds between two warnings of one kind (a flood must not flood the log).
WARNING_INTERVAL_S = 60.0

#: The outcomes counted: P's answers (protocol.AbandonOutcome, per P rank) and the proxy's own (per hold, but
#: ``failed`` and ``skipped``, per rank).
OUTCOMES = (*(o.value for o in AbandonOutcome), "failed", "skipped", "dropped", "invalid")


#: How D's whole answer starts its pull report (vLLM renders JSON compact; the connector's report puts ``ok`` first):
#: found, D's connector claimed or released the hold. Not found (another layout, a follower of n > 1, a failed
#: pull), the proxy abandons the hold, which frees it only if no reader touched it.
_PULL_OK = b'"' + PULL_REPORT_KEY.encode() + b'":{"ok":true'


def reports_its_pull(body: bytes) -> bool:
    """Whether D's answer says its pull went well (a search of the bytes: the answer is not parsed on the loop)."""
    return _PULL_OK in body


def authenticator_from_env(env: Mapping[str, str] = os.environ) -> Authenticator | None:
    """The engines' shared secret, when the proxy's environment has it (else None: unsealed abandons)."""
    secret, clock_skew = secret_from_environment(env)
    return Authenticator(secret, clock_skew) if secret else None


@dataclass(frozen=True)
class _Job:
    remote: RemotePrefill
    endpoint: Endpoint | None = None  # None: every rank, once P's endpoints are known
    attempt: int = 0  # how many times P answered "unknown" already


class HoldAbandoner:
    """Sends P an abandon for each hold the proxy will not deliver (:meth:`abandon`, from the event loop)."""

    def __init__(self, timeout_s: float = DEFAULT_ABANDON_TIMEOUT_S, max_queued: int = MAX_QUEUED, *,
                 auth: Authenticator | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"abandon timeout {timeout_s}: must be positive")
        self.timeout_s = timeout_s
        self.sealed = auth is not None
        self._auth = auth
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_queued)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter(dict.fromkeys(OUTCOMES, 0))
        self._pace = WarningPace(WARNING_INTERVAL_S)  # a WARNING a minute per kind
        # Only the sender thread touches these: retries due later, endpoints skipped until.
        self._later: list[tuple[float, int, _Job]] = []
        self._order = itertools.count()
        self._unreachable: OrderedDict[Endpoint, float] = OrderedDict()
        self._tables = RankTables(ANY_PORT)  # P's rank tables, as D keeps them (params come from P itself here)
        self._thread = threading.Thread(target=self._run, name="kvp2p-proxy-abandon", daemon=True)
        self._thread.start()

    def abandon(self, params: Mapping[str, Any] | None) -> None:
        """Queue an abandon of the hold ``params`` name (P's ``kv_transfer_params``); returns at once."""
        remote = RemotePrefill.from_params(params) if params is not None else None
        if remote is None:  # not this connector's params (the proxy checked P's answer only for a dict)
            self._count("invalid")
            return
        try:
            self._queue.put_nowait(_Job(remote))
        except queue.Full:
            self._count("dropped")
            self._warn("dropped", f"{self._queue.maxsize} abandons already waiting: the hold of "
                       f"{remote.remote_request_id} on {remote.remote_host}:{remote.remote_port} ends at P's "
                       "hold_timeout")

    def counts(self) -> dict[str, int]:
        """Abandons by outcome since start (P's answers per P rank; dropped and invalid per hold)."""
        with self._lock:
            return dict(self._counts)

    @property
    def pending(self) -> int:
        """Abandons queued or waiting to be asked again."""
        return self._queue.unfinished_tasks

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued abandon was sent, retries included (or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._queue.unfinished_tasks == 0

    def close(self, drain_s: float = 2.0) -> None:
        """Send what is queued (up to ``drain_s``), then stop the thread."""
        self.drain(drain_s)
        try:
            self._queue.put(None, timeout=0.1)
        except queue.Full:
            pass  # the thread is a daemon: it ends with the process
        self._thread.join(timeout=self.timeout_s + 1.0)

    # ------------------------------------------------------------------ the sender thread

    def _run(self) -> None:
        client = SideChannelClient(self.timeout_s, attempts=2, auth=self._auth)
        try:
            while True:
                wait = max(0.0, self._later[0][0] - time.monotonic()) if self._later else None
                try:
                    job = self._queue.get(timeout=wait)
                except queue.Empty:  # a retry is due
                    job = heapq.heappop(self._later)[2]
                if job is None:
                    self._queue.task_done()
                    return
                try:
                    self._send(client, job)
                except Exception as exc:  # noqa: BLE001 - the thread must outlive any one abandon
                    self._count("failed")
                    self._warn("error", f"abandon of {job.remote.remote_request_id} failed: {type(exc).__name__}: "
                               f"{exc}")
                finally:
                    self._queue.task_done()  # a retry was put back counted (_again)
        finally:
            client.close()

    def _again(self, job: _Job, delay_s: float) -> None:
        """Ask again later; the job stays pending (drain waits for it)."""
        with self._queue.all_tasks_done:
            self._queue.unfinished_tasks += 1
        heapq.heappush(self._later, (time.monotonic() + delay_s, next(self._order), job))

    def _send(self, client: SideChannelClient, job: _Job) -> None:
        remote = job.remote
        if job.endpoint is None:
            endpoints = self._endpoints(client, remote)
            if endpoints is None:
                return
            for endpoint in endpoints[1:]:  # each rank's own job: asked again on its own
                self._again(_Job(remote, endpoint), 0.0)
            job = _Job(remote, endpoints[0])
        assert job.endpoint is not None
        host, port = job.endpoint
        if self._skipped(job.endpoint, remote):
            return
        try:
            reply = client.request(host, port, Abandon(remote.remote_request_id, remote.remote_hold_id, remote.mac))
        except SideChannelError as exc:
            self._count("failed")
            if not isinstance(exc, Unauthenticated):  # an answer: P is up
                self._mark_unreachable(job.endpoint)
            self._warn("failed", f"abandon of {remote.remote_request_id} not delivered to P at {host}:{port}: {exc} "
                       "(its hold ends at P's hold_timeout)")
            return
        if not isinstance(reply, Abandoned):  # an older P: its side channel does not know the message
            self._count("failed")
            self._warn("old", f"P at {host}:{port} answered the abandon of {remote.remote_request_id} with "
                       f"{type(reply).__name__} (a P of an older release: its holds end at hold_timeout)")
            return
        if reply.outcome is AbandonOutcome.UNKNOWN and job.attempt < len(UNKNOWN_RETRIES_S):
            self._again(_Job(remote, job.endpoint, job.attempt + 1), UNKNOWN_RETRIES_S[job.attempt])
            return
        self._count(reply.outcome.value)
        if reply.outcome is AbandonOutcome.REFUSED:
            self._warn("refused", f"P at {host}:{port} refused the abandon of {remote.remote_request_id}: "
                       f"{reply.reason}")

    def _mark_unreachable(self, endpoint: Endpoint) -> None:
        """Skip ``endpoint`` for UNREACHABLE_FOR_S (kept in expiry order, at most MAX_UNREACHABLE endpoints)."""
        self._unreachable.pop(endpoint, None)
        self._unreachable[endpoint] = time.monotonic() + UNREACHABLE_FOR_S
        while len(self._unreachable) > MAX_UNREACHABLE:
            self._unreachable.popitem(last=False)

    def _skipped(self, endpoint: Endpoint, remote: RemotePrefill) -> bool:
        """Whether ``endpoint`` did not answer lately (then counted, not asked)."""
        now = time.monotonic()
        while self._unreachable and next(iter(self._unreachable.values())) <= now:
            self._unreachable.popitem(last=False)
        if self._unreachable.get(endpoint, 0.0) > now:
            self._count("skipped")
            return True
        return False

    def _endpoints(self, client: SideChannelClient, remote: RemotePrefill) -> tuple[Endpoint, ...] | None:
        """Every rank of P's engine, from its rank table for a P of more than one rank (None: not to be had)."""
        entry = (remote.remote_host, remote.remote_port)
        if not self._tables.has(remote) and self._skipped(entry, remote):
            return None
        endpoints = self._tables.endpoints(remote, client, self.timeout_s)
        if not isinstance(endpoints, Unavailable):
            return endpoints
        self._count("failed")
        if endpoints.failure is Failure.UNREACHABLE:
            self._mark_unreachable(entry)
        hint = (" (P has a shared secret: give the proxy VLLM_KVP2P_SECRET or VLLM_KVP2P_SECRET_FILE too, as its "
                "engines have)" if endpoints.failure is Failure.UNAUTHENTICATED and not self.sealed else "")
        self._warn("table", f"no rank table for the abandon of {remote.remote_request_id}: {endpoints.reason}{hint}")
        return None

    def _count(self, outcome: str) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def _warn(self, kind: str, text: str) -> None:
        with self._lock:
            if self._pace.allow(kind, time.monotonic()) is None:
                return
        logger.warning("%s", text)
