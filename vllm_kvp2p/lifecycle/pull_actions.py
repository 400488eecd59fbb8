"""D side, worker half: what the pull state machine (:mod:`vllm_kvp2p.lifecycle.pull`) asks its adapter to do
(the actions, each addressed to a P rank, a :class:`Source`) and what a pull ends with (:class:`PullResult`). Pure
values: no sockets, threads, clocks or torch.

The completion rule lives in :attr:`PullResult.report_finished`: vLLM parked the request in
``WAITING_FOR_REMOTE_KVS`` only when it asked for external tokens (``PullPlan.awaiting``), and only then may the
receive be reported (reporting it for a RUNNING request kills vLLM's scheduler).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

from vllm_kvp2p.lifecycle.consumer import Failure
from vllm_kvp2p.protocol import Claim, Release, Renew
from vllm_kvp2p.tp_mapping import HeadSlice
from vllm_kvp2p.transfer.descriptors import Descriptors


@dataclass(frozen=True)
class Source:
    """One P rank this D rank talks to for a request: reads ``slices`` from it (none: only releases it)."""

    p_rank: int
    expected_readers: int = 1  # D ranks that will release this P rank for the request (same on every D rank)
    slices: tuple[HeadSlice, ...] = ()


@dataclass(frozen=True)
class FetchRegistration:
    """Give the job P rank ``source``'s registration: a cached one (:meth:`ConsumerPull.on_registration`), or, with
    ``join_claim``, none yet (:meth:`ConsumerPull.with_claim`: it comes with the claim's reply); otherwise fetch."""

    source: Source
    join_claim: bool = True


@dataclass(frozen=True)
class SendClaim:
    source: Source
    message: Claim


@dataclass(frozen=True)
class Wait:
    until: float


@dataclass(frozen=True)
class ReadBatch:
    source: Source
    segment: str
    descriptors: Descriptors


@dataclass(frozen=True)
class SendRenew:
    source: Source
    message: Renew


@dataclass(frozen=True)
class SendRelease:
    source: Source
    message: Release


class Outcome(enum.Enum):
    PULLED = "pulled"
    FAILED = "failed"
    NOTHING_TO_PULL = "nothing_to_pull"


@dataclass(frozen=True)
class PullResult:
    request_id: str
    outcome: Outcome
    awaiting: bool
    local_block_ids: tuple[int, ...]  # of every group
    num_blocks: int = 0
    num_bytes: int = 0
    num_descriptors: int = 0
    reason: str = ""
    failure: Failure | None = None  # set when the outcome is FAILED

    @property
    def report_finished(self) -> bool:
        """Report the receive to vLLM only if vLLM is waiting for it (see the module docstring)."""
        return self.awaiting

    @property
    def report_failed(self) -> bool:
        return self.awaiting and self.outcome is Outcome.FAILED


@dataclass(frozen=True)
class Finish:
    result: PullResult


Action = Union[FetchRegistration, SendClaim, Wait, ReadBatch, SendRenew, SendRelease, Finish]
