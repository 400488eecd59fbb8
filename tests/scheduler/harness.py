"""Drive vLLM's real v1 ``Scheduler`` with our connector in the SCHEDULER role: no workers, no Mooncake.

The workers' side of each step is played by :func:`model_runner_output`, which fakes what vLLM's
``KVOutputAggregator`` would hand the scheduler (sampled tokens plus a :class:`KVConnectorOutput`).
The model is a hand-written Llama ``config.json`` in a temp dir, loaded with ``skip_tokenizer_init``: no hub.

Runs on every supported vLLM: failed loads are handed to the scheduler the way the installed vLLM takes them
(request ids on 0.32, block ids on 0.23, as the real worker side does:
:data:`vllm_kvp2p.connector.compat.REPORTS_FAILED_
REQUESTS`), and the queues checked are the ones the installed Scheduler has.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_kvp2p.connector.compat import REPORTS_FAILED_REQUESTS
from vllm_kvp2p.connector.metadata import KVP2PMetadata
from vllm_kvp2p.connector.scheduler import SchedulerSide

EOS_TOKEN_ID = 2
SAMPLED_TOKEN_ID = 7  # any non-EOS id
VOCAB_SIZE = 1000

_MODEL_DIR: Path | None = None


def model_dir() -> str:
    """A directory with a minimal Llama ``config.json`` (written once per process)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        path = Path(tempfile.mkdtemp(prefix="kvp2p-sched-model-"))
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "bos_token_id": 1,
            "eos_token_id": EOS_TOKEN_ID,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }
        (path / "config.json").write_text(json.dumps(config))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _MODEL_DIR = path
    return str(_MODEL_DIR)


_MTP_MODEL_DIR: Path | None = None


def mtp_model_dir() -> str:
    """A directory with a minimal DeepSeek-V3 ``config.json`` declaring one MTP layer (what vLLM's ``deepseek_mtp``
    speculative method drafts with; written once per process)."""
    global _MTP_MODEL_DIR
    if _MTP_MODEL_DIR is None:
        path = Path(tempfile.mkdtemp(prefix="kvp2p-sched-mtp-model-"))
        config = {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
            "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 1,
            "first_k_dense_replace": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "kv_lora_rank": 512,
            "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
            "num_nextn_predict_layers": 1, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 1,
            "eos_token_id": EOS_TOKEN_ID, "tie_word_embeddings": False, "torch_dtype": "float32",
        }
        (path / "config.json").write_text(json.dumps(config))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _MTP_MODEL_DIR = path
    return str(_MTP_MODEL_DIR)


def make_vllm_config(
    role: str,
    *,
    model: str | None = None,
    speculative: dict[str, Any] | None = None,
    block_size: int = 16,
    kv_load_failure_policy: str = "fail",
    extra_config: dict[str, Any] | None = None,
    max_num_batched_tokens: int = 1024,
    max_num_seqs: int = 16,
    max_model_len: int = 2048,
    engine_id: str | None = None,
) -> VllmConfig:
    """``speculative``: the ``--speculative-config`` fields (vLLM's real SpeculativeConfig is built from them)."""
    model = model or model_dir()
    model_config = ModelConfig(
        model=model,
        tokenizer=model,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=True)
    kv_transfer_config = KVTransferConfig(
        kv_connector="MooncakeP2PConnector",
        kv_connector_module_path="vllm_kvp2p.connector.facade",
        kv_role=role,
        kv_load_failure_policy=kv_load_failure_policy,
        # One machine: P's params name loopback (the connector's default is this node's address).
        kv_connector_extra_config={"host": "127.0.0.1", **(extra_config or {})},
        **({"engine_id": engine_id} if engine_id else {}),
    )
    speculative_config = None
    if speculative is not None:
        from vllm.config import ParallelConfig, SpeculativeConfig

        speculative_config = SpeculativeConfig(**speculative, target_model_config=model_config,
                                               target_parallel_config=ParallelConfig())
    return VllmConfig(
        model_config=model_config,
        speculative_config=speculative_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )


def make_kv_cache_config(
    block_size: int, num_blocks: int, sliding_window: int | None = None, *, full_attention: bool = True
) -> KVCacheConfig:
    """One full-attention group; with ``sliding_window``, a second group of sliding-window layers (what vLLM's
    hybrid allocator makes of a model with mixed layers, e.g. gpt-oss); ``full_attention=False`` drops the first
    (a model whose layers all slide, e.g. Mistral 7B v0.1)."""
    groups = [
        KVCacheGroupSpec(
            ["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        )
    ] if full_attention else []
    if sliding_window is not None:
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        groups.append(KVCacheGroupSpec(["swa_layer"], SlidingWindowSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=sliding_window,
        )))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def make_scheduler(
    vllm_config: VllmConfig, *, num_blocks: int = 1000, sliding_window: int | None = None,
    full_attention: bool = True,
) -> Scheduler:
    block_size = vllm_config.cache_config.block_size
    kv_cache_config = make_kv_cache_config(block_size, num_blocks, sliding_window, full_attention=full_attention)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
    )


