"""D side (and the proxy's abandons): the rank tables of the P engines it pulls from, fetched from each engine's
entry point and cached.

The adapter around :mod:`vllm_kvp2p.lifecycle.rank_table` (which decides whether a table may be used): before a
pull from a P of more than one rank, :meth:`RankTables.resolve` gives the plan the endpoint of every P rank
(:attr:`PullPlan.p_endpoints`), from a cached table of the same engine and incarnation or from one fetched now
(one round trip per P incarnation). Bounded like every table keyed by what params name (``MAX_PEERS``), and by
the ranks its tables list together (``MAX_CACHED_RANKS``): without a secret, params name any entry point inside
peer_ports, and each may answer a valid table of 1024 ranks.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass

from vllm_kvp2p.contract.protocol import GetRankTable, PortRanges, RankTable, RemotePrefill
from vllm_kvp2p.contract.side_channel import SideChannelClient, SideChannelError, Unauthenticated
from vllm_kvp2p.decode.pull_lanes import MAX_PEERS
from vllm_kvp2p.lifecycle.consumer import Failure, PullPlan
from vllm_kvp2p.lifecycle.rank_table import Endpoint, endpoints_of, entry_only, table_problem

#: Ranks of every cached table together. 1024 tables of 1024 ranks with hosts of 253 characters held ~0.4 GiB
#: (0.41 MiB each, benchmarks/bench_peer_messages.py); this is 64 such tables (~26 MiB), and 1024 of 64 ranks.
MAX_CACHED_RANKS = 1 << 16


@dataclass(frozen=True)
class Unavailable:
    """Why a P's rank endpoints cannot be had, and what kind of failure that makes of a pull."""

    reason: str
    failure: Failure


class RankTables:
    """Accepted rank tables by entry point (host, port): keyed by where D asked, not by what a table claims."""

    def __init__(self, peer_ports: PortRanges, max_entries: int = MAX_PEERS,
                 max_ranks: int = MAX_CACHED_RANKS) -> None:
        self.peer_ports = peer_ports
        self.max_entries = max_entries
        self.max_ranks = max_ranks
        self._tables: OrderedDict[tuple[str, int], RankTable] = OrderedDict()
        self._ranks = 0  # of every cached table together
        self._lock = threading.Lock()  # pull threads share the cache

    def __len__(self) -> int:
        return len(self._tables)

    @property
    def cached_ranks(self) -> int:
        return self._ranks

    def resolve(self, plan: PullPlan, client: SideChannelClient, timeout: float) -> PullPlan:
        """The plan with its P ranks' endpoints, or failed (with no further contact) when P's table cannot be
        had or must not be used."""
        endpoints = self.endpoints(plan.remote, client, timeout)
        if isinstance(endpoints, Unavailable):
            return _failed(plan, endpoints.reason, endpoints.failure)
        return dataclasses.replace(plan, p_endpoints=endpoints)

    def has(self, remote: RemotePrefill) -> bool:
        """Whether the endpoints of ``remote``'s P are known without asking (one rank, or its table cached)."""
        with self._lock:
            return entry_only(remote) is not None or (remote.remote_host, remote.remote_port) in self._tables

    def endpoints(self, remote: RemotePrefill, client: SideChannelClient, timeout: float
                  ) -> tuple[Endpoint, ...] | Unavailable:
        """Where each rank of ``remote``'s P listens, from a cached table of the same engine and incarnation or
        from one its entry point gives now; or why that cannot be had."""
        single = entry_only(remote)
        if single is not None:
            return single
        entry = (remote.remote_host, remote.remote_port)
        with self._lock:
            table = self._tables.get(entry)
        if table is None or table_problem(table, remote, self.peer_ports):
            self.forget(entry)
            try:
                reply = client.request(*entry, GetRankTable(), timeout=timeout)
            except Unauthenticated as exc:
                return Unavailable(f"P's entry point {entry[0]}:{entry[1]} did not authenticate its rank table: "
                                   f"{exc}", Failure.UNAUTHENTICATED)
            except SideChannelError as exc:
                return Unavailable(f"P's entry point {entry[0]}:{entry[1]} did not give its rank table: {exc}",
                                   Failure.UNREACHABLE)
            if not isinstance(reply, RankTable):
                return Unavailable(f"P's entry point {entry[0]}:{entry[1]} answered {type(reply).__name__[:40]} "
                                   f"{str(getattr(reply, 'message', ''))[:120]!r} for its rank table (a P of "
                                   "another release?)", Failure.INCOMPATIBLE)
            table = reply
            problem = table_problem(table, remote, self.peer_ports)
            if problem:
                return Unavailable(problem, Failure.INCOMPATIBLE)
            with self._lock:
                self._pop(entry)
                self._tables[entry] = table
                self._ranks += len(table.ranks)
                while len(self._tables) > self.max_entries or self._ranks > self.max_ranks:
                    self._pop(next(iter(self._tables)))  # the least recently fetched
        return endpoints_of(table)

    def forget(self, entry: tuple[str, int]) -> None:
        """A failed pull drops the table it used: the next pull from that P asks afresh."""
        with self._lock:
            self._pop(entry)

    def _pop(self, entry: tuple[str, int]) -> None:
        table = self._tables.pop(entry, None)
        if table is not None:
            self._ranks -= len(table.ranks)


def _failed(plan: PullPlan, error: str, failure: Failure) -> PullPlan:
    return dataclasses.replace(plan, error=error, failure=failure, contact_p=False)
