"""D side at run time: P instances one of whose ranks did not answer lately ("suspects"), one record each.

A plan for a suspect P first probes the rank that did not answer (one short round trip) and fails at once if that
gets no answer too, instead of paying the full side-channel timeouts again; an answer, or any pull from it that
did not fail, trusts it again. On an engine over several nodes the entry point may answer while a far rank's node
is cut off, so the rank probed is the one that did not answer, where P's own rank table put it.

Bounded like every table of the pull loop (the params a client sends name the P instances): the ``MAX_PEERS``
most recent.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass

from vllm_kvp2p.contract.protocol import GetRegistration
from vllm_kvp2p.contract.side_channel import PROBE_TIMEOUT_S, SideChannelClient, SideChannelError, Unauthenticated
from vllm_kvp2p.decode.pull_lanes import MAX_PEERS, Instance
from vllm_kvp2p.lifecycle.consumer import Failure, PullPlan
from vllm_kvp2p.lifecycle.pull_actions import Outcome, PullResult


@dataclass(frozen=True)
class Suspect:
    until: float  # monotonic
    endpoint: tuple[str, int]  # where to probe: the rank that did not answer
    rank: int


class Suspects:
    """The suspect P instances, each until ``suspect_time`` after it last failed to answer."""

    def __init__(self, suspect_time: float) -> None:
        self.suspect_time = suspect_time
        self._table: OrderedDict[Instance, Suspect] = OrderedDict()

    def __len__(self) -> int:
        """Suspects not yet expired."""
        now = time.monotonic()
        return sum(s.until > now for s in list(self._table.values()))

    def check(self, plan: PullPlan, instance: Instance, client: SideChannelClient) -> PullPlan:
        """``plan`` as it is, or failed (contacting P no more) when its P is suspect and its silent rank does not
        answer a probe now."""
        suspect = self._table.get(instance)
        if suspect is None:
            return plan
        if time.monotonic() >= suspect.until:
            self._table.pop(instance, None)
            return plan
        host, port = suspect.endpoint
        try:
            client.request(host, port, GetRegistration(suspect.rank), timeout=PROBE_TIMEOUT_S)
        except Unauthenticated:
            pass  # it answered: up (the pull says why it refused)
        except SideChannelError as exc:
            rank = f" (P rank {suspect.rank})" if suspect.rank else ""
            return dataclasses.replace(
                plan, failure=Failure.UNREACHABLE, contact_p=False,
                error=f"P at {host}:{port}{rank} did not answer lately and does not answer a probe now: {exc}",
            )
        self._table.pop(instance, None)
        return plan

    def note(self, plan: PullPlan, instance: Instance, result: PullResult) -> None:
        """A pull's outcome: a P that did not answer becomes suspect; one that took part in a pull is trusted."""
        if result.failure is Failure.UNREACHABLE:
            # The rank that did not answer, where P's own rank table put it; without a table (one rank, or none
            # fetched) the entry point, which answers for the engine.
            rank = result.unreachable_rank or 0
            if rank >= len(plan.p_endpoints):
                rank = 0
            put_recent(self._table, instance, Suspect(time.monotonic() + self.suspect_time, plan.p_endpoint(rank),
                                                      rank))
        elif result.outcome is not Outcome.FAILED:
            self._table.pop(instance, None)


def put_recent(table: OrderedDict, key: object, value: object) -> None:
    """Store ``key`` as the most recent entry, forgetting the oldest beyond MAX_PEERS."""
    table.pop(key, None)
    table[key] = value
    while len(table) > MAX_PEERS:
        table.popitem(last=False)
