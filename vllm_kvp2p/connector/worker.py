"""Worker-side adapter: KV memory registration, and the glue between vLLM's per-step worker calls and the
P-side :class:`HoldService` / D-side :class:`PullLoop`.

Runs in every vLLM worker process. It translates torch tensors into plain geometry once (at registration) and
never touches torch on the request path, except for the integrity digest (vllm_kvp2p/transfer/digest.py sums KV
bytes where they live) and the test-only corruption hook.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from vllm_kvp2p.connector.compat import data_parallel_index, gather_over_engine, node_ip, transfer_group_ids
from vllm_kvp2p.connector.metadata import KVP2PMetadata, KVP2PWorkerMetadata, PullReport
from vllm_kvp2p.connector.metrics import Kvp2pStats
from vllm_kvp2p.connector.step_wakeup import StepNotifier
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.config import KVP2PConfig
from vllm_kvp2p.contract.identity import incarnation, model_fingerprint
from vllm_kvp2p.contract.protocol import PROTOCOL_VERSION, RankRegistration, RankTable
from vllm_kvp2p.decode.pull_loop import PullLoop
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.integrity import IntegrityMode, Verification
from vllm_kvp2p.lifecycle.pull import LocalKV, PullResult
from vllm_kvp2p.lifecycle.rank_table import table_of
from vllm_kvp2p.log import get_logger
from vllm_kvp2p.platform import KVPlatform
from vllm_kvp2p.platform.base import KVArenaLike
from vllm_kvp2p.prefill.hold_service import HoldService
from vllm_kvp2p.transfer.engine import MooncakeEngine
from vllm_kvp2p.transfer.kv_groups import STATE, common_block_size, groups_from_vllm, layer_groups_from_vllm
from vllm_kvp2p.transfer.layout import AttentionInterior, TensorView, coalesce_regions, kv_geometry, planes_of
from vllm_kvp2p.transfer.slicing import BlockShape

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_kvp2p.transfer.digest import KVMemory

logger = get_logger(__name__)


def _tensors_of(entry: Any) -> list[torch.Tensor]:
    return list(entry) if isinstance(entry, (tuple, list)) else [entry]


def _view(t: torch.Tensor) -> TensorView:
    return TensorView(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())


class WorkerSide:
    """The connector's worker half (one per rank: per TP rank of each pipeline stage)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        engine_id: str,
        config: KVP2PConfig,
        platform: KVPlatform,
        *,
        load_errors_as_blocks: bool = False,
    ) -> None:
        """``load_errors_as_blocks``: vLLM takes failed loads as block ids (0.23), so the local blocks of every
        failed pull are kept for :meth:`take_load_error_blocks` (see vllm_kvp2p/connector/compat.py)."""
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        kv_config = vllm_config.kv_transfer_config
        parallel = vllm_config.parallel_config
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.engine_id = engine_id
        self.incarnation_id = ""  # set at registration, with the engine's identity (_engine_identity)
        self.config = config
        self.platform = platform
        self.tp_size = parallel.tensor_parallel_size
        self.tp_rank = get_tensor_model_parallel_rank()
        self.pp_size = parallel.pipeline_parallel_size
        self.pp_rank = get_pp_group().rank_in_group if self.pp_size > 1 else 0
        self.rank = self.pp_rank * self.tp_size + self.tp_rank  # within the engine (side-channel port, rank table)
        self.dp_rank = data_parallel_index(parallel)
        self.block_size = vllm_config.cache_config.block_size
        self.is_producer = bool(kv_config.is_kv_producer)
        self.is_consumer = bool(kv_config.is_kv_consumer)
        # The Mooncake segment's hostname; the scheduler half advertises the same address as remote_host.
        self.advertised_host = config.advertised_host(node_ip)
        self.engine: MooncakeEngine | None = None
        self.hold_service: HoldService | None = None
        self.pull_loop: PullLoop | None = None
        self._kv_caches: dict[str, Any] = {}
        self._kv_memory: KVMemory | None = None  # the KV tensors' storages by address (the integrity digest)
        self.local: LocalKV | None = None
        self.arena: KVArenaLike | None = None
        self._reports: dict[str, PullReport] = {}
        self._load_errors_as_blocks = load_errors_as_blocks
        self._load_error_blocks: set[int] = set()
        # This worker's share of the connector's metrics (vllm_kvp2p/connector/metrics.py): pulls here, holds on P. vLLM
        # takes them from the model runner's thread (get_kv_connector_stats), as it calls get_transfer_results.
        self._stats = Kvp2pStats()
        self._stats_lock = threading.Lock()
        # Ends the scheduler's idle sleep when a pull finishes or P is released (vllm_kvp2p/connector/step_wakeup.py).
        self._step_news = StepNotifier(engine_id, self.dp_rank)

    # ------------------------------------------------------------------ start-up

    def mem_pool_context(self, size_bytes: int | None = None) -> AbstractContextManager[Any] | None:
        """vLLM allocates the whole KV cache inside this context: from one arena, registered once.

        ``size_bytes`` overrides the size derived from vLLM's own allocation (the vllm-ascend hook passes what
        vllm-ascend's allocator will ask for). One arena per worker: a second call (a platform that both calls
        the hook and is wrapped by us) gets no new arena."""
        from vllm_kvp2p.platform.arena import arena_size_for

        if not self.config.kv_arena:
            logger.info("KV arena disabled (kv_arena=false): KV tensors are registered one by one")
            return None
        if self.arena is not None:
            logger.warning("KV arena already created for this worker; not creating a second one")
            return None
        self.arena = self.platform.kv_arena(size_bytes or arena_size_for(self.kv_cache_config))
        if self.arena is None:
            logger.info("no KV arena on this platform/build: KV tensors are registered one by one")
            return None
        return self.arena.scope()

    def _regions(self, views: list[TensorView]) -> tuple[list[tuple[int, int]], str]:
        """Memory regions to register, and which path produced them (logged once)."""
        arena = self.arena
        if arena is not None and all(arena.contains(v.data_ptr, v.nbytes_span) for v in views):
            return [(arena.base, arena.size)], "one arena"
        if arena is not None:
            logger.warning("KV tensors were not allocated from the arena (vLLM did not use the hook?): they are "
                           "registered one by one; kv_arena=false (VLLM_KVP2P_KV_ARENA=0) skips the arena")
        regions = coalesce_regions(views)
        limit = self.platform.max_registered_regions
        if limit is not None and len(regions) > limit:
            raise RuntimeError(
                f"the KV cache needs {len(regions)} registered memory regions, above this platform's limit of "
                f"{limit}; allocate it from the connector's arena (get_mem_pool_context) instead"
            )
        return regions, "per-tensor (touching tensors merged)"

    def _gather_rank_table(self, incarnation_id: str, port: int) -> RankTable:
        """Where every rank of this engine listens, each as it advertises itself (its own node's address when the
        engine spans nodes): gathered over vLLM's tensor-parallel and pipeline groups, a collective of all this
        engine's ranks. Without a group (a worker built by hand), the ranks are assumed on this host at consecutive
        ports."""
        mine = (self.rank, self.advertised_host, port)
        gathered = gather_over_engine(mine)
        if gathered is None:
            base = port - self.rank
            gathered = [(r, self.advertised_host, base + r) for r in range(self.tp_size * self.pp_size)]
        table = table_of(self.engine_id, incarnation_id, {int(r): (str(h), int(p)) for r, h, p in gathered})
        if self.rank == 0 and len(table.ranks) > 1:
            logger.info("rank table of engine %s: %s", self.engine_id,
                        ", ".join(f"rank {e.rank} at {e.host}:{e.port}" for e in table.ranks))
        return table

    def _engine_identity(self) -> tuple[str, str]:
        """This engine's id and incarnation as rank 0 has them. Each node of a multi-node engine builds its own
        VllmConfig (its own random ``engine_id`` and ``instance_id``); the scheduler, on the head node with rank
        0, names rank 0's in the params, so every rank registers under those (a collective over the engine's TP
        and PP groups)."""
        mine = (self.engine_id, incarnation(self.vllm_config, self.engine_id))
        gathered = gather_over_engine(mine)
        return (str(gathered[0][0]), str(gathered[0][1])) if gathered else mine

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._kv_caches = kv_caches
        self.engine_id, self.incarnation_id = self._engine_identity()
        model = self.vllm_config.model_config
        self.model_fingerprint = model_fingerprint(self.vllm_config)
        group_ids = transfer_group_ids(self.kv_cache_config)
        groups = groups_from_vllm(self.kv_cache_config, group_ids)
        group_of_layer = layer_groups_from_vllm(self.kv_cache_config, group_ids)
        # Only transferred layers; with HMA, layers of different groups share memory (one tensor per position).
        names = [n for n in kv_caches if n in group_of_layer]
        layers = [(name, [_view(t) for t in _tensors_of(kv_caches[name])]) for name in names]
        num_blocks = self.kv_cache_config.num_blocks
        use_mla = bool(model.use_mla)
        local_heads = 1 if use_mla else model.get_num_kv_heads(self.vllm_config.parallel_config)
        self.block_size = common_block_size(groups, self.block_size)
        planes, shapes, plane_groups, plane_layers = [], [], [], []
        for index, (name, views) in enumerate(layers):
            group = groups[group_of_layer[name]]
            if group.kind == STATE:
                # A state page (vLLM hands it over raw, as bytes): moved whole, never sliced by head or token.
                layer_planes = [p for i, v in enumerate(views) for p in planes_of(v, num_blocks, f"{name}[{i}]")]
                layer_shapes = [BlockShape(False, 1, 1, p.block_bytes) for p in layer_planes]
            else:
                if use_mla:  # one latent row per token, whatever the platform's attention kernel does
                    interior, layouts = AttentionInterior.LATENT_ROWS, ()
                else:
                    interior = self.platform.attention_interior
                    layouts = self.platform.attention_part_layouts(model.dtype, group.block_size,
                                                                   model.get_head_size(),
                                                                   self.vllm_config.cache_config.cache_dtype)
                layer_planes, layer_shapes = kv_geometry(
                    [(name, views)], num_blocks, group.block_size, local_heads, head_size=model.get_head_size(),
                    interior=interior, part_layouts=layouts,
                )
            planes += layer_planes
            shapes += layer_shapes
            plane_groups += [group_of_layer[name]] * len(layer_planes)
            plane_layers += [index] * len(layer_planes)
        regions, how = self._regions([v for _, vs in layers for v in vs])
        first = _tensors_of(next(iter(kv_caches.values())))[0]
        self.local = LocalKV(
            planes=tuple(planes),
            shapes=tuple(shapes),
            block_size=self.block_size,
            layer_names=tuple(names),
            dtype=str(first.dtype).removeprefix("torch."),
            total_num_kv_heads=1 if use_mla else model.get_total_num_kv_heads(),
            use_mla=use_mla,
            groups=groups,
            plane_groups=tuple(plane_groups),
            tp_size=self.tp_size,
            model_fingerprint=self.model_fingerprint,
            plane_layers=tuple(plane_layers),
            pp_size=self.pp_size,
        )
        with self.platform.service_threads():
            self._start_services(regions, how, first, num_blocks, local_heads, model.get_head_size())

    def _start_services(
        self, regions: list[tuple[int, int]], how: str, first: torch.Tensor, num_blocks: int, local_heads: int,
        head_size: int,
    ) -> None:
        config, local = self.config, self.local
        protocol = config.protocol or self.platform.default_protocol
        self.engine = MooncakeEngine(self.advertised_host, protocol, config.device_name, config.transfer_timeout)
        self.engine.register(regions, self.platform.memory_location(first))
        logger.info(
            "rank %d: %d layers in %d KV-cache group(s) (%s), %d KV planes of %d blocks (%s), registered as %d "
            "region(s) (%s)",
            self.rank, len(local.layer_names), len(local.kv_groups()),
            ", ".join(g.describe() for g in local.kv_groups()), len(local.planes), num_blocks,
            "head-major" if local.shapes[0].head_major else "token-major", len(regions), how,
        )
        # What a pull moves per block of each group (tests and operators read the real geometry here: vLLM may
        # raise a hybrid model's block size, and its state pages depend on the CPU's kernels).
        logger.info("rank %d KV geometry: %s", self.rank, "; ".join(
            f"group {g} {group.describe()}: block {group.block_size} tokens, "
            f"{sum(p.block_bytes for p, pg in zip(local.planes, local.group_of_planes()) if pg == g)} B per block"
            for g, group in enumerate(local.kv_groups())))
        registration = RankRegistration(
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            segment=self.engine.segment,
            planes=list(local.planes),
            block_shapes=list(local.shapes),
            layer_names=list(local.layer_names),
            block_size=self.block_size,
            num_blocks=num_blocks,
            dtype=local.dtype,
            num_kv_heads=local_heads,
            total_num_kv_heads=local.total_num_kv_heads,
            head_size=head_size,
            use_mla=local.use_mla,
            groups=list(local.groups),
            plane_groups=list(local.plane_groups),
            incarnation=self.incarnation_id,
            model_fingerprint=self.model_fingerprint,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            plane_layers=list(local.plane_layers),
        )
        auth = Authenticator(config.secret, config.clock_skew) if config.secret else None
        # The integrity digest reads the KV where it lives (vllm_kvp2p/transfer/digest.py): P answers D's questions
        # over its held blocks, D sums its copies.
        from vllm_kvp2p.transfer.digest import KVMemory, sums_of_units

        memory = self._kv_memory = KVMemory([t for entry in self._kv_caches.values() for t in _tensors_of(entry)])
        side_channel = "none (consumer only: D contacts P's)"
        if self.is_producer:
            port = config.side_channel_port_for(self.dp_rank, self.tp_size * self.pp_size, self.rank)
            bind_host = config.side_channel_bind_host(self.advertised_host)
            side_channel = f"binds {bind_host}:{port}, advertised as {self.advertised_host}:{port}"
            logger.info("rank %d: side channel binds %s:%d, advertised as %s", self.rank, bind_host, port,
                        self.advertised_host)
            self.hold_service = HoldService(
                registration, bind_host, port,
                hold_timeout=config.hold_timeout, lease_timeout=config.lease_timeout, auth=auth,
                clock_skew=config.clock_skew, on_release=self._step_news.notify,
                digester=functools.partial(sums_of_units, memory, registration.planes),
            )
            self.hold_service.rank_table = self._gather_rank_table(registration.incarnation, port)
        logger.info(
            "rank %d (dp %d) up as %s: Mooncake %s segment %s, %d MiB in %d region(s) (%s); side channel %s; %s; "
            "protocol v%d; settings: %s",
            self.rank, self.dp_rank, "/".join(r for r, on in (("producer", self.is_producer),
                                                                   ("consumer", self.is_consumer)) if on),
            protocol, self.engine.segment, sum(size for _, size in regions) >> 20, len(regions), how,
            side_channel, "authenticated" if auth is not None else "unauthenticated",
            PROTOCOL_VERSION, config.describe(),
        )
        if self.is_consumer:
            self.pull_loop = PullLoop(
                self.engine,
                reader=f"{self.engine_id}:{self.rank}",
                tp_size=self.tp_size,
                tp_rank=self.tp_rank,
                local=local,
                side_channel_timeout=config.side_channel_timeout,
                pull_timeout=config.pull_timeout,
                suspect_time=config.suspect_time,
                auth=auth,
                claim_wait=config.claim_wait,
                max_batch_entries=config.max_batch_entries,
                max_threads=config.pull_threads,
                after_pull=self._corrupt if config.test_hooks else None,
                before_verify=self._corrupt_in_flight if config.test_hooks else None,
                on_result=self._step_news.notify,
                integrity=IntegrityMode(config.integrity),
                sampled_units=config.integrity_sampled_units,
                sampled_pulls=config.integrity_sampled_pulls,
                memory=memory,
                peer_ports=config.peer_port_ranges(),
            )

    # ------------------------------------------------------------------ per step

    def start_load_kv(self, metadata: KVP2PMetadata) -> None:
        if self.hold_service is not None:
            for order in metadata.holds:
                self.hold_service.hold(order.request_id, order.hold_id, order.num_blocks, order.offered, order.mac)
        if self.pull_loop is not None:
            for plan in metadata.pulls:
                self.pull_loop.submit(plan)

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        sending = self.hold_service.take_freed() if self.hold_service is not None else set()
        recving: set[str] = set()
        failed: set[str] = set()
        if self.pull_loop is not None:
            for timed in self.pull_loop.take_results():
                r = timed.result
                if r.failure is None and r.num_blocks:
                    with self._stats_lock:
                        self._stats.record_pull(timed.seconds, r.num_bytes, r.num_descriptors, timed.claim_seconds)
                        if r.integrity:
                            self._stats.record_integrity(r.integrity)
                if not r.report_finished:
                    continue
                recving.add(r.request_id)
                if r.report_failed:
                    failed.add(r.request_id)
                    if self._load_errors_as_blocks:
                        self._load_error_blocks.update(r.local_block_ids)  # of every group
                self._reports[r.request_id] = PullReport(
                    not r.report_failed, r.num_blocks, r.num_bytes, r.num_descriptors, timed.seconds, r.reason,
                    r.failure.value if r.failure is not None else "", r.verified_units, r.unverified,
                    r.sums_lost,
                )
        if recving and logger.isEnabledFor(logging.DEBUG):
            logger.debug("rank %d reports the receives of %s to the scheduler", self.rank, sorted(recving))
        return sending, recving, failed

    def get_kv_connector_stats(self) -> Kvp2pStats:
        """The metrics since the last call, every call (also empty: on vLLM 0.23 a worker's stats object is what
        carries the scheduler's to the logger); P's gauges and both sides' table sizes are read now, after this
        step's transfer results (so the step that frees the last hold reports its tables empty)."""
        with self._stats_lock:
            self._stats.set_tables(f"{self.dp_rank}.{self.rank}", self.table_sizes())
            if self.hold_service is not None:
                tally, dropped, blocks_held, oldest = self.hold_service.take_metrics()
                self._stats.record_holds(tally.get("created", 0), tally.get("released", 0), tally.get("expired", 0),
                                         tally.get("claims_refused", 0), tally.get("abandoned", 0))
                for reason, n in dropped.items():
                    self._stats.record_dropped(reason, n)
                self._stats.set_gauges(f"{self.dp_rank}.{self.rank}", blocks_held, oldest)
            return self._stats.clone_and_reset()

    def take_load_error_blocks(self) -> set[int]:
        """Local block ids of the pulls that failed since the last call (only when vLLM wants failures so)."""
        blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def build_worker_meta(self) -> KVP2PWorkerMetadata | None:
        if not self._reports:
            return None
        reports, self._reports = self._reports, {}
        return KVP2PWorkerMetadata(reports)

    # ------------------------------------------------------------------ test hook

    def _corrupt_in_flight(self, plan: PullPlan, verification: Verification) -> None:
        """Change one byte of what a pull just read, before its integrity check (test hook): what a faulty link or
        NIC does to a transfer that reports success. The byte: the first of the last unit the check covers."""
        if not plan.test_corrupt_in_flight or not verification.local_runs:
            return
        addr = verification.local_runs[-1].addr
        assert self._kv_memory is not None  # made before the pull loop that calls this
        self._kv_memory.flip_byte(addr, 0x40)
        logger.warning("TEST HOOK: changed the byte at %#x of %s before its integrity check", addr, plan.request_id)

    def _corrupt(self, plan: PullPlan, result: PullResult) -> None:
        """Overwrite freshly pulled blocks with noise (test hook): proves that output checks can fail."""
        if not plan.test_corrupt or plan.test_corrupt_in_flight:
            return
        import torch

        ids = torch.tensor(list(result.local_block_ids), dtype=torch.long)
        num_blocks = self.kv_cache_config.num_blocks
        for name, entry in self._kv_caches.items():
            if plan.test_corrupt_layer and name != plan.test_corrupt_layer:
                continue
            for t in _tensors_of(entry):
                dim = list(t.shape).index(num_blocks)
                noise = torch.randn(t.index_select(dim, ids).shape, dtype=torch.float32).to(t.dtype)
                t.index_copy_(dim, ids, noise * 4)
        logger.warning("TEST HOOK: corrupted %d pulled blocks of %s (%s)", len(ids), result.request_id,
                       plan.test_corrupt_layer or "every layer")

    def table_sizes(self) -> dict[str, int]:
        """P's ledger and D's pull tables (whichever this worker has), e.g. ``{"holds": 0, "suspects": 0}``."""
        sizes: dict[str, int] = {}
        if self.hold_service is not None:
            sizes.update(self.hold_service.table_sizes())
        if self.pull_loop is not None:
            sizes.update(self.pull_loop.table_sizes())
        return sizes

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Pulls stop and release P, the hold service stops, then memory is unregistered: never under a read."""
        logger.info("rank %d shutting down; connector tables: %s", self.rank, self.table_sizes())
        reads_done = True
        if self.pull_loop is not None:
            try:
                reads_done = self.pull_loop.close(read_timeout=self.config.transfer_timeout)
            except Exception:  # shutdown must finish whatever one part does
                logger.exception("error while stopping the pull threads")
                reads_done = False
        engine = self.engine
        if not reads_done:
            logger.error("KV memory stays registered with Mooncake until the process exits: a read may still be "
                         "writing into it")
            engine = None
        for closer in _closers(self.hold_service, engine):
            try:
                closer()
            except Exception:  # shutdown must finish whatever one part does
                logger.exception("error while shutting down the KV connector worker")
        self.pull_loop = self.hold_service = self.engine = None
        self._step_news.close()


def _closers(*parts: Any) -> Iterable[Any]:
    return [p.close for p in parts if p is not None]
