"""What the connector's two halves tell each other, once per engine step (as vLLM's NIXL connector keeps its
``metadata.py``). Scheduler -> workers: :class:`KVP2PMetadata` (P's hold orders, D's pull plans). Workers ->
scheduler: :class:`KVP2PWorkerMetadata` (D's :class:`PullReport` per finished pull, merged over ranks).

Both halves import this module; neither imports the other (tests/unit/test_import_graph.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vllm_kvp2p.lifecycle.consumer import PullPlan


@dataclass(frozen=True)
class HoldOrder:
    """P scheduler -> P workers: keep these blocks for a decoder."""

    request_id: str
    hold_id: str
    num_blocks: int = 0  # every block vLLM keeps for it (all groups): the blocks-held gauge
    # The blocks the params offer, per KV-cache group (remote_block_ids): all a reader may ask P's sums of.
    offered: tuple[tuple[int, ...], ...] = ()
    mac: str = ""  # the params' signature ("" unsigned): an abandon of the hold must carry it


@dataclass
class KVP2PMetadata(KVConnectorMetadata):
    """What one scheduler step tells the workers."""

    holds: list[HoldOrder] = field(default_factory=list)
    pulls: list[PullPlan] = field(default_factory=list)


@dataclass(frozen=True)
class PullReport:
    """One D rank's account of one finished pull (worker -> scheduler, summed over ranks)."""

    ok: bool
    blocks: int
    bytes: int
    descriptors: int
    seconds: float
    reason: str = ""
    failure: str = ""  # lifecycle.consumer.Failure value, for the metrics
    verified: int = 0  # units (a block of one plane) whose integrity digests matched P's, over all ranks
    unverified: bool = False  # a rank's P gave no digests with integrity checks on
    sums_lost: bool = False  # a rank's P had answered the release, its digests lost on the way (a resent release)

    def merge(self, other: PullReport) -> PullReport:
        return PullReport(
            self.ok and other.ok,
            max(self.blocks, other.blocks),  # every rank fills the same logical blocks
            self.bytes + other.bytes,
            self.descriptors + other.descriptors,
            max(self.seconds, other.seconds),
            self.reason or other.reason,
            self.failure or other.failure,
            self.verified + other.verified,
            self.unverified or other.unverified,
            self.sums_lost or other.sums_lost,
        )


@dataclass
class KVP2PWorkerMetadata(KVConnectorWorkerMetadata):
    reports: dict[str, PullReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVP2PWorkerMetadata)
        merged = dict(self.reports)
        for req_id, report in other.reports.items():
            merged[req_id] = merged[req_id].merge(report) if req_id in merged else report
        return KVP2PWorkerMetadata(merged)
