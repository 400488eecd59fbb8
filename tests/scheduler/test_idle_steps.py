"""vLLM's real Scheduler: which engine steps wait ``idle_step_sleep`` (the engine is kept stepping by holds and
pending loads) and which never do. A step that ships a hold to P's workers or a plan to D's must not wait: a decoder
may already be claiming the hold, and the pull starts only when the worker has the plan. Every such wait was up to
5 ms of a P/D request's TTFT (benchmarks/bench_ttft_timeline.py)."""

from __future__ import annotations

import pytest

from tests.scheduler.harness import make_request, make_scheduler, make_vllm_config, step, tokens
from tests.scheduler.test_scheduler_lifecycle import prefill_on_p
from vllm_kvp2p.step_wakeup import StepWaiter


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    calls: list[tuple[str, float]] = []
    monkeypatch.setattr(StepWaiter, "wait", lambda self, seconds: calls.append((self.engine_id, seconds)))
    return calls


def test_p_step_shipping_a_hold_does_not_wait_later_empty_steps_do(waits) -> None:
    p = make_scheduler(make_vllm_config("kv_producer", engine_id="p-idle"), num_blocks=100)
    prefill_on_p(p, "p1", tokens(40))
    assert waits == []  # the prefill step scheduled tokens
    st = step(p)
    assert [h.request_id for h in st.meta.holds] == ["p1"] and waits == []  # shipped at once
    step(p)
    assert waits == [("p-idle", 0.005)]  # held only: wait for news (or idle_step_sleep)


def test_d_step_shipping_a_plan_does_not_wait(waits) -> None:
    p = make_scheduler(make_vllm_config("kv_producer", engine_id="p-idle2"), num_blocks=100)
    params, _ = prefill_on_p(p, "p1", tokens(40))
    d = make_scheduler(make_vllm_config("kv_consumer", engine_id="d-idle"), num_blocks=100)
    d.add_request(make_request("d1", tokens(40), max_tokens=3, kv_transfer_params=params))
    st = step(d)
    assert len(st.meta.pulls) == 1 and st.so.total_num_scheduled_tokens == 0
    assert waits == []
    step(d)  # waiting for the pull: nothing to ship
    assert waits == [("d-idle", 0.005)]


def test_no_wait_when_idle_step_sleep_is_zero(waits) -> None:
    p = make_scheduler(make_vllm_config("kv_producer", engine_id="p-idle3", extra_config={"idle_step_sleep": 0}),
                       num_blocks=100)
    prefill_on_p(p, "p1", tokens(40))
    step(p)
    step(p)
    assert waits == []
