"""Scheduler-side adapter: vLLM's scheduler calls <-> the D-side :class:`ConsumerSchedule` and P-side holds.

Runs in vLLM's EngineCore process. It owns no transfer state of its own: P-side it turns a finished prefill
into a hold (kept blocks + ``kv_transfer_params``), D-side it forwards admission calls to the pure
:class:`~vllm_kvp2p.lifecycle.consumer.ConsumerSchedule`, and each step it ships both to the workers.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from vllm_kvp2p.connector import compat
from vllm_kvp2p.connector.compat import data_parallel_index, node_ip, transfer_group_ids
from vllm_kvp2p.connector.lora_weights import lora_digest, see_adapter, watch_engine_loads
from vllm_kvp2p.connector.metadata import HoldOrder, KVP2PMetadata, KVP2PWorkerMetadata, PullReport
from vllm_kvp2p.connector.metrics import Kvp2pStats
from vllm_kvp2p.connector.step_wakeup import StepWaiter
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.config import KVP2PConfig
from vllm_kvp2p.contract.identity import incarnation
from vllm_kvp2p.contract.protocol import PULL_REPORT_KEY as PULL_REPORT_KEY  # re-exported: tests read D's reports by it
from vllm_kvp2p.contract.protocol import RemotePrefill, prompt_digest
from vllm_kvp2p.lifecycle.admission import Admitted, Prompt, UnboundPrompt
from vllm_kvp2p.lifecycle.consumer import ConsumerSchedule
from vllm_kvp2p.lifecycle.failure import Failure
from vllm_kvp2p.lifecycle.shared_holds import MAX_ENDED_HOLDS
from vllm_kvp2p.lifecycle.sibling_offers import SiblingOffers
from vllm_kvp2p.log import get_logger
from vllm_kvp2p.transfer.kv_groups import (
    FULL,
    UnsupportedKVCacheError,
    common_block_size,
    groups_from_vllm,
    has_state,
    load_failure_problem,
    needed_tail,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)

# Prompt digests kept for requests that wait for blocks (the oldest forgotten beyond this).
MAX_DIGESTS = 4096

# Key of D's own transfer report in the kv_transfer_params it returns with a finished request.


class SchedulerSide:
    """The connector's scheduler half."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, config: KVP2PConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        kv_config = vllm_config.kv_transfer_config
        parallel = vllm_config.parallel_config
        self.config = config
        self.engine_id = engine_id
        self.tp_size = parallel.tensor_parallel_size
        self.pp_size = parallel.pipeline_parallel_size
        self.is_producer = bool(kv_config.is_kv_producer)
        self.is_consumer = bool(kv_config.is_kv_consumer)
        self.side_channel_port = config.side_channel_port_for(data_parallel_index(parallel),
                                                             self.tp_size * self.pp_size, 0)
        # What P's params name as remote_host; the workers resolve the same settings the same way (worker.py).
        self.advertised_host = config.advertised_host(node_ip)
        # Refuses a KV cache it cannot move (Mamba state, ...) here, at engine start-up.
        self.group_ids = transfer_group_ids(kv_cache_config)
        self.groups = groups_from_vllm(kv_cache_config, self.group_ids)
        unrecoverable = load_failure_problem(len(kv_cache_config.kv_cache_groups), self.is_consumer,
                                             compat.REPORTS_FAILED_REQUESTS)
        if unrecoverable:
            raise UnsupportedKVCacheError(unrecoverable)
        self._full_group = next((i for i, g in enumerate(self.groups) if g.kind == FULL), None)
        self.block_size = common_block_size(self.groups, vllm_config.cache_config.block_size)
        self.incarnation = incarnation(vllm_config, engine_id)
        self.auth = Authenticator(config.secret, config.clock_skew) if config.secret else None
        if self.auth is None:
            logger.warning("kv_transfer_params are %s: any client of D's API can name any P (set VLLM_KVP2P_SECRET "
                           "or VLLM_KVP2P_SECRET_FILE on every P and D, docs/security.md)",
                           "issued unsigned" if self.is_producer and not self.is_consumer else "not authenticated")
        hashes_problem = compat.kv_event_hashes_problem(vllm_config)
        if hashes_problem:
            logger.warning("%s", hashes_problem)
        self.consumer = ConsumerSchedule(
            self.block_size, self.groups, peer_ports=config.peer_port_ranges(),
            authenticate=self._authenticate if self.auth is not None else None,
            hold_lifetime=config.hold_timeout + config.clock_skew,  # how long params P issued can be used
        )
        self._forgotten_warned = 0  # D: ended holds forgotten at the bound, as of the last WARNING
        self._holds: list[HoldOrder] = []
        self._siblings = SiblingOffers()  # P: the children of an n > 1 request offer one hold
        self._reports: dict[str, PullReport] = {}
        # Idle steps sleep until a worker of this engine has news (vllm_kvp2p/connector/step_wakeup.py).
        self._idle = StepWaiter(engine_id, data_parallel_index(parallel))
        self._news_due = False  # an idle sleep ended on news that has not reached update_connector_output yet
        # Failed pulls by kind, one per request (the workers' reports merged): the scheduler-side stats vLLM
        # merges into the connector's metrics (the workers count pulls, per rank).
        self.stats = Kvp2pStats()
        self._crashed: OrderedDict[str, None] = OrderedDict()  # requests a hook failed on (logged once each)
        self._digests: OrderedDict[str, tuple[int, str]] = OrderedDict()  # D: request -> (tokens, their digest)
        self._unbound_warned: OrderedDict[str, None] = OrderedDict()  # P: prompts not offered, one WARNING each why
        watch_engine_loads(vllm_config)  # LoRA: the engine's own adapter loads are looked at (lora_weights.py)

    def _warn_unbound(self, why: str) -> None:
        """P: a finished prefill offered to no decoder because its prompt cannot be bound (the adapter's weights
        unreadable here); one WARNING per reason (at most 64 remembered), DEBUG after."""
        if why in self._unbound_warned:
            logger.debug("KV of a request not offered to a decoder: %s", why)
            return
        self._unbound_warned[why] = None
        while len(self._unbound_warned) > 64:
            self._unbound_warned.popitem(last=False)
        logger.warning("KV not offered to a decoder (D computes the prompt itself): %s", why)

    def _warn_forgotten(self) -> None:
        """D: n > 1 holds forgotten before their params' end because the table was full (lifecycle/shared_holds.py):
        a WARNING the first time and at every further table's worth; their late children compute their prompts."""
        forgotten = self.consumer.shared.forgotten_early
        if forgotten and (not self._forgotten_warned or forgotten - self._forgotten_warned >= MAX_ENDED_HOLDS):
            self._forgotten_warned = forgotten
            logger.warning("%d ended n > 1 holds forgotten early (more than %d ended within hold_timeout + "
                           "clock_skew): until their params' end, a child naming a hold D does not know computes "
                           "its prompt itself and contacts no P", forgotten, MAX_ENDED_HOLDS)

    # ------------------------------------------------------------------ no exception leaves a hook

    def _survive(self, hook: str, request: Request, exc: Exception, *, fail_load: bool = True) -> None:
        """A bug in the connector on one request must not take the engine down with every request in flight: log
        it once per request with its traceback, and make that request's load fail (vLLM's kv_load_failure_policy
        decides) without contacting anyone. Counted with the failed pull its plan becomes (an ``internal`` failure),
        or here where no plan follows (P's side)."""
        request_id = request.request_id
        if request_id not in self._crashed:
            self._crashed[request_id] = None
            while len(self._crashed) > 4096:
                self._crashed.popitem(last=False)
            logger.error("MooncakeP2PConnector: %s failed on request %s; the request's KV load fails, the engine "
                         "serves on", hook, request_id, exc_info=exc)
        if self.is_consumer and fail_load:
            self.consumer.fail(request_id, f"internal error in {hook}: {type(exc).__name__}: {exc}"[:500])
        else:
            self.stats.record_failure(Failure.INTERNAL.value)

    def _prompt(self, request: Request) -> Prompt:
        return Prompt(request.num_prompt_tokens, lambda n: self._digest(request, n),
                      loads_kv=not request.get_skip_reading_prefix_cache())

    def _digest(self, request: Request, num_tokens: int) -> str:
        """``request_digest``, once per request: vLLM asks again at every step a request waits for blocks, and a
        long prompt's digest costs ~0.1 ms per thousand tokens."""
        known = self._digests.get(request.request_id)
        if known is not None and known[0] == num_tokens:
            return known[1]
        digest = request_digest(request, num_tokens)
        self._digests[request.request_id] = (num_tokens, digest)
        while len(self._digests) > MAX_DIGESTS:
            self._digests.popitem(last=False)
        return digest

    # ------------------------------------------------------------------ P: admission

    def on_new_request(self, request: Request) -> None:
        """P, model with a recurrent state: prefill all but the last prompt token (vllm_kvp2p/transfer/kv_groups.py).
        Any
        request with a LoRA adapter: its files looked at before a worker can load them for it (lora_weights.py)."""
        params = request.kv_transfer_params
        try:
            if getattr(request, "lora_request", None) is not None:
                see_adapter(request.lora_request)
            if (self.is_producer and isinstance(params, dict) and params.get("do_remote_decode")
                    and has_state(self.groups)):
                _drop_last_prompt_token(request)
        except Exception as exc:
            self._survive("on_new_request", request, exc)

    # ------------------------------------------------------------------ D: admission

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.is_consumer:
            return 0, False
        try:
            return self.consumer.matched_tokens(
                request.request_id, request.kv_transfer_params, self._prompt(request), num_computed_tokens,
                now=_monotonic(),
            )
        except Exception as exc:
            self._survive("get_num_new_matched_tokens", request, exc)
            count = request.num_prompt_tokens - 1 - num_computed_tokens  # vLLM waits, the failed plan ends it
            return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if not self.is_consumer:
            return
        params = request.kv_transfer_params
        if not (isinstance(params, dict) and params.get("do_remote_prefill")):
            return
        unhashed: list[list[int]] = []
        try:
            per_group = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else []
            unhashed = [list(per_group[gid]) for gid in self.group_ids] if per_group else []
            local_hit = self._local_hit_tokens(request, blocks, num_external_tokens)
            plan = self.consumer.on_alloc(request.request_id, params, num_external_tokens, unhashed, local_hit,
                                          self._prompt(request), now=_monotonic())
        except Exception as exc:
            # vLLM may be waiting for this load now: it still gets exactly one (failed) plan.
            self._survive("update_state_after_alloc", request, exc)
            plan = self.consumer.on_alloc(request.request_id, params, num_external_tokens, unhashed, 0,
                                          self._prompt(request), now=_monotonic())
        if plan is not None:
            logger.debug(
                "planned pull of %s: %d blocks (%s) from %s",
                request.request_id, plan.num_blocks, "awaiting" if plan.awaiting else "release only",
                plan.remote.remote_engine_id,
            )

    def _local_hit_tokens(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> int:
        """D's local prefix-cache hit: the run of already-hashed blocks at the start of a full-attention group
        (request.num_computed_tokens cannot tell it: vLLM updates it only after update_state_after_alloc). With
        sliding-window groups only (their older blocks are null), what D loads ends where P's tokens end."""
        if self._full_group is None:
            verdict = self.consumer.verdict(request.request_id, request.kv_transfer_params, self._prompt(request))
            if not isinstance(verdict, Admitted) or num_external_tokens <= 0:
                return 0
            return max(0, verdict.load_end - num_external_tokens)
        group = blocks.blocks[self.group_ids[self._full_group]]
        return sum(1 for b in group if b.block_hash is not None and not b.is_null) * self.block_size

    # ------------------------------------------------------------------ both: request end

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: one list per KV-cache group, as vLLM's ``request_finished_all_groups`` gives them."""
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params:
            return False, None
        try:
            if params.get("do_remote_prefill"):
                if self.is_consumer:
                    self.consumer.on_finished(request.request_id, params, self._prompt(request), now=_monotonic())
                    self._digests.pop(request.request_id, None)
                    self._warn_forgotten()
                report = self._reports.pop(request.request_id, None)
                return False, ({PULL_REPORT_KEY: _report_dict(report)} if report else None)
            if not (self.is_producer and params.get("do_remote_decode")):
                return False, None
            return self._offer(request, block_ids)
        except Exception as exc:
            self._survive("request_finished", request, exc, fail_load=False)  # nothing left to fail: it ends
            self._digests.pop(request.request_id, None)
            return False, None  # P frees the blocks now; D computes the prompt itself

    def _offer(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """P: keep the blocks of a finished prefill for a decoder and issue the params that name them."""
        from vllm.v1.request import RequestStatus

        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted or failed prefill: nothing for a decoder, free now
        if not any(block_ids):
            return False, None
        num_tokens = request.num_computed_tokens
        try:
            digest = request_digest(request, num_tokens)
        except UnboundPrompt as exc:  # its KV cannot be bound to D's prompt: free now, D computes the prompt
            self._warn_unbound(str(exc))
            return False, None
        shared = self._siblings.shared(request.request_id, num_tokens, digest)
        if shared is not None:
            # A child of an n > 1 request whose sibling holds the same KV: answer with that hold, free these blocks.
            return False, shared
        # Each transfer group cut to what a decoder needs (sliding windows: the tail), ending at the last block.
        offered = [needed_tail(g, block_ids[gid], num_tokens) for g, gid in zip(self.groups, self.group_ids)]
        hold_id = uuid.uuid4().hex
        remote = RemotePrefill(
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_host=self.advertised_host,
            remote_port=self.side_channel_port,
            remote_block_ids=offered,
            remote_hold_id=hold_id,
            remote_num_tokens=num_tokens,
            remote_block_size=self.block_size,
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            remote_incarnation=self.incarnation,
            remote_prompt_digest=digest,
        )
        if self.auth is not None:
            remote = self.auth.sign_params(remote, _now_ms() + int(self.config.hold_timeout * 1000))
        params = remote.to_params()
        # Queued last: if anything above raised, no hold order is left without params (vLLM frees the blocks).
        self._holds.append(HoldOrder(request.request_id, hold_id, sum(len(ids) for ids in block_ids),
                                     tuple(tuple(ids) for ids in offered), remote.mac))
        self._siblings.remember(request.request_id, num_tokens, digest, params)
        return True, params

    def _authenticate(self, remote: RemotePrefill) -> str:
        assert self.auth is not None
        return self.auth.params_problem(remote, _now_ms())

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVP2PMetadata:
        if self.is_consumer and logger.isEnabledFor(logging.DEBUG):
            for new in scheduler_output.scheduled_new_reqs:  # follow a request: its first step after the pull
                if self.consumer.is_planned(new.req_id):
                    logger.debug("scheduled %s with its pulled KV", new.req_id)
        if self.is_consumer:  # a reader's pulled blocks are D's prefix cache once it runs: its followers may go
            self.consumer.on_scheduled(new.req_id for new in scheduler_output.scheduled_new_reqs)
        holds, self._holds = self._holds, []
        pulls = self.consumer.take_plans()
        if (scheduler_output.total_num_scheduled_tokens == 0 and not holds and not pulls
                and self.config.idle_step_sleep > 0):
            # Only kept alive by holds or pending loads: yield the cores to the threads that move the KV, until
            # the worker has news (step_wakeup). A step with holds or plans to ship never waits: a decoder may be
            # claiming that hold already, and a plan's pull starts only when the worker has it.
            if self._news_due:
                # Woken: the workers report the news in the step that follows the wake-up. With vLLM's async
                # scheduling (a queue of 2 batches) that step's output is processed only after the next schedule,
                # this one: sleeping here would delay a loaded request by up to idle_step_sleep. Once only.
                self._news_due = False
            else:
                self._news_due = self._idle.wait(self.config.idle_step_sleep)
        return KVP2PMetadata(holds=holds, pulls=pulls)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.finished_recving or connector_output.finished_sending:
            self._news_due = False  # it arrived: the next idle step may sleep again
            if connector_output.finished_recving and logger.isEnabledFor(logging.DEBUG):
                logger.debug("receives of %s reached the scheduler", sorted(connector_output.finished_recving))
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVP2PWorkerMetadata):
            # Keep reports only for requests still alive; an aborted one's pull may end after it finished. The
            # ranks of D report in the steps their pulls end in (not always the same one): merged per request, and
            # a failed pull counted once per request.
            for request_id, report in meta.reports.items():
                earlier = self._reports.get(request_id)
                if report.failure and not (earlier and earlier.failure):
                    self.stats.record_failure(report.failure)
                if self.consumer.is_planned(request_id):
                    self._reports[request_id] = earlier.merge(report) if earlier else report

    def get_kv_connector_stats(self) -> Kvp2pStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000  # wall clock: params cross hosts


def _monotonic() -> float:
    return time.monotonic()  # D's own table of holds: only its durations count


# Marks a request whose prompt was already shortened (vLLM may offer it again after a preemption).
_HELD_BACK_KEY = "kvp2p_last_token_held_back"


def _drop_last_prompt_token(request: Request) -> None:
    """Shorten the prompt P prefills by its last token. The request's only output (P serves one token for the
    decoder's params) is then not the real first token, which D computes. Not for one-token prompts, nor for
    requests that skip the prefix cache (prompt logprobs): D recomputes those whole."""
    params = request.kv_transfer_params
    if params.get(_HELD_BACK_KEY) or request.num_prompt_tokens <= 1 or request.get_skip_reading_prefix_cache():
        return
    if request.prompt_token_ids is not None:
        request.prompt_token_ids.pop()
    elif request.prompt_embeds is not None:
        request.prompt_embeds = request.prompt_embeds[:-1]
    else:
        return
    request._all_token_ids.pop()
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    params[_HELD_BACK_KEY] = True


def request_digest(request: Request, num_tokens: int) -> str:
    """``prompt_digest`` of a request's first ``num_tokens`` tokens with what else decides their KV: the LoRA
    adapter (by its weights, not its name: vllm_kvp2p/connector/lora_weights.py; raises UnboundPrompt when they
    cannot be read here), multimodal inputs starting among them (vLLM's identifier and position), prompt
    embeddings. P (over what it offers) and D (over its own prompt) call it alike; ``cache_salt`` is left out: it
    isolates caches, it does not change KV."""
    extras: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extras.append(f"lora-weights:{lora_digest(lora)}")
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        if position.offset < num_tokens:
            extras.append(f"mm:{feature.identifier}@{position.offset}+{position.length}")
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        import torch

        rows = embeds[: min(num_tokens, len(embeds))].contiguous().cpu()
        extras.append("embeds:" + hashlib.sha256(rows.view(torch.uint8).numpy().tobytes()).hexdigest())
    return prompt_digest(request.all_token_ids[:num_tokens], extras)


def _report_dict(report: PullReport) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "blocks": report.blocks,
        "bytes": report.bytes,
        "descriptors": report.descriptors,
        "seconds": round(report.seconds, 6),
        **({"reason": report.reason} if report.reason else {}),
        **({"failure": report.failure} if report.failure else {}),
        **({"verified": report.verified} if report.verified else {}),
        **({"unverified": True} if report.unverified else {}),
        **({"sums_lost": True} if report.sums_lost else {}),
    }