# ------------------------------------------------------------------ requests

_HASHER_READY = False


def make_request(
    request_id: str,
    prompt_token_ids: list[int] | int,
    *,
    block_size: int = 16,
    max_tokens: int = 16,
    kv_transfer_params: dict[str, Any] | None = None,
    seed: int = 0,
    prompt_logprobs: int | None = None,
) -> Request:
    """A request; an int prompt means that many tokens of a deterministic sequence starting at ``seed``."""
    global _HASHER_READY
    if not _HASHER_READY:
        init_none_hash(sha256)
        _HASHER_READY = True
    if isinstance(prompt_token_ids, int):
        prompt_token_ids = tokens(prompt_token_ids, seed)
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    params.update_from_generation_config({}, EOS_TOKEN_ID)  # what the input processor does; no tokenizer here
    params.extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` prompt tokens, never EOS; different seeds give different first tokens (no shared prefix)."""
    return [10 + (seed * 97 + i) % (VOCAB_SIZE - 20) for i in range(n)]


# ------------------------------------------------------------------ steps

def model_runner_output(
    reqs: Iterable[Request | str],
    *,
    finished_sending: Iterable[str] | None = None,
    finished_recving: Iterable[str] | None = None,
    failed_recving: Iterable[str] | None = None,
    worker_meta: Any = None,
    eos: bool = False,
    token_id: int | None = None,
    load_error_blocks: Iterable[int] = (),
) -> ModelRunnerOutput:
    """One sampled token per request in ``reqs`` plus, when any kv field is given, a KVConnectorOutput.
    A vLLM that takes failed loads as block ids gets ``load_error_blocks`` instead of ``failed_recving``."""
    req_ids = [r if isinstance(r, str) else r.request_id for r in reqs]
    tok = token_id if token_id is not None else (EOS_TOKEN_ID if eos else SAMPLED_TOKEN_ID)
    kv_out = None
    if finished_sending or finished_recving or failed_recving or worker_meta is not None:
        failures: dict[str, Any] = (
            {"failed_recving": set(failed_recving or ())} if REPORTS_FAILED_REQUESTS
            else {"invalid_block_ids": set(load_error_blocks)}
        )
        kv_out = KVConnectorOutput(
            finished_sending=set(finished_sending or ()) or None,
            finished_recving=set(finished_recving or ()) or None,
            kv_connector_worker_meta=worker_meta,
            **failures,
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[tok] for _ in req_ids],
        kv_connector_output=kv_out,
    )


class Step:
    """One ``schedule()`` + ``update_from_output()`` round."""

    def __init__(self, so: SchedulerOutput, outputs: list[EngineCoreOutput]) -> None:
        self.so = so
        self.outputs = outputs

    @property
    def meta(self) -> KVP2PMetadata:
        meta = self.so.kv_connector_metadata
        assert isinstance(meta, KVP2PMetadata), meta
        return meta

    def output(self, request_id: str) -> EngineCoreOutput:
        found = [o for o in self.outputs if o.request_id == request_id]
        assert len(found) == 1, (request_id, self.outputs)
        return found[0]

    def finished(self) -> dict[str, EngineCoreOutput]:
        return {o.request_id: o for o in self.outputs if o.finish_reason is not None}


def step(
    scheduler: Scheduler,
    *,
    finished_sending: Iterable[str] | None = None,
    finished_recving: Iterable[str] | None = None,
    failed_recving: Iterable[str] | None = None,
    worker_meta: Any = None,
    eos: bool | Iterable[str] = False,
) -> Step:
    """Schedule, "run" every scheduled request (one sampled token each), feed back the given kv results.

    ``eos`` True ends every scheduled request with EOS; an iterable ends only the named ones.
    """
    so = scheduler.schedule()
    scheduled = list(so.num_scheduled_tokens)
    eos_ids = set(scheduled) if eos is True else set(eos or ())
    kv_kwargs: dict[str, Any] = {
        "finished_sending": finished_sending, "finished_recving": finished_recving,
        "failed_recving": failed_recving, "worker_meta": worker_meta,
    }
    out = model_runner_output(scheduled, **kv_kwargs, load_error_blocks=pulled_blocks(scheduler, failed_recving))
    # Per-request EOS: patch the sampled tokens of the chosen ids.
    for i, rid in enumerate(out.req_ids):
        if rid in eos_ids:
            out.sampled_token_ids[i] = [EOS_TOKEN_ID]
    engine_outputs = scheduler.update_from_output(so, out)
    flat = [o for eco in engine_outputs.values() for o in eco.outputs]
    return Step(so, flat)


def pulled_blocks(scheduler: Scheduler, request_ids: Iterable[str] | None) -> set[int]:
    """The blocks a D worker pulls into for these requests: the ones not filled from the local prefix cache
    (still unhashed while the load is pending), which is what the worker reports for a failed pull."""
    blocks: set[int] = set()
    for request_id in request_ids or ():
        for group in scheduler.kv_cache_manager.coordinator.get_blocks(request_id):
            blocks.update(b.block_id for b in group if b.block_hash is None and not b.is_null)
    return blocks


def waiting_queues(scheduler: Scheduler, *, with_deferred: bool = True) -> list[Any]:
    """Every queue of not-yet-running requests the installed Scheduler has (0.32 adds kv_holding_waiting and
    deferred_waiting, a set of requests that also sit in a queue, to 0.23's waiting and skipped_waiting)."""
    names = ("waiting", "skipped_waiting", "kv_holding_waiting") + (("deferred_waiting",) if with_deferred else ())
    return [getattr(scheduler, n) for n in names if hasattr(scheduler, n)]


def run_until_idle(scheduler: Scheduler, max_steps: int = 64, **first_step_kv: Any) -> list[Step]:
    """Step until no request is waiting or running (finished-but-held requests may remain)."""
    steps = [step(scheduler, **first_step_kv)]
    while scheduler.running or any(len(q) for q in waiting_queues(scheduler, with_deferred=False)):
        assert len(steps) < max_steps, "scheduler did not drain"
        steps.append(step(scheduler))
    return steps


# ------------------------------------------------------------------ inspection

def connector_side(scheduler: Scheduler) -> SchedulerSide:
    side = scheduler.connector.scheduler_side  # type: ignore[union-attr]
    assert isinstance(side, SchedulerSide)
    return side


def num_free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def request_block_ids(scheduler: Scheduler, request_id: str) -> list[int]:
    (group,) = scheduler.kv_cache_manager.get_block_ids(request_id)
    return list(group)


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    assert len(scheduler.requests) == 0, list(scheduler.requests)
    for queue in waiting_queues(scheduler):
        assert len(queue) == 0, queue
    assert len(scheduler.running) == 0
    assert len(scheduler.finished_recving_kv_req_ids) == 0
    assert len(scheduler.failed_recving_kv_req_ids) == 0
    assert len(scheduler._inflight_prefills) == 0

    manager = scheduler.kv_cache_manager
    for coordinator_manager in manager.coordinator.single_type_managers:
        assert len(coordinator_manager.req_to_blocks) == 0
        assert len(coordinator_manager.num_cached_block) == 0

    pool = manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # the null block is never free
    for block in pool.blocks:
        assert block.ref_cnt == 0 or block.is_null, (block.block_id, block.ref_cnt)

    side = connector_side(scheduler)
    assert side._holds == []
    assert side._reports == {}
    assert len(side.consumer) == 0  # no request record left (lifecycle/consumer.py's Admission)
    assert side.consumer._pending == []
    assert len(side.consumer.shared) == 0  # no hold still in use by a request that left


class Spy:
    """Records every call of one connector method (arguments summarised, result kept) while still calling it."""

    def __init__(self, scheduler: Scheduler, method: str) -> None:
        self.calls: list[tuple[tuple[Any, ...], Any]] = []
        connector = scheduler.connector
        assert connector is not None
        original = getattr(connector, method)

        def wrapper(*args: Any) -> Any:
            result = original(*args)
            self.calls.append((args, result))
            return result

        setattr(connector, method, wrapper)  # the scheduler looks the method up on the instance

    def for_request(self, request_id: str) -> list[tuple[tuple[Any, ...], Any]]:
        return [(args, res) for args, res in self.calls if args[0].request_id == request_id]

    def results(self, request_id: str) -> list[Any]:
        return [res for _, res in self.for_request(request_id)]


class FakeWorkers:
    """Plays D's workers by the connector's contract: every PullPlan is executed (and P released) at once, and
    the receive is reported finished only for plans vLLM is awaiting (``PullPlan.awaiting``)."""

    def __init__(self, failing: Iterable[str] = ()) -> None:
        self.plans: list[Any] = []
        self.failing = set(failing)

    def step(self, scheduler: Scheduler) -> Step:
        so = scheduler.schedule()
        meta = so.kv_connector_metadata
        assert isinstance(meta, KVP2PMetadata)
        self.plans.extend(meta.pulls)
        recv = {p.request_id for p in meta.pulls if p.awaiting}
        failed = recv & (self.failing | {p.request_id for p in meta.pulls if p.error})  # a failed plan fails
        blocks = {b for p in meta.pulls if p.request_id in failed for b in p.all_local_block_ids}
        out = model_runner_output(
            list(so.num_scheduled_tokens), finished_recving=recv, failed_recving=failed, load_error_blocks=blocks
        )
        engine_outputs = scheduler.update_from_output(so, out)
        return Step(so, [o for eco in engine_outputs.values() for o in eco.outputs])

    def run_until_empty(self, scheduler: Scheduler, max_steps: int = 64) -> list[Step]:
        steps = []
        while scheduler.requests:
            assert len(steps) < max_steps, f"scheduler did not drain: {list(scheduler.requests)}"
            steps.append(self.step(scheduler))
        steps.append(self.step(scheduler))  # one more: plans made by the last request_finished calls
        return steps
