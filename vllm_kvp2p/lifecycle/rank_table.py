"""Where each rank of a P engine listens, and whether D may use what P says about it (pure: no sockets).

An engine can span nodes (tensor parallel across nodes, a Ray or multi-node executor): its ranks listen on their
own nodes' addresses. A rank of an engine is numbered ``stage * tp_size + tp rank`` over its pipeline stages. The
params name one entry point, ``remote_host:remote_port`` (P's rank 0, on the node of P's engine core); for an
engine of more than one rank, D asks that entry point for the engine's :class:`RankTable` (gathered by P's
ranks over vLLM's process groups at registration) and then contacts rank r where the table says. The table comes
over the side channel, authenticated when a secret is set, so a client's params can name only the entry point:
every other host D contacts is one P named.

:func:`table_problem` is the one check of a table against the params and D's settings; :func:`endpoints_of`
turns an accepted table into the per-rank endpoints a pull uses (:attr:`PullPlan.p_endpoints`), and the segment of
each rank's registration must be on that rank's host (vllm_kvp2p/lifecycle/compatibility.py).
"""

from __future__ import annotations

import ipaddress

from vllm_kvp2p.contract.protocol import PortRanges, RankEndpoint, RankTable, RemotePrefill

Endpoint = tuple[str, int]
#: How much of a peer's text a problem quotes (it goes to logs and to vLLM).
QUOTE = 80
#: An IPv6 zone ("fe80::1%eth0") names an interface: at most IFNAMSIZ - 1 characters on Linux. Python accepts any.
MAX_ZONE_LENGTH = 15


def _quote(text: str) -> str:
    return repr(text[:QUOTE] + ("..." if len(text) > QUOTE else ""))


def host_problem(host: str) -> str:
    """Why ``host`` is not an address D may contact ("" if it is): an IP literal, not unspecified or multicast
    (names are never resolved on the request path)."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return f"{_quote(host)} is not an IP address"
    zone = getattr(address, "scope_id", None) or ""
    if len(zone) > MAX_ZONE_LENGTH:
        return f"{_quote(host)}: its zone is not an interface name (more than {MAX_ZONE_LENGTH} characters)"
    if address.is_unspecified or address.is_multicast:
        return f"{host} is not an address of one host"
    return ""


def _same_address(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a.strip("[]")) == ipaddress.ip_address(b.strip("[]"))
    except ValueError:
        return False


def table_problem(table: RankTable, remote: RemotePrefill, peer_ports: PortRanges) -> str:
    """Why D must not use ``table`` for a pull with these params ("" if it may)."""
    if table.engine_id != remote.remote_engine_id:
        return (f"the rank table is of engine {_quote(table.engine_id)}, the params name engine "
                f"{_quote(remote.remote_engine_id)}")
    if remote.remote_incarnation and table.incarnation != remote.remote_incarnation:
        return (f"P restarted: the params are from incarnation {_quote(remote.remote_incarnation)}, the rank table "
                f"from {_quote(table.incarnation or 'none')}")
    ranks = [entry.rank for entry in table.ranks]
    if sorted(ranks) != list(range(remote.num_ranks)):
        shown = ", ".join(map(str, sorted(ranks)[:8])) + (", ..." if len(ranks) > 8 else "")
        return (f"the rank table lists ranks [{shown}], the params name {remote.num_ranks} "
                f"(tp_size {remote.tp_size} x pp_size {remote.pp_size})")
    by_rank = {entry.rank: entry for entry in table.ranks}
    entry = by_rank[0]
    if not (_same_address(entry.host, remote.remote_host) and entry.port == remote.remote_port):
        return (f"the rank table puts rank 0 at {_quote(entry.host)}:{entry.port}, the params' entry point is "
                f"{remote.remote_host}:{remote.remote_port}")
    for rank in range(remote.num_ranks):
        ep = by_rank[rank]
        problem = host_problem(ep.host)
        if problem:
            return f"the rank table's rank {rank}: {problem}"
        if not any(lo <= ep.port <= hi for lo, hi in peer_ports):
            return (f"the rank table's rank {rank} listens on port {ep.port}, not inside the allowed side-channel "
                    f"ports (the peer_ports setting)")
    return ""


def endpoints_of(table: RankTable) -> tuple[Endpoint, ...]:
    """Per rank, in rank order, the endpoint of an accepted table."""
    return tuple((e.host, e.port) for e in sorted(table.ranks, key=lambda e: e.rank))


def entry_only(remote: RemotePrefill) -> tuple[Endpoint, ...] | None:
    """The endpoints when no table is needed (P has one rank: the entry point is all of it), else None."""
    return ((remote.remote_host, remote.remote_port),) if remote.num_ranks == 1 else None


def table_of(engine_id: str, incarnation: str, endpoints: dict[int, Endpoint]) -> RankTable:
    """P's table from what its ranks advertised (rank -> (host, port))."""
    return RankTable(engine_id, incarnation, [RankEndpoint(r, h, p) for r, (h, p) in sorted(endpoints.items())])
