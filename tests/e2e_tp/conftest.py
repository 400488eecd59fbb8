"""One real P/D deployment with unequal layouts per test session: a prefill ``vllm serve`` at
``--tensor-parallel-size 2`` (kv_producer, one worker process per rank, each pinned to its own core), a decode
``vllm serve`` at ``--pipeline-parallel-size 2`` x TP 1 (kv_consumer, failed loads recomputed; a pipeline stage per
core) and the proxy console script, all on 127.0.0.1. Each D stage reads its own layers from both P ranks.

What vLLM's CPU backend needs for TP 2 on this kind of machine (2 cores, 1 NUMA node), measured:

* ``VLLM_CPU_OMP_THREADS_BIND="0|1"``: one CPU list per rank. vLLM's default ("auto") fails with "Not enough
  allowed NUMA nodes to bind threads of 2 local CPUWorkers"; a single list ("0" or "0-1") fails with "Given number
  of CPU id list [...] doesn't match local world size 2". ``"nobind"`` and ``"0|0"`` also start.
* ``--distributed-executor-backend mp`` is vLLM's default for TP on one node; it is passed anyway, explicitly.

Each P rank runs its own connector worker and KV hold service on side-channel port base + rank, so the base port is
chosen with base + 1 free as well.

CPU budget: while P holds a finished prompt's blocks for D, vLLM keeps stepping P's engine (the scheduler still
has requests until the connector reports them sent). At TP 1 that costs one busy worker; at TP 2 on 2 cores every
empty step is a broadcast to both ranks plus collectives, and the whole host crawls: with P alone and one request
held, P's side channel answered in 2-5 s instead of ~10 ms and an unrelated ``time.sleep(0.2)`` took up to 9 s.
D then claims late (hold expired) or its Mooncake reads time out. Two settings of the connector fix that
(both on by default on CPU): ``idle_step_sleep`` spaces the empty steps, and ``worker_busy_poll`` stops vLLM's
worker and engine-core processes from spinning 1 s after each step message (with both, every pull here took
~10 ms; with only the first, side-channel round trips still took up to 64 s and most pulls failed).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.ci_mode import lacks
from vllm_kvp2p.testing.cluster import ProxyProcess, kv_transfer_config
from vllm_kvp2p.testing.server import PIPELINE_STAGE_ARGS, VllmServer, free_port, free_port_run
from vllm_kvp2p.testing.tiny_model import make_tiny_llama


def _usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


@dataclass
class TPCluster:
    """P at ``prefill_tp`` (one core per rank), D at ``decode_tp``, proxy in front. Same attributes as
    :class:`vllm_kvp2p.testing.cluster.PDCluster` (``prefill``, ``decode``, ``proxy_url``), so the helpers in
    ``tests.e2e.helpers`` work with it."""

    model_path: Path
    log_dir: Path
    prefill_tp: int = 2
    decode_tp: int = 1
    decode_pp: int = 1
    prefill_cpus: str = "0|1"  # VLLM_CPU_OMP_THREADS_BIND: one CPU list per rank, "|"-separated
    decode_cpus: str = "1"
    prefill_env: Mapping[str, str] = field(default_factory=dict)
    decode_env: Mapping[str, str] = field(default_factory=dict)
    decode_extra_config: Mapping[str, object] = field(default_factory=dict)
    decode_failure_policy: str = "recompute"
    ready_timeout: float = 400.0

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.side_channel_port = free_port_run(self.prefill_tp)  # P rank r listens on this + r
        common = {"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
        self.prefill = VllmServer(
            self.model_path, free_port(), cpus=self.prefill_cpus, log_path=self.log_dir / "prefill.log",
            extra_args=("--kv-transfer-config", kv_transfer_config("kv_producer"),
                        *_tp_args(self.prefill_tp)),
            env={**common, "VLLM_KVP2P_SIDE_CHANNEL_PORT": str(self.side_channel_port), **self.prefill_env},
            ready_timeout=self.ready_timeout,
        )
        self.decode = VllmServer(
            self.model_path, free_port(), cpus=self.decode_cpus, log_path=self.log_dir / "decode.log",
            extra_args=("--kv-transfer-config",
                        kv_transfer_config("kv_consumer", self.decode_failure_policy, **self.decode_extra_config),
                        *_tp_args(self.decode_tp), *_pp_args(self.decode_pp)),
            env={**common, **self.decode_env, **({"TORCH_COMPILE_DISABLE": None} if self.decode_pp > 1 else {})},
            ready_timeout=self.ready_timeout,
        )
        self.proxy: ProxyProcess | None = None

    @property
    def proxy_url(self) -> str:
        assert self.proxy is not None, "cluster not started"
        return self.proxy.url

    def start(self) -> TPCluster:
        try:
            self.prefill.start()
            self.decode.start()  # both engines boot in parallel
            self.prefill.wait_ready()
            self.decode.wait_ready()
            self.proxy = ProxyProcess.start([self.prefill.url], [self.decode.url], self.log_dir / "proxy.log")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.decode.stop()
        self.prefill.stop()

    def __enter__(self) -> TPCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tp_args(tp: int) -> tuple[str, ...]:
    if tp == 1:
        return ()
    return ("--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp")


def _pp_args(pp: int) -> tuple[str, ...]:
    return () if pp == 1 else ("--pipeline-parallel-size", str(pp), *PIPELINE_STAGE_ARGS)


@pytest.fixture(scope="session")
def tp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="package")  # stopped once this package is done: engines of other packages get the cores
def tp_cluster(tp_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPCluster]:
    cpus = _usable_cpus()
    if len(cpus) < 2:
        lacks(f"P at --tensor-parallel-size 2 needs one core per rank; this process may use only {cpus}")
    with TPCluster(
        tp_model_dir,
        tmp_path_factory.mktemp("tp-logs"),
        prefill_cpus=f"{cpus[0]}|{cpus[1]}",
        decode_pp=2,
        decode_cpus=f"{cpus[0]}|{cpus[1]}",  # one core per stage
        # Four workers on two cores: one CI run saw a 6-entry read of P rank 0 take over 5 s (every pull before
        # and after it took milliseconds), so reads get 20 s here; no test in this package is about a timeout.
        prefill_env={"VLLM_KVP2P_HOLD_TIMEOUT": "60", "VLLM_KVP2P_TRANSFER_TIMEOUT": "20"},
        decode_env={"VLLM_KVP2P_TRANSFER_TIMEOUT": "20", "VLLM_KVP2P_CLAIM_WAIT": "5"},
        decode_extra_config={"integrity": "full", "test_hooks": True},  # the corruption tests' hooks
    ) as cluster:
        yield cluster
