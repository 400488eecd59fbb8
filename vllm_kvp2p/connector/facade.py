"""The class vLLM instantiates: ``MooncakeP2PConnector``. It only forwards, by role, to the scheduler half
(:mod:`vllm_kvp2p.connector.scheduler`) or the worker half (:mod:`vllm_kvp2p.connector.worker`). It implements the
hooks of every
supported vLLM (both ways of reporting finished transfers, both routes to the arena); which ones vLLM calls, and
what differs between versions, is :mod:`vllm_kvp2p.connector.compat`'s business."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_kvp2p.connector import compat

compat.check_vllm_supported()  # before importing vLLM's contract: an old vLLM gets the message, not an ImportError

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from vllm_kvp2p.connector import metrics  # noqa: E402
from vllm_kvp2p.connector.metadata import KVP2PMetadata  # noqa: E402
from vllm_kvp2p.connector.scheduler import SchedulerSide  # noqa: E402
from vllm_kvp2p.connector.worker import WorkerSide  # noqa: E402
from vllm_kvp2p.contract.config import KVP2PConfig  # noqa: E402
from vllm_kvp2p.log import get_logger  # noqa: E402
from vllm_kvp2p.platform import get_platform, worker_polling  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


class MooncakeP2PConnector(KVConnectorBase_V1, SupportsHMA):
    """Mooncake peer-to-peer KV connector: D pulls a prompt's KV straight out of P's memory.

    Supports vLLM's hybrid allocator (``SupportsHMA``): block ids come and go per KV-cache group
    (vllm_kvp2p/transfer/kv_groups.py)."""

    if compat.P2P_CACHE_HIT_SOURCE is not None:
        _cache_hit_source = compat.P2P_CACHE_HIT_SOURCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv_config = vllm_config.kv_transfer_config
        assert kv_config is not None and kv_config.engine_id is not None
        self.config = KVP2PConfig.from_sources(kv_config.kv_connector_extra_config)
        compat.check_vllm_supported()
        parallel = vllm_config.parallel_config
        if parallel.decode_context_parallel_size > 1:
            raise NotImplementedError(
                f"{type(self).__name__} supports tensor, pipeline and data parallelism; got "
                f"decode_context_parallel_size={parallel.decode_context_parallel_size}"
            )
        self.engine_id: str = kv_config.engine_id
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        platform = get_platform(self.config.platform)
        unsupported = platform.unsupported_setting(vllm_config)
        if unsupported:
            raise NotImplementedError(f"{type(self).__name__}: {unsupported}")
        worker_polling.apply_setting(self.config.worker_busy_poll, platform.default_worker_busy_poll)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(vllm_config, self.engine_id, self.config, kv_cache_config)
        else:
            self.worker_side = WorkerSide(
                vllm_config, kv_cache_config, self.engine_id, self.config, platform,
                load_errors_as_blocks=not compat.REPORTS_FAILED_REQUESTS,
            )
            route = compat.install_kv_allocation_route()
            logger.info("KV cache allocation route to the connector's arena: %s", route)

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        assert self.scheduler_side is not None
        return self.scheduler_side.group_ids  # computed once (vLLM 0.32's property costs ~8 us per admission)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker_side is not None
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker_side is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVP2PMetadata)
        self.worker_side.start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole-prompt pulls complete before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # P never pushes: D pulls from P's memory

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM >= 0.32: finished sends and receives, and failed receives as request ids."""
        assert self.worker_side is not None
        sending, recving, failed = self.worker_side.get_transfer_results()
        return compat.TransferResults(sending, recving, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM 0.23: the same without failures, which go to get_block_ids_with_load_errors in the same step."""
        assert self.worker_side is not None
        sending, recving, _failed = self.worker_side.get_transfer_results()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_error_blocks() if self.worker_side is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self.worker_side is not None
        return self.worker_side.build_worker_meta()

    def get_mem_pool_context(self) -> Any:
        return self.worker_side.mem_pool_context() if self.worker_side is not None else None

    def kvp2p_arena_context(self, size_bytes: int) -> Any:
        """The same scope for a worker that does not call get_mem_pool_context (vllm-ascend, see
        platform/ascend_hook.py), sized by the caller."""
        return self.worker_side.mem_pool_context(size_bytes) if self.worker_side is not None else None

    # ------------------------------------------------------------------ metrics (vllm_kvp2p/connector/metrics.py)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker_side is not None:
            return self.worker_side.get_kv_connector_stats()
        return self.scheduler_side.get_kv_connector_stats() if self.scheduler_side is not None else None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """No (vLLM >= 0.33 asks when ``--enable-sleep-mode`` is set; older releases never do): sleep frees or
        remaps the KV cache, which Mooncake has registered for peers to read, and the connector does not unregister
        and re-register it around sleep."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return metrics.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        # Always built: under vLLM's MultiConnector a connector that sends stats without Prometheus metrics
        # crashes its logger (an assert in MultiKVConnectorPromMetrics.observe).
        return metrics.build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
