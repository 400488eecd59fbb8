"""A P (kv_producer) and a D (kv_consumer) on vLLM's real ``Scheduler``, and what passes between them: P's params,
its holds, D's plans and the workers' pull reports. Shared by the lifecycle tests of this package
(test_p_holds.py, test_d_pulls.py, test_d_aborts_and_failures.py) and the modules that build on them."""

from __future__ import annotations

import math

from vllm.v1.engine import FinishReason

from tests.scheduler.harness import (
    assert_scheduler_empty,
    make_request,
    make_scheduler,
    make_vllm_config,
    request_block_ids,
    step,
    tokens,
)
from vllm_kvp2p.connector.metadata import PullReport
from vllm_kvp2p.contract.protocol import RemotePrefill, prompt_digest
from vllm_kvp2p.lifecycle.consumer import PullPlan

BS = 16
NUM_BLOCKS = 100
P_ENGINE = "p-engine-0"
D_ENGINE = "d-engine-0"


def p_scheduler(num_blocks: int = NUM_BLOCKS, **kw):
    return make_scheduler(make_vllm_config("kv_producer", engine_id=P_ENGINE, **kw), num_blocks=num_blocks)


def d_scheduler(num_blocks: int = NUM_BLOCKS, **kw):
    return make_scheduler(make_vllm_config("kv_consumer", engine_id=D_ENGINE, **kw), num_blocks=num_blocks)


def remote_params(num_tokens: int, *, first_block: int = 200, request_id: str = "p-req", hold_id: str = "hold-1",
                  block_size: int = BS, prompt: list[int] | None = None) -> dict:
    """The kv_transfer_params a P engine would return for the first ``num_tokens`` of ``prompt`` (default: the
    harness's ``tokens(num_tokens)``, what ``make_request(id, num_tokens)`` prompts) held in P blocks 200, 201, ..."""
    n_blocks = math.ceil(num_tokens / block_size)
    return RemotePrefill(
        remote_engine_id=P_ENGINE,
        remote_request_id=request_id,
        remote_host="127.0.0.1",
        remote_port=14600,
        remote_block_ids=[list(range(first_block, first_block + n_blocks))],
        remote_hold_id=hold_id,
        remote_num_tokens=num_tokens,
        remote_block_size=block_size,
        remote_prompt_digest=prompt_digest((prompt or tokens(num_tokens))[:num_tokens]),
    ).to_params()


def prefill_on_p(p_sched, request_id: str, prompt: list[int]) -> tuple[dict, list[int]]:
    """Run one remote-decode request on P to completion; returns (its kv_transfer_params, its block ids).
    The blocks stay held by P until :func:`release_on_p`."""
    p_sched.add_request(make_request(request_id, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    st = step(p_sched)
    out = st.output(request_id)
    assert out.finish_reason == FinishReason.LENGTH
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params, request_block_ids(p_sched, request_id)


def release_on_p(p_sched, request_id: str) -> None:
    """P's workers report that D released the hold."""
    step(p_sched, finished_sending={request_id})
    assert_scheduler_empty(p_sched)


def collect_plans(steps) -> list[PullPlan]:
    return [plan for st in steps for plan in st.meta.pulls]


def report(blocks: int, ok: bool = True, reason: str = "") -> PullReport:
    return PullReport(ok=ok, blocks=blocks, bytes=blocks * 4096, descriptors=2 * blocks, seconds=0.01, reason=reason)
