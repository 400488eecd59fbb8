"""Connector metrics through vLLM's own connector-stats path (vLLM 0.23 and 0.32 alike).

How a :class:`Kvp2pStats` travels, and why its payload is a plain dict:

* worker: vLLM calls ``connector.get_kv_connector_stats()`` after every model step and puts the object in
  ``KVConnectorOutput.kv_connector_stats``; it is pickled to the engine core, where ``KVOutputAggregator``
  folds the TP ranks together with :meth:`Kvp2pStats.aggregate`.
* scheduler: ``Scheduler.update_from_output`` merges the scheduler-side connector's ``get_kv_connector_stats()``
  (0.32: whenever it is not ``is_empty()``; 0.23: only on steps where some worker returned stats), then
  ``make_stats`` ships ``to_dict()`` (0.32) or ``.data`` (0.23) to the API server over msgspec.
* API server: ``KVConnectorLogging.observe`` rebuilds a :class:`Kvp2pStats` with the connector class's
  ``build_kv_connector_stats(data)``, aggregates the steps of a log interval and prints :meth:`Kvp2pStats.reduce`
  on the "KV Transfer metrics:" line; ``KVConnectorProm.observe`` hands every step's dict to
  :meth:`Kvp2pPromMetrics.observe`.

So the payload holds only str keys, lists, ints, floats and dicts of those, never objects. Under vLLM's
MultiConnector a connector that returns stats must also build Prometheus metrics: ``MultiKVConnectorPromMetrics``
asserts that every connector in a payload has some, in the API server's output handler, and that assertion
kills it. The connector's ``build_kv_connector_stats`` / ``build_prom_metrics`` classmethods forward to
:func:`build_kv_connector_stats` and :func:`build_prom_metrics` here.

Feeding it: the worker's ``get_kv_connector_stats()`` returns ``stats.clone_and_reset()`` on every call, even
empty (on 0.23 that is what lets the scheduler-side stats through); the scheduler-side connector's returns
``None if stats.is_empty() else stats.clone_and_reset()`` (0.32 would drop an empty one, gauges and all, so they
wait for the next event). The object is not thread-safe: the connector serializes recording and
``clone_and_reset``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_kvp2p.contract import pairing_key
from vllm_kvp2p.log import get_logger

logger = get_logger(__name__)

# Payload keys. One entry per successful pull in the first three lists (aligned); claim RTTs only where measured.
PULL_SECONDS = "pull_seconds"
PULL_BYTES = "pull_bytes"
PULL_DESCRIPTORS = "pull_descriptors"
CLAIM_RTT = "claim_rtt_seconds"
UNSAMPLED = "pulls_unsampled"  # pulls past MAX_SAMPLES: counted, not kept
FAILURES = "failures"  # {kind: n}
HOLDS = "holds"  # {counter: n}
DROPPED = "dropped"  # {reason: n}
GAUGES = "gauges"  # {rank: {"blocks_held": int, "oldest_hold_age": float}}, latest per rank
# {rank: {table: entries}}, latest per rank: WorkerSide.table_sizes (P's ledger, D's pull tables), read every step
# so that an idle engine's last step shows its idle tables (the soak's leak check reads them; a leak on a dashboard).
TABLES = "tables"
# "abandoned": of the released, those freed by an abandon (protocol.Abandon: no decoder would ever claim them).
HOLD_COUNTERS = ("created", "released", "expired", "claims_refused", "abandoned")
INTEGRITY = "integrity"  # {counter: n}: D's good pulls by integrity outcome (PullResult.integrity)
# Digests matched / P gave none (an older P, a question P did not answer) / P had answered the release, but that
# answer was lost and P no longer kept it for the resent copy D got (Released.sums_lost).
INTEGRITY_COUNTERS = ("verified", "unverified", "sums_lost")

# Known label values, exported at 0 from the start so that rate() works before the first event.
FAILURE_KINDS = (
    "invalid_params", "unauthenticated", "incompatible", "unreachable", "refused",
    "timeout", "read_failed", "lease_lost", "internal", "shutdown", "corrupted",
)  # fmt: skip
# SideChannelServer.dropped; resent_copy_dropped: a copy of a request waiting for its deferred answer forgotten
# beyond side_channel.MAX_COPIES copies (one peer resending one release over and over)
DROP_REASONS = ("unauthenticated", "undecodable", "handler_error", "deferred_full", "resent_copy_dropped")

MAX_SAMPLES = 65536  # per list: bounds memory if nobody drains the stats (a model runner that never asks)
MAX_REASONS = 32  # distinct kinds/reasons per table, the rest count as "other" (label cardinality)
MAX_RANKS = 1024  # distinct gauge ranks kept
MAX_LABEL = 64  # characters of a kind/reason/rank
OTHER = "other"

LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0]
BYTES_BUCKETS = [float(2**i) for i in range(12, 33, 2)]  # 4 KiB .. 4 GiB
DESCRIPTOR_BUCKETS = [float(4**i) for i in range(9)]  # 1 .. 65536


def _empty() -> dict[str, Any]:
    return {
        PULL_SECONDS: [],
        PULL_BYTES: [],
        PULL_DESCRIPTORS: [],
        CLAIM_RTT: [],
        UNSAMPLED: 0,
        FAILURES: {},
        HOLDS: dict.fromkeys(HOLD_COUNTERS, 0),
        INTEGRITY: dict.fromkeys(INTEGRITY_COUNTERS, 0),
        DROPPED: {},
        GAUGES: {},
        TABLES: {},
    }


def _normalize(data: dict[str, Any] | None) -> dict[str, Any]:
    """A fresh payload from one that may have crossed msgspec or pickle (or be partial): never aliases ``data``.

    Copying matters in one process too: vLLM hands the same dict to the log accumulator and to Prometheus.
    """
    out = _empty()
    if not data:
        return out
    for key, cast in ((PULL_SECONDS, float), (PULL_BYTES, int), (PULL_DESCRIPTORS, int), (CLAIM_RTT, float)):
        out[key] = [cast(v) for v in data.get(key) or ()]
    out[UNSAMPLED] = int(data.get(UNSAMPLED) or 0)
    for key in (FAILURES, DROPPED):
        out[key] = {str(k): int(v) for k, v in (data.get(key) or {}).items()}
    for key in (HOLDS, INTEGRITY):
        for name, n in (data.get(key) or {}).items():
            out[key][str(name)] = int(n)
    out[GAUGES] = {
        str(rank): {"blocks_held": int(g.get("blocks_held", 0)), "oldest_hold_age": float(g.get("oldest_hold_age", 0))}
        for rank, g in (data.get(GAUGES) or {}).items()
    }
    out[TABLES] = {str(rank): {str(k): int(n) for k, n in t.items()} for rank, t in (data.get(TABLES) or {}).items()}
    return out


def _bounded(table: dict[str, Any], key: str, limit: int = MAX_REASONS) -> str:
    key = str(key)[:MAX_LABEL]
    return key if key in table or len(table) < limit else OTHER


def _add_counts(dst: dict[str, int], src: dict[str, int]) -> None:
    for key, n in src.items():
        if n:
            key = _bounded(dst, key)
            dst[key] = dst.get(key, 0) + n


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks, as numpy.percentile does by default."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class Kvp2pStats(KVConnectorStats):
    """What one rank (or vLLM's aggregation of several ranks and steps) saw since the last drain.

    No ``__bool__``/``__len__`` on purpose: vLLM tests the object's truth (``if kv_connector_stats``) to mean
    "not None", and an empty-looking object would drop the scheduler-side stats on 0.23.
    """

    def __post_init__(self) -> None:
        self.data = _normalize(self.data)

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> Kvp2pStats | None:
        """vLLM's ``build_kv_connector_stats(data)``: None for no payload (vLLM never sends ours empty)."""
        return cls(data=data) if data else None

    # ------------------------------------------------------------------ recording (our worker/scheduler code)

    def record_pull(self, seconds: float, num_bytes: int, descriptors: int, claim_rtt: float | None) -> None:
        """D: one pull read all its blocks."""
        if len(self.data[PULL_SECONDS]) >= MAX_SAMPLES:
            self.data[UNSAMPLED] += 1
        else:
            self.data[PULL_SECONDS].append(float(seconds))
            self.data[PULL_BYTES].append(int(num_bytes))
            self.data[PULL_DESCRIPTORS].append(int(descriptors))
        if claim_rtt is not None and len(self.data[CLAIM_RTT]) < MAX_SAMPLES:
            self.data[CLAIM_RTT].append(float(claim_rtt))

    def record_integrity(self, outcome: str) -> None:
        """D: one good pull with integrity checks on, by outcome (one of :data:`INTEGRITY_COUNTERS`)."""
        if outcome in INTEGRITY_COUNTERS:
            self.data[INTEGRITY][outcome] += 1

    def record_failure(self, kind: str) -> None:
        """D: one pull failed (kinds: ``lifecycle.consumer.Failure`` values)."""
        _add_counts(self.data[FAILURES], {str(kind): 1})

    def record_holds(self, created: int = 0, released: int = 0, expired: int = 0, claims_refused: int = 0,
                     abandoned: int = 0) -> None:
        """P: hold-ledger events since the last call."""
        for name, n in zip(HOLD_COUNTERS, (created, released, expired, claims_refused, abandoned)):
            self.data[HOLDS][name] += int(n)

    def record_dropped(self, reason: str, n: int) -> None:
        """P: side-channel requests not handled since the last call (a delta of ``SideChannelServer.dropped``)."""
        _add_counts(self.data[DROPPED], {str(reason): int(n)})

    def set_gauges(self, rank: str, blocks_held: int, oldest_hold_age: float) -> None:
        """P: one rank's ledger right now. Keyed by rank: ranks add up, later values of a rank replace earlier."""
        rank = _bounded(self.data[GAUGES], rank, MAX_RANKS)
        self.data[GAUGES][rank] = {"blocks_held": int(blocks_held), "oldest_hold_age": float(oldest_hold_age)}

    def set_tables(self, rank: str, sizes: dict[str, int]) -> None:
        """P or D: one rank's table sizes right now (``WorkerSide.table_sizes``); later values of a rank replace
        earlier. Like the gauges, not an event (:meth:`is_empty`)."""
        rank = _bounded(self.data[TABLES], rank, MAX_RANKS)
        self.data[TABLES][rank] = {str(k)[:MAX_LABEL]: int(n) for k, n in list(sizes.items())[:MAX_REASONS]}

    def clone_and_reset(self) -> Kvp2pStats:
        """What ``get_kv_connector_stats`` returns: this interval's stats, leaving this object empty."""
        old = copy.copy(self)  # shares the dict, which reset() replaces rather than clears
        self.reset()
        return old

    # ------------------------------------------------------------------ vLLM's KVConnectorStats interface

    def reset(self) -> None:
        self.data = _empty()

    def has_gauges(self) -> bool:
        return bool(self.data[GAUGES])

    def is_empty(self) -> bool:
        """Nothing happened: no pull, failure, hold event or drop. Gauges alone do not count.

        Why: P's workers report gauges on every step so that Prometheus stays current; counting them would print
        a "KV Transfer metrics:" line every log interval on an idle P. vLLM keeps an empty accumulator (it only
        resets after logging), so the next line still shows the latest gauges. The price: 0.32's scheduler drops
        scheduler-side stats that are empty, so gauges must come from the workers (where the ledgers are) or
        ride along with an event; workers' stats are never filtered.
        """
        d = self.data
        return not (
            d[PULL_SECONDS]
            or d[CLAIM_RTT]
            or d[UNSAMPLED]
            or any(d[FAILURES].values())
            or any(d[HOLDS].values())
            or any(d[INTEGRITY].values())
            or any(d[DROPPED].values())
        )

    def aggregate(self, other: KVConnectorStats) -> Kvp2pStats:
        """Fold ``other`` (another rank, or a later step) into this one: counts add, samples concatenate, gauges
        keep the latest value per rank (``other`` is the later one). ``other`` is not modified."""
        theirs = _normalize(other.data)
        mine = self.data
        room = MAX_SAMPLES - len(mine[PULL_SECONDS])
        for key in (PULL_SECONDS, PULL_BYTES, PULL_DESCRIPTORS):
            mine[key].extend(theirs[key][: max(room, 0)])
        mine[UNSAMPLED] += theirs[UNSAMPLED] + max(len(theirs[PULL_SECONDS]) - max(room, 0), 0)
        mine[CLAIM_RTT].extend(theirs[CLAIM_RTT][: max(MAX_SAMPLES - len(mine[CLAIM_RTT]), 0)])
        _add_counts(mine[FAILURES], theirs[FAILURES])
        _add_counts(mine[DROPPED], theirs[DROPPED])
        for key in (HOLDS, INTEGRITY):
            for name, n in theirs[key].items():
                mine[key][name] = mine[key].get(name, 0) + n
        for key in (GAUGES, TABLES):
            for rank, values in theirs[key].items():
                mine[key][_bounded(mine[key], rank, MAX_RANKS)] = values
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval in a few numbers for vLLM's log line; D's part and P's part only where they saw something."""
        d = self.data
        out: dict[str, int | float] = {}
        seconds, nbytes = d[PULL_SECONDS], d[PULL_BYTES]
        failures = sum(d[FAILURES].values())
        p_side = any(d[HOLDS].values()) or any(d[DROPPED].values()) or bool(d[GAUGES])
        if seconds or failures or d[CLAIM_RTT] or d[UNSAMPLED] or not p_side:
            out["Pulls"] = len(seconds) + d[UNSAMPLED]
            if seconds:
                total_s, total_b = sum(seconds), sum(nbytes)
                out["Avg pull (ms)"] = round(total_s / len(seconds) * 1e3, 3)
                out["P90 pull (ms)"] = round(_percentile(seconds, 90) * 1e3, 3)
                out["MB pulled"] = round(total_b / 2**20, 3)
                # Bytes over the summed pull time: per-pull speed (concurrent pulls are not one link's rate).
                out["Throughput (GB/s)"] = round(total_b / total_s / 1e9, 3) if total_s > 0 else 0.0
                out["Avg descriptors"] = round(sum(d[PULL_DESCRIPTORS]) / len(seconds), 1)
            if d[CLAIM_RTT]:
                out["Avg claim RTT (ms)"] = round(sum(d[CLAIM_RTT]) / len(d[CLAIM_RTT]) * 1e3, 3)
            out["Failures"] = failures
            if any(d[INTEGRITY].values()):
                out["Verified"] = d[INTEGRITY]["verified"]
                out["Unverified"] = d[INTEGRITY]["unverified"]
                out["Sums lost"] = d[INTEGRITY]["sums_lost"]
            for kind in sorted(d[FAILURES]):
                if d[FAILURES][kind]:
                    out[f"Failures {kind}"] = d[FAILURES][kind]
        if p_side:
            out["Holds created"] = d[HOLDS]["created"]
            out["Holds released"] = d[HOLDS]["released"]
            out["Holds expired"] = d[HOLDS]["expired"]
            out["Claims refused"] = d[HOLDS]["claims_refused"]
            if any(d[DROPPED].values()):
                out["Side channel dropped"] = sum(d[DROPPED].values())
            if d[GAUGES]:
                blocks, oldest = _gauge_totals(d[GAUGES].values())
                out["Blocks held"] = blocks
                out["Oldest hold age (s)"] = round(oldest, 3)
        return out


def _gauge_totals(ranks: Iterable[dict[str, Any]]) -> tuple[int, float]:
    """Blocks held add up over ranks (each rank's ledger pins its own shards); the oldest hold is the max age."""
    ranks = list(ranks)
    return sum(int(g["blocks_held"]) for g in ranks), max((float(g["oldest_hold_age"]) for g in ranks), default=0.0)


class Kvp2pPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvp2p_*`` metrics, made with the metric classes vLLM passes (plain prometheus_client, or Ray's
    wrappers) and labelled per engine as NIXL's are; counters with a ``reason`` label add it last."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        labelnames = list(labelnames)

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        def histogram(name: str, doc: str, buckets: list[float]) -> dict[int, Any]:
            return per_engine(self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames))

        def counter(name: str, doc: str) -> dict[int, Any]:
            return per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames))

        def gauge(name: str, doc: str) -> dict[int, Any]:
            # "mostrecent" as vLLM's own gauges: with several API-server processes the last write wins.
            return per_engine(
                self._gauge_cls(name=name, documentation=doc, multiprocess_mode="mostrecent", labelnames=labelnames)
            )

        self.pull_seconds = histogram(
            "vllm:kvp2p_pull_seconds", "Duration of successful kvp2p KV pulls (D).", LATENCY_BUCKETS
        )
        self.pull_bytes = histogram("vllm:kvp2p_pull_bytes", "Bytes read per successful kvp2p pull (D).", BYTES_BUCKETS)
        self.pull_descriptors = histogram(
            "vllm:kvp2p_pull_descriptors", "Mooncake read descriptors per successful kvp2p pull (D).",
            DESCRIPTOR_BUCKETS,
        )  # fmt: skip
        self.claim_rtt = histogram(
            "vllm:kvp2p_claim_rtt_seconds", "Round trip of D's claim on P's side channel.", LATENCY_BUCKETS
        )
        self.holds_created = counter("vllm:kvp2p_holds_created", "Prompts whose KV blocks P held for a decoder.")
        self.holds_released = counter(
            "vllm:kvp2p_holds_released", "Holds freed because their decoder released them, or because the holder of "
            "their params abandoned them (vllm:kvp2p_holds_abandoned counts those)."
        )
        self.holds_abandoned = counter(
            "vllm:kvp2p_holds_abandoned", "Of the holds released, those freed by an abandon: the proxy will deliver "
            "their params to no decoder (D refused the request before its engine or was unreachable; the client left)."
        )
        self.holds_expired = counter("vllm:kvp2p_holds_expired", "Holds freed at hold or lease expiry.")
        self.claims_refused = counter("vllm:kvp2p_claims_refused", "Claims P's side channel refused.")
        self.pulls_verified = counter(
            "vllm:kvp2p_pulls_verified", "Pulls on D whose integrity digests matched P's (mismatches: pull_failures "
            "with reason corrupted)."
        )
        self.pulls_unverified = counter(
            "vllm:kvp2p_pulls_unverified", "Pulls on D with integrity checks on that P gave no digests for."
        )
        self.pulls_sums_lost = counter(
            "vllm:kvp2p_pulls_sums_lost", "Pulls on D whose digests P computed but lost: the answer to the first "
            "copy of a resent release did not arrive, and P no longer kept it for the copy."
        )
        self.blocks_held = gauge("vllm:kvp2p_blocks_held", "KV blocks P holds for decoders, summed over its ranks.")
        self.oldest_hold_age = gauge(
            "vllm:kvp2p_oldest_hold_age_seconds", "Age of the oldest hold on P (max over its ranks)."
        )
        # Max over ranks, not the sum: every rank keeps its own entry for the same hold or peer, so a sum would
        # count each TP times; the max is what the largest rank holds (the per-rank bounds apply to it), and a
        # leak on any one rank still shows.
        self._table_entries = self._gauge_cls(
            name="vllm:kvp2p_table_entries", documentation="Entries in each of the connector's tables (P's hold "
            "ledger, D's pull tables; readers_per_hold: the most readers of one hold), the largest over ranks, as of "
            "the engine's last step: holds, early_releases, freed, questions_waiting, queued_plans, results and "
            "suspects are 0 at idle.",
            multiprocess_mode="mostrecent", labelnames=labelnames + ["table"],
        )  # fmt: skip
        self._failures = self._counter_cls(
            name="vllm:kvp2p_pull_failures", documentation="Failed kvp2p pulls on D, by reason.",
            labelnames=labelnames + ["reason"],
        )  # fmt: skip
        self._dropped = self._counter_cls(
            name="vllm:kvp2p_side_channel_dropped",
            documentation="Requests P's side channel did not handle, by reason.",
            labelnames=labelnames + ["reason"],
        )
        self._pairing_info(vllm_config, labelnames)
        self._reason_children: dict[tuple[int, int], dict[str, Any]] = {}  # (metric, engine) -> reason -> child
        # Latest gauge values per engine and rank: a step's payload may carry only some ranks.
        self._gauge_ranks: dict[int, dict[str, dict[str, Any]]] = {}
        self._table_ranks: dict[int, dict[str, dict[str, int]]] = {}  # the same for the table sizes
        for idx in self.per_engine_labelvalues:
            for kind in FAILURE_KINDS:
                self._reason(self._failures, idx, kind)
            for reason in DROP_REASONS:
                self._reason(self._dropped, idx, reason)

    def _pairing_info(self, vllm_config: VllmConfig, labelnames: list[str]) -> None:
        """``vllm:kvp2p_pairing_info``: what decides whether this engine can exchange KV with another
        (vllm_kvp2p/contract/pairing_key.py),
        set to 1 once, from the config vLLM builds its metrics with (after the engine
        settled its block size), so a router reads it with a GET and no request. Not exported when the config
        lacks what it reads: a router then knows nothing, rather than something wrong."""
        try:
            key = pairing_key.of_engine(vllm_config)
        except Exception as exc:  # noqa: BLE001 - the API server must start; absent is the honest answer
            logger.warning("%s not exported: %s: %s", pairing_key.METRIC, type(exc).__name__, exc)
            return
        info = self._gauge_cls(
            name=pairing_key.METRIC, documentation="What decides whether this engine can exchange KV with another "
            "(always 1; the values are the labels: docs/routing.md, 'Pairs that can exchange KV').",
            multiprocess_mode="mostrecent", labelnames=labelnames + list(pairing_key.LABELS),
        )  # fmt: skip
        for values in self.per_engine_labelvalues.values():
            info.labels(*values, *key.labels().values()).set(1)

    def _reason(self, parent: Any, engine_idx: int, reason: str) -> Any:
        """The child of a metric with one label past the engine's (a counter's ``reason``, the tables' ``table``),
        made once (Ray's wrappers allow one ``labels()`` call)."""
        children = self._reason_children.setdefault((id(parent), engine_idx), {})
        reason = _bounded(children, reason, MAX_REASONS + len(FAILURE_KINDS))
        if reason not in children:
            children[reason] = parent.labels(*self.per_engine_labelvalues[engine_idx], reason)
        return children[reason]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for metric, key in (
            (self.pull_seconds, PULL_SECONDS),
            (self.pull_bytes, PULL_BYTES),
            (self.pull_descriptors, PULL_DESCRIPTORS),
            (self.claim_rtt, CLAIM_RTT),
        ):
            for value in data.get(key) or ():
                metric[engine_idx].observe(value)
        holds = data.get(HOLDS) or {}
        for metric, name in zip(
            (self.holds_created, self.holds_released, self.holds_expired, self.claims_refused, self.holds_abandoned),
            HOLD_COUNTERS,
        ):
            if holds.get(name):
                metric[engine_idx].inc(holds[name])
        integrity = data.get(INTEGRITY) or {}
        for metric, name in zip((self.pulls_verified, self.pulls_unverified, self.pulls_sums_lost),
                                INTEGRITY_COUNTERS):
            if integrity.get(name):
                metric[engine_idx].inc(integrity[name])
        for parent, key in ((self._failures, FAILURES), (self._dropped, DROPPED)):
            for reason, n in (data.get(key) or {}).items():
                if n:
                    self._reason(parent, engine_idx, reason).inc(n)
        # Gauges only move when a payload has them: an interval without a report keeps the last value.
        if gauges := data.get(GAUGES):
            ranks = self._gauge_ranks.setdefault(engine_idx, {})
            for rank, values in gauges.items():
                rank = _bounded(ranks, rank, MAX_RANKS)
                ranks[rank] = dict(values)
            blocks, oldest = _gauge_totals(ranks.values())
            self.blocks_held[engine_idx].set(blocks)
            self.oldest_hold_age[engine_idx].set(oldest)
        # Only tables some rank reported are exported: a table never reported is absent, never a 0.
        if tables := data.get(TABLES):
            ranks = self._table_ranks.setdefault(engine_idx, {})
            for rank, sizes in tables.items():
                ranks[_bounded(ranks, rank, MAX_RANKS)] = dict(sizes)
            for name in {name for sizes in ranks.values() for name in sizes}:
                largest = max(int(sizes[name]) for sizes in ranks.values() if name in sizes)
                self._reason(self._table_entries, engine_idx, name).set(largest)


def build_kv_connector_stats(data: dict[str, Any] | None) -> Kvp2pStats | None:
    """For the connector's ``build_kv_connector_stats`` classmethod."""
    return Kvp2pStats.from_data(data)


def build_prom_metrics(
    vllm_config: VllmConfig,
    metric_types: dict[type[PromMetric], type[PromMetricT]],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> Kvp2pPromMetrics:
    """For the connector's ``build_prom_metrics`` classmethod (needed under MultiConnector, see the docstring)."""
    return Kvp2pPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = [
    "Kvp2pPromMetrics",
    "Kvp2pStats",
    "build_kv_connector_stats",
    "build_prom_metrics",
]
