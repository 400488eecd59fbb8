"""vllm_kvp2p.connector.metrics against vLLM's real classes: KVConnectorStats semantics,
the wire (pickle from the workers,
msgspec to the API server), KVConnectorLogging's log line, KVConnectorProm on a fresh registry, MultiConnector.

No engine: the connectors are stand-ins whose stats classmethods forward to the module functions, as the real
connector's do. vLLM's scheduler needs an engine, so its two stats lines are copied here (see scheduler_payload).
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.utils import floatToGoString
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
    KVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_kvp2p.connector import metrics
from vllm_kvp2p.connector.metrics import Kvp2pPromMetrics, Kvp2pStats, build_kv_connector_stats, build_prom_metrics

# vLLM 0.32 ships to_dict() and merges scheduler-side stats on every step; 0.23 ships .data, merges them only on
# steps where a worker returned stats.
VLLM_TO_DICT = hasattr(KVConnectorStats, "to_dict")
MIB = 2**20
ENGINE = {"model_name": "m", "engine": "0"}


# --------------------------------------------------------------------------- stand-in connectors


class _StandIn(KVConnectorBase_V1):
    """Engine-free connector: ``get_kv_connector_stats`` hands out what a test recorded in ``self.stats``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.stats = Kvp2pStats()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.stats.clone_and_reset()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...
    def wait_for_save(self) -> None: ...
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None: ...
    def build_connector_meta(self, scheduler_output: Any) -> Any: ...


class Kvp2pStandIn(_StandIn):
    """What MooncakeP2PConnector's classmethods do: forward to vllm_kvp2p.connector.metrics."""

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Kvp2pPromMetrics:
        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class NoPromStandIn(_StandIn):
    """Sends stats but builds no Prometheus metrics (vLLM's default build_prom_metrics returns None)."""

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return build_kv_connector_stats(data)


class SilentStandIn(_StandIn):
    """Neither stats nor metrics, like most connectors."""

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None


def config(name: str, **extra: Any) -> VllmConfig:
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector=name, kv_role="kv_both", kv_connector_module_path=__name__, **extra
        )
    )


def multi_config(*names: str) -> VllmConfig:
    subs = [{"kv_connector": n, "kv_connector_module_path": __name__, "kv_role": "kv_both"} for n in names]
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={"connectors": subs}
        )
    )


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    # MultiConnector rebuilds a sub-connector's stats from a dict by class name in the factory's registry
    # (our plugin registers MooncakeP2PConnector under its class name).
    for cls in (Kvp2pStandIn, NoPromStandIn, SilentStandIn):
        monkeypatch.setitem(KVConnectorFactory._registry, cls.__name__, lambda cls=cls: cls)


def fresh_prom(vllm_config: VllmConfig, registry: CollectorRegistry, engines: tuple[int, ...] = (0,)) -> Any:
    """vLLM's KVConnectorProm with metric classes bound to ``registry``, the way RayKVConnectorProm swaps them."""

    def bound(base: type) -> type:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs["registry"] = registry
            base.__init__(self, *args, **kwargs)

        return type(base.__name__, (base,), {"__init__": __init__})

    prom_cls = type(
        "FreshKVConnectorProm",
        (KVConnectorProm,),
        {"_gauge_cls": bound(Gauge), "_counter_cls": bound(Counter), "_histogram_cls": bound(Histogram)},
    )
    return prom_cls(vllm_config, ["model_name", "engine"], {i: ["m", str(i)] for i in engines})


# --------------------------------------------------------------------------- vLLM's transport


def worker_step(*per_rank: KVConnectorStats | None) -> KVConnectorStats | None:
    """Each TP rank's KVConnectorOutput, pickled to the engine core (MultiprocExecutor's queue pickles), folded by
    vLLM's KVOutputAggregator."""
    outputs = []
    for stats in per_rank:
        out = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
        out.kv_connector_output = KVConnectorOutput(kv_connector_stats=stats)
        outputs.append(pickle.loads(pickle.dumps(out)))
    merged = KVOutputAggregator(len(outputs)).aggregate(outputs, output_rank=0)
    return merged.kv_connector_output.kv_connector_stats


