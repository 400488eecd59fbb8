"""The proxy's abandons: P's holds whose params the proxy will deliver to no decoder, freed in seconds instead of
at P's ``hold_timeout``.

A P/D flow ends in one of two ways once P has answered with ``kv_transfer_params``: D's engine got the request
(its connector then claims or releases P's hold itself, whatever happens to the request afterwards), or it did
not (D's API server refused the body, D could not be reached, the client left before D's engine saw it, a part of a
batch was cancelled). The proxy cannot tell the two apart from outside D, and need not: it sends P an
:class:`~vllm_kvp2p.protocol.Abandon` for every flow that did not end with D's whole successful answer, and P frees
the hold only if no reader has touched it (lifecycle/producer.py decides). So the abandon is harmless where D's
engine has the request and frees the hold where it never will.

The abandon is authorised by the params (their hold id and mac), so the proxy needs no secret: with one, P takes
an unsealed Abandon and nothing else unsealed (side_channel.py). A P of several ranks keeps a hold on each: the
proxy asks its entry point for the rank table once per P incarnation (as D does, lifecycle/rank_table.py) and
abandons on every rank.

The side channel's client is blocking, so the abandons go out from one thread of their own, in order, each bounded
by ``timeout_s``; at most ``max_queued`` wait (more are dropped and counted: their holds then end at
``hold_timeout``, as they would without the proxy). Every outcome is counted (:meth:`HoldAbandoner.counts`, the
proxy's ``/health``). A proxy restarted mid-flight forgets what it had not sent: ``hold_timeout`` bounds those.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

from vllm_kvp2p.lifecycle.rank_table import Endpoint, endpoints_of, entry_only, table_problem
from vllm_kvp2p.protocol import ANY_PORT, Abandon, Abandoned, GetRankTable, RankTable, RemotePrefill
from vllm_kvp2p.side_channel import SideChannelClient, SideChannelError

logger = logging.getLogger("vllm_kvp2p.proxy")

#: Seconds one abandon may take per P rank (all attempts): a dead P refuses at once, a frozen one costs this.
DEFAULT_ABANDON_TIMEOUT_S = 2.0
#: Abandons waiting to be sent: a burst of leaving clients, or a frozen P that makes each one wait its timeout.
MAX_QUEUED = 4096
#: Rank tables kept (per P entry point); a table is asked again when the params name another incarnation.
MAX_TABLES = 256
#: Seconds between two warnings of one kind (a flood must not flood the log).
WARNING_INTERVAL_S = 60.0

#: The outcomes counted: P's answers (protocol.AbandonOutcome) and the proxy's own.
OUTCOMES = ("released", "remembered", "in_use", "ended", "refused", "failed", "dropped", "invalid")


class HoldAbandoner:
    """Sends P an abandon for each hold the proxy will not deliver (:meth:`abandon`, from the event loop)."""

    def __init__(self, timeout_s: float = DEFAULT_ABANDON_TIMEOUT_S, max_queued: int = MAX_QUEUED) -> None:
        if timeout_s <= 0:
            raise ValueError(f"abandon timeout {timeout_s}: must be positive")
        self.timeout_s = timeout_s
        self._queue: queue.Queue[RemotePrefill | None] = queue.Queue(maxsize=max_queued)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter(dict.fromkeys(OUTCOMES, 0))
        self._warned: dict[str, float] = {}
        self._tables: OrderedDict[Endpoint, RankTable] = OrderedDict()  # only the sender thread touches it
        self._thread = threading.Thread(target=self._run, name="kvp2p-proxy-abandon", daemon=True)
        self._thread.start()

    def abandon(self, params: Mapping[str, Any] | None) -> None:
        """Queue an abandon of the hold ``params`` name (P's ``kv_transfer_params``); returns at once."""
        remote = RemotePrefill.from_params(params) if params is not None else None
        if remote is None:  # not this connector's params (the proxy checked P's answer only for a dict)
            self._count("invalid")
            return
        try:
            self._queue.put_nowait(remote)
        except queue.Full:
            self._count("dropped")
            self._warn("dropped", f"{self._queue.maxsize} abandons already waiting (a frozen P?): the hold of "
                       f"{remote.remote_request_id} on {remote.remote_host}:{remote.remote_port} ends at P's "
                       "hold_timeout")

    def counts(self) -> dict[str, int]:
        """Abandons by outcome since start: per P rank for P's answers, per hold for the proxy's own."""
        with self._lock:
            return dict(self._counts)

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued abandon was sent (or ``timeout_s`` passed); for shutdown and tests."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
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
        client = SideChannelClient(self.timeout_s, attempts=2)
        try:
            while (remote := self._queue.get()) is not None:
                try:
                    self._send(client, remote)
                except Exception as exc:  # noqa: BLE001 - the thread must outlive any one abandon
                    self._count("failed")
                    self._warn("error", f"abandon of {remote.remote_request_id} failed: {type(exc).__name__}: {exc}")
                finally:
                    self._queue.task_done()
            self._queue.task_done()
        finally:
            client.close()

    def _send(self, client: SideChannelClient, remote: RemotePrefill) -> None:
        endpoints = self._endpoints(client, remote)
        if endpoints is None:
            return
        message = Abandon(remote.remote_request_id, remote.remote_hold_id, remote.mac)
        for host, port in endpoints:
            try:
                reply = client.request(host, port, message)
            except SideChannelError as exc:
                self._count("failed")
                self._warn("failed", f"abandon of {remote.remote_request_id} not delivered to P at {host}:{port}: "
                           f"{exc} (its hold ends at P's hold_timeout)")
                continue
            if isinstance(reply, Abandoned):
                self._count(reply.outcome.value)
                if reply.outcome.value == "refused":
                    self._warn("refused", f"P at {host}:{port} refused the abandon of {remote.remote_request_id}: "
                               f"{reply.reason}")
            else:  # an older P: its side channel does not know the message
                self._count("failed")
                self._warn("old", f"P at {host}:{port} answered the abandon of {remote.remote_request_id} with "
                           f"{type(reply).__name__}: {str(getattr(reply, 'message', ''))[:200]} (a P of an older "
                           "release: its holds end at hold_timeout)")

    def _endpoints(self, client: SideChannelClient, remote: RemotePrefill) -> tuple[Endpoint, ...] | None:
        """Every rank of P's engine, from its rank table for a P of more than one rank (None: not to be had)."""
        single = entry_only(remote)
        if single is not None:
            return single
        entry = (remote.remote_host, remote.remote_port)
        table = self._tables.get(entry)
        if table is None or table_problem(table, remote, ANY_PORT):
            self._tables.pop(entry, None)
            try:
                reply = client.request(*entry, GetRankTable())
            except SideChannelError as exc:
                self._count("failed")
                self._warn("failed", f"P's entry point {entry[0]}:{entry[1]} gave no rank table for the abandon of "
                           f"{remote.remote_request_id}: {exc}")
                return None
            problem = (table_problem(reply, remote, ANY_PORT) if isinstance(reply, RankTable)
                       else f"it answered {type(reply).__name__}")
            if problem:
                self._count("failed")
                self._warn("table", f"P's entry point {entry[0]}:{entry[1]}: its rank table cannot be used for the "
                           f"abandon of {remote.remote_request_id}: {problem}")
                return None
            assert isinstance(reply, RankTable)
            table = self._tables[entry] = reply
            while len(self._tables) > MAX_TABLES:
                self._tables.popitem(last=False)
        return endpoints_of(table)

    def _count(self, outcome: str) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def _warn(self, kind: str, text: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._warned.get(kind)
            if last is not None and now - last < WARNING_INTERVAL_S:
                return
            self._warned[kind] = now
        logger.warning("%s", text)
