"""D side, worker half: what the pull state machine (:mod:`vllm_kvp2p.lifecycle.pull`) is given (this D rank's
memory, :class:`LocalKV`, and the P ranks it talks to, :class:`Source`), what it asks its adapter to do (the
actions, each addressed to a P rank) and what a pull ends with (:class:`PullResult`, and for a failure what an
operator may change, :data:`FAILURE_HINTS`). Pure values: no sockets, threads, clocks or torch.

The completion rule lives in :attr:`PullResult.report_finished`: vLLM parked the request in
``WAITING_FOR_REMOTE_KVS`` only when it asked for external tokens (``PullPlan.awaiting``), and only then may the
receive be reported (reporting it for a RUNNING request kills vLLM's scheduler).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

from vllm_kvp2p.contract.protocol import Claim, Release, Renew, layers_of_planes
from vllm_kvp2p.lifecycle.consumer import Failure
from vllm_kvp2p.lifecycle.integrity import Verification
from vllm_kvp2p.transfer.descriptors import Descriptors, PlaneGeometry
from vllm_kvp2p.transfer.kv_groups import KVGroup, single_full_group
from vllm_kvp2p.transfer.slicing import BlockShape
from vllm_kvp2p.transfer.tp_mapping import HeadSlice


@dataclass(frozen=True)
class LocalKV:
    """This D rank's KV memory and model geometry, as its registration describes it."""

    planes: tuple[PlaneGeometry, ...]
    shapes: tuple[BlockShape, ...]
    block_size: int
    layer_names: tuple[str, ...]
    dtype: str
    total_num_kv_heads: int
    use_mla: bool = False
    groups: tuple[KVGroup, ...] = ()  # KV-cache groups; empty: one full-attention group
    plane_groups: tuple[int, ...] = ()  # group index of each plane; empty: all in group 0
    tp_size: int = 1
    model_fingerprint: str = ""  # vllm_kvp2p/contract/identity.py; empty: not compared
    plane_layers: tuple[int, ...] = ()  # layer index of each plane; empty: as many planes per layer
    pp_size: int = 1  # D's pipeline stages: this rank holds its stage's layers only

    def kv_groups(self) -> tuple[KVGroup, ...]:
        return self.groups or single_full_group(self.block_size)

    def group_of_planes(self) -> tuple[int, ...]:
        return self.plane_groups or (0,) * len(self.planes)

    def layer_of_planes(self) -> tuple[int, ...]:
        return self.plane_layers or layers_of_planes(len(self.planes), len(self.layer_names))


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
    # The integrity check of what was read from this rank: the adapter sums D's copies (``local_runs``) before
    # sending, and hands them with P's answer to ConsumerPull.on_release_sent.
    verification: Verification | None = None


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
    verified_units: int = 0  # units whose digests P and D compared and found equal
    unverified: bool = False  # a rank read from gave no digests (an older P, P busy), with integrity checks on
    unverified_reason: str = ""  # why, e.g. "P rank 0: busy" (Released.no_sums: P's sums would end after D's budget)
    sums_lost: bool = False  # a rank's digests were lost: it answered the release before, not the copy D got
    unreachable_rank: int | None = None  # the P rank that did not answer (failure UNREACHABLE)

    @property
    def integrity(self) -> str:
        """The pull's integrity outcome, a metrics counter (vllm_kvp2p/metrics.INTEGRITY_COUNTERS); "": not checked.
        A rank's lost sums outrank another's missing ones: that is the one to look into."""
        if self.sums_lost:
            return "sums_lost"
        return "unverified" if self.unverified else "verified" if self.verified_units else ""

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


#: What an operator may change for each kind of failure (the WARNING of a failed pull ends with it).
FAILURE_HINTS: dict[Failure, str] = {
    Failure.INVALID_PARAMS: "the client sent D params no P issued, or peer_ports excludes P's ports",
    Failure.UNAUTHENTICATED: "VLLM_KVP2P_SECRET must be the same on P and D, their clocks within clock_skew",
    Failure.INCOMPATIBLE: "P and D must serve the same model with the same KV layout and package version",
    Failure.UNREACHABLE: "P down, or its advertised address (host / VLLM_HOST_IP) unreachable from D; "
                         "side_channel_timeout bounds the wait",
    Failure.REFUSED: "P no longer holds the blocks: hold_timeout on P shorter than D's queueing",
    Failure.TIMEOUT: "pull_timeout bounds a whole pull",
    Failure.READ_FAILED: "a Mooncake read failed: transfer_timeout, protocol, device_name",
    Failure.LEASE_LOST: "the read outlived the lease: lease_timeout on P vs transfer_timeout on D",
    Failure.CORRUPTED: "the bytes read differ from P's: the transfer path, memory or the KV layout "
                       "(docs/troubleshooting.md)",
}