def scheduler_payload(worker: KVConnectorStats | None, scheduler: KVConnectorStats | None) -> dict[str, Any] | None:
    """Scheduler.update_from_output's merge and make_stats' payload, copied from each version."""
    if VLLM_TO_DICT:  # 0.32 scheduler.py:2337-2351, 2937-2939
        stats = worker
        if scheduler is not None and not scheduler.is_empty():
            stats = stats.aggregate(scheduler) if stats is not None else scheduler
        return stats.to_dict() if stats else None
    stats = worker  # 0.23 scheduler.py:1349-1355, 2044-2046
    if stats and scheduler:
        stats = stats.aggregate(scheduler)
    return stats.data if stats else None


def wire(payload: dict[str, Any] | None) -> dict[str, Any] | None:
    """Engine core -> API server: EngineCoreOutputs through vLLM's msgspec encoder and decoder."""
    frame = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=payload)))
    return MsgpackDecoder(EngineCoreOutputs).decode(frame).scheduler_stats.kv_connector_stats


def log_lines(logging: KVConnectorLogging) -> list[str]:
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    return lines


def d_stats() -> Kvp2pStats:
    s = Kvp2pStats()
    s.record_pull(0.1, 4 * MIB, 8, 0.002)
    s.record_pull(0.3, 12 * MIB, 24, None)
    s.record_failure("timeout")
    return s


# --------------------------------------------------------------------------- Kvp2pStats semantics


def test_reduce_summarizes_pulls_and_failures() -> None:
    s = d_stats()
    s.record_failure("timeout")
    s.record_failure("read_failed")
    r = s.reduce()
    assert r["Pulls"] == 2
    assert r["Avg pull (ms)"] == pytest.approx(200.0)
    assert r["P90 pull (ms)"] == pytest.approx(np.percentile([0.1, 0.3], 90) * 1e3)
    assert r["MB pulled"] == pytest.approx(16.0)
    assert r["Throughput (GB/s)"] == pytest.approx(round(16 * MIB / 0.4 / 1e9, 3))
    assert r["Avg descriptors"] == 16.0
    assert r["Avg claim RTT (ms)"] == pytest.approx(2.0)
    assert (r["Failures"], r["Failures timeout"], r["Failures read_failed"]) == (3, 2, 1)
    assert "Holds created" not in r  # D saw no P-side event: its line carries no P fields


def test_empty_reset_and_truthiness() -> None:
    s = Kvp2pStats()
    assert s.is_empty() and bool(s)  # vLLM's `if kv_connector_stats` means "not None": an empty one stays truthy
    s.set_gauges("0", blocks_held=5, oldest_hold_age=1.0)
    assert s.is_empty() and s.has_gauges()  # gauges alone: no log line on an idle P
    s.record_holds(created=1)
    assert not s.is_empty()
    s.reset()
    assert s.is_empty() and not s.has_gauges()
    for record in (lambda: s.record_failure("refused"), lambda: s.record_dropped("undecodable", 1)):
        s.reset()
        record()
        assert not s.is_empty()  # a failure-only interval is still logged
    s.record_dropped("x", 0)
    old = s.clone_and_reset()
    assert not old.is_empty() and s.is_empty() and old.data is not s.data
    assert build_kv_connector_stats(None) is None and build_kv_connector_stats({}) is None


def test_aggregate_sums_ranks_and_keeps_latest_per_rank_across_intervals() -> None:
    rank0, rank1 = Kvp2pStats(), Kvp2pStats()
    rank0.record_holds(created=3, released=1)
    rank0.set_gauges("0", blocks_held=10, oldest_hold_age=2.0)
    rank1.record_holds(created=3, expired=1, claims_refused=2)
    rank1.set_gauges("1", blocks_held=12, oldest_hold_age=5.0)
    rank1_before = copy.deepcopy(rank1.data)
    step1 = rank0.aggregate(rank1)
    assert rank1.data == rank1_before  # the other side is read, never changed
    r = step1.reduce()
    assert (r["Holds created"], r["Holds released"], r["Holds expired"], r["Claims refused"]) == (6, 1, 1, 2)
    assert r["Blocks held"] == 22 and r["Oldest hold age (s)"] == 5.0  # sum over ranks, max age
    assert "Pulls" not in r

    later = Kvp2pStats()
    later.set_gauges("0", blocks_held=4, oldest_hold_age=0.5)  # a later interval: rank 0 only
    r = step1.aggregate(later).reduce()
    assert r["Blocks held"] == 16  # rank 0's latest (4) + rank 1's last known (12), not 10 + 4 + 12
    assert r["Holds created"] == 6

    pulls = d_stats().aggregate(d_stats())
    assert pulls.data["pull_seconds"] == [0.1, 0.3, 0.1, 0.3] and pulls.data["failures"] == {"timeout": 2}


def test_tables_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Kvp2pStats()
    for i in range(metrics.MAX_REASONS + 5):
        s.record_failure(f"kind{i}")
    assert len(s.data["failures"]) == metrics.MAX_REASONS + 1 and s.data["failures"]["other"] == 5
    monkeypatch.setattr(metrics, "MAX_SAMPLES", 3)
    a, b = Kvp2pStats(), Kvp2pStats()
    for _ in range(2):
        a.record_pull(0.1, 1, 1, None)
        b.record_pull(0.2, 2, 2, None)
    a.aggregate(b)
    a.record_pull(0.3, 3, 3, None)
    assert a.data["pull_seconds"] == [0.1, 0.1, 0.2] and a.reduce()["Pulls"] == 5


def test_payload_survives_pickle_and_msgspec() -> None:
    s = d_stats()
    s.record_holds(created=2, claims_refused=1)
    s.record_dropped("unauthenticated", 3)
    s.set_gauges("0", blocks_held=7, oldest_hold_age=1.25)
    expected = copy.deepcopy(s.data)
    out = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
    out.kv_connector_output = KVConnectorOutput(kv_connector_stats=s)
    unpickled = pickle.loads(pickle.dumps(out)).kv_connector_output.kv_connector_stats
    assert isinstance(unpickled, Kvp2pStats) and unpickled.data == expected
    decoded = wire(s.data)
    assert decoded == expected and type(decoded["pull_bytes"][0]) is int and type(decoded["pull_seconds"][0]) is float
    assert build_kv_connector_stats(decoded).data == expected
    assert pickle.loads(pickle.dumps(expected)) == expected


# --------------------------------------------------------------------------- vLLM's logger and Prometheus


def test_d_stats_reach_vllm_log_line_through_workers_scheduler_and_wire() -> None:
    vllm_config = config("Kvp2pStandIn")
    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    rank0, rank1 = Kvp2pStats(), Kvp2pStats()
    rank0.record_pull(0.1, 4 * MIB, 8, 0.002)
    rank1.record_pull(0.3, 4 * MIB, 8, 0.004)
    on_scheduler = Kvp2pStats()
    on_scheduler.record_failure("invalid_params")  # found by D's scheduler on checking kv_transfer_params
    logging.observe(wire(scheduler_payload(worker_step(rank0, rank1), on_scheduler)))
    step2 = Kvp2pStats()
    step2.record_failure("timeout")
    logging.observe(wire(scheduler_payload(worker_step(step2, Kvp2pStats()), None)))
    (line,) = log_lines(logging)
    assert line.startswith("KV Transfer metrics: Pulls=2, Avg pull (ms)=200.0, P90 pull (ms)=280.0, MB pulled=8.0")
    assert "Failures=2" in line and "Failures invalid_params=1" in line and "Failures timeout=1" in line
    assert log_lines(logging) == []  # logged once, then reset


def test_p_gauges_alone_do_not_log_but_show_on_the_next_line() -> None:
    logging = KVConnectorLogging(config("Kvp2pStandIn").kv_transfer_config)
    for age in (1.0, 2.0):
        rank0, rank1 = Kvp2pStats(), Kvp2pStats()
        rank0.set_gauges("0", blocks_held=10, oldest_hold_age=age)
        rank1.set_gauges("1", blocks_held=10, oldest_hold_age=age + 1)
        logging.observe(wire(scheduler_payload(worker_step(rank0, rank1), None)))
        assert log_lines(logging) == []
    rank0 = Kvp2pStats()
    rank0.record_holds(released=1)
    rank0.set_gauges("0", blocks_held=9, oldest_hold_age=0.1)
    logging.observe(wire(scheduler_payload(worker_step(rank0, None), None)))
    (line,) = log_lines(logging)
    assert "Holds released=1" in line and "Blocks held=19" in line and "Oldest hold age (s)=3.0" in line


def test_prometheus_names_labels_and_values() -> None:
    registry = CollectorRegistry()
    prom = fresh_prom(config("Kvp2pStandIn"), registry, engines=(0, 1))
    s = d_stats()
    s.record_holds(created=2, released=1, expired=1, claims_refused=1, abandoned=1)
    s.record_dropped("undecodable", 2)
    for outcome in ("verified", "verified", "unverified", "sums_lost"):
        s.record_integrity(outcome)
    s.set_gauges("0", blocks_held=10, oldest_hold_age=1.5)
    s.set_gauges("1", blocks_held=11, oldest_hold_age=2.5)
    prom.observe(wire(s.data), engine_idx=1)

    def value(name: str, engine: str = "1", **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": engine, **labels})

    names = {m.name for m in registry.collect()}
    assert names == {
        "vllm:kvp2p_pull_seconds", "vllm:kvp2p_pull_bytes", "vllm:kvp2p_pull_descriptors",
        "vllm:kvp2p_claim_rtt_seconds", "vllm:kvp2p_pull_failures", "vllm:kvp2p_holds_created",
        "vllm:kvp2p_holds_released", "vllm:kvp2p_holds_expired", "vllm:kvp2p_claims_refused",
        "vllm:kvp2p_side_channel_dropped", "vllm:kvp2p_blocks_held", "vllm:kvp2p_oldest_hold_age_seconds",
        "vllm:kvp2p_pulls_verified", "vllm:kvp2p_pulls_unverified", "vllm:kvp2p_pulls_sums_lost",
        "vllm:kvp2p_holds_abandoned", "vllm:kvp2p_table_entries",
    }  # fmt: skip
    assert value("vllm:kvp2p_pull_seconds_count") == 2 and value("vllm:kvp2p_pull_seconds_sum") == pytest.approx(0.4)
    assert value("vllm:kvp2p_pull_seconds_count", engine="0") == 0  # the other engine's series is untouched
    assert value("vllm:kvp2p_pull_bytes_bucket", le=floatToGoString(4.0 * MIB)) == 1
    assert value("vllm:kvp2p_pull_bytes_bucket", le=floatToGoString(16.0 * MIB)) == 2
    assert value("vllm:kvp2p_pull_descriptors_sum") == 32 and value("vllm:kvp2p_claim_rtt_seconds_count") == 1
    assert value("vllm:kvp2p_pull_failures_total", reason="timeout") == 1
    assert value("vllm:kvp2p_pull_failures_total", reason="refused") == 0  # known reasons exported from the start
    assert value("vllm:kvp2p_side_channel_dropped_total", reason="undecodable") == 2
    assert [value(f"vllm:kvp2p_{n}_total") for n in ("holds_created", "holds_released", "holds_expired")] == [2, 1, 1]
    assert value("vllm:kvp2p_claims_refused_total") == 1 and value("vllm:kvp2p_holds_abandoned_total") == 1
    assert value("vllm:kvp2p_pulls_verified_total") == 2 and value("vllm:kvp2p_pulls_unverified_total") == 1
    assert value("vllm:kvp2p_pulls_sums_lost_total") == 1  # its own counter, not folded into unverified
    assert value("vllm:kvp2p_pull_failures_total", reason="corrupted") == 0  # a mismatch is a failure of its kind
    assert (value("vllm:kvp2p_blocks_held"), value("vllm:kvp2p_oldest_hold_age_seconds")) == (21, 2.5)
    # Metrics went where vLLM's metric_types pointed, not to prometheus_client's default registry.
    assert REGISTRY.get_sample_value("vllm:kvp2p_pull_seconds_count", {"model_name": "m", "engine": "1"}) is None

    later = Kvp2pStats()
    later.record_failure("timeout")
    prom.observe(wire(later.data), engine_idx=1)  # no gauges in this payload: they keep their value
    assert value("vllm:kvp2p_blocks_held") == 21 and value("vllm:kvp2p_pull_failures_total", reason="timeout") == 2
    later.set_gauges("1", blocks_held=1, oldest_hold_age=0.5)  # one rank reports: the other's last value stays
    prom.observe(wire(later.data), engine_idx=1)
    assert (value("vllm:kvp2p_blocks_held"), value("vllm:kvp2p_oldest_hold_age_seconds")) == (11, 1.5)


def test_table_entries_are_the_largest_rank_latest_per_rank_and_absent_until_reported() -> None:
    """vllm:kvp2p_table_entries{table=...}: each rank's WorkerSide.table_sizes through pickle, vLLM's TP
    aggregator, the scheduler's merge and msgspec; the max over ranks (each rank has its own entry for one hold), a
    rank's later value replaces its earlier one, and a table no rank reported has no series (absent is not 0)."""
    registry = CollectorRegistry()
    prom = fresh_prom(config("Kvp2pStandIn"), registry)

    def table(name: str) -> float | None:
        return registry.get_sample_value("vllm:kvp2p_table_entries", {**ENGINE, "table": name})

    assert table("holds") is None  # before any report: no sample at all
    rank0, rank1 = Kvp2pStats(), Kvp2pStats()
    rank0.set_tables("0.0", {"holds": 2, "early_releases": 0, "tombstones": 5})
    rank1.set_tables("0.1", {"holds": 3, "early_releases": 1, "tombstones": 4})
    step = worker_step(rank0, rank1)
    assert step.is_empty()  # sizes alone are not an event: no log line for an idle engine
    prom.observe(wire(scheduler_payload(step, None)), 0)
    assert (table("holds"), table("early_releases"), table("tombstones")) == (3, 1, 5)
    assert table("queued_plans") is None  # a table nobody reported (D's, on this P) stays absent

    later = Kvp2pStats()
    later.set_tables("0.1", {"holds": 0, "early_releases": 0, "tombstones": 4})  # rank 1 freed its holds
    prom.observe(wire(scheduler_payload(worker_step(later), None)), 0)
    assert (table("holds"), table("early_releases")) == (2, 0)  # rank 0's last known 2 is the largest now
    later.set_tables("0.0", {"holds": 0, "early_releases": 0, "tombstones": 5})
    prom.observe(wire(scheduler_payload(worker_step(later), None)), 0)
    assert (table("holds"), table("tombstones")) == (0, 5)
    prom.observe(wire(scheduler_payload(worker_step(Kvp2pStats()), None)), 0)  # a step without sizes: kept
    assert table("tombstones") == 5


# --------------------------------------------------------------------------- MultiConnector


def multi_step(vllm_config: VllmConfig, registry: CollectorRegistry) -> tuple[KVConnectorLogging, Any, Any]:
    """A worker-side MultiConnector whose first sub-connector recorded a pull, through the real stats path."""
    multi = MultiConnector(vllm_config, KVConnectorRole.WORKER, None)
    multi._connectors[0].stats.record_pull(0.2, 8 * MIB, 16, 0.001)
    payload = wire(scheduler_payload(worker_step(multi.get_kv_connector_stats()), None))
    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    prom = fresh_prom(vllm_config, registry)
    logging.observe(payload)
    return logging, prom, payload


@pytest.mark.usefixtures("registered")
def test_multiconnector_with_our_metrics_logs_and_exports() -> None:
    registry = CollectorRegistry()
    logging, prom, payload = multi_step(multi_config("Kvp2pStandIn", "SilentStandIn"), registry)
    prom.observe(payload, 0)
    assert registry.get_sample_value("vllm:kvp2p_pull_bytes_sum", ENGINE) == 8 * MIB
    (line,) = log_lines(logging)
    assert "Kvp2pStandIn=" in line and "'Pulls': 1" in line and "SilentStandIn" not in line


@pytest.mark.usefixtures("registered")
def test_multiconnector_crashes_on_a_sub_connector_with_stats_but_no_prom_metrics() -> None:
    # MultiKVConnectorPromMetrics.observe asserts every connector in the payload built metrics (0.32
    # multi_connector.py:128, 0.23 :121); in vLLM's API server that ends AsyncLLM's output handler.
    _, prom, payload = multi_step(multi_config("NoPromStandIn"), CollectorRegistry())
    with pytest.raises(AssertionError, match="NoPromStandIn is not contained"):
        prom.observe(payload, 0)
