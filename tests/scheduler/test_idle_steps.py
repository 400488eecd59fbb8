"""vLLM's real Scheduler: which engine steps wait ``idle_step_sleep`` (the engine is kept stepping by holds and
pending loads) and which never do. A step that ships a hold to P's workers or a plan to D's must not wait: a decoder
may already be claiming the hold, and the pull starts only when the worker has the plan. Every such wait was up to
5 ms of a P/D request's TTFT (benchmarks/bench_ttft_timeline.py)."""

from __future__ import annotations

import pytest

from tests.scheduler.harness import make_request, make_scheduler, make_vllm_config, step, tokens
from tests.scheduler.p_and_d import prefill_on_p
from vllm_kvp2p.connector.step_wakeup import StepWaiter


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


def test_after_a_wake_up_the_next_idle_step_does_not_sleep_until_the_news_arrived(monkeypatch) -> None:
    """With vLLM's async scheduling the step that woke on news reports it only after the next schedule: that
    schedule must not sleep again (it cost up to idle_step_sleep per loaded request). Once only: a wake-up without
    news (lost, forged) costs one step that does not sleep, not a spinning engine."""
    answers = iter([True, True, False])
    calls: list[float] = []

    def wait(self, seconds: float) -> bool:
        calls.append(seconds)
        return next(answers)

    monkeypatch.setattr(StepWaiter, "wait", wait)
    p = make_scheduler(make_vllm_config("kv_producer", engine_id="p-idle4"), num_blocks=100)
    params, _ = prefill_on_p(p, "p1", tokens(40))
    d = make_scheduler(make_vllm_config("kv_consumer", engine_id="d-idle4"), num_blocks=100)
    d.add_request(make_request("d1", tokens(40), max_tokens=3, kv_transfer_params=params))
    step(d)  # ships the plan
    step(d)
    assert len(calls) == 1  # woken (True)
    step(d)
    assert len(calls) == 1  # the news has not arrived: no second sleep
    step(d)
    assert len(calls) == 2  # once only: sleeps again (woken again, True)
    step(d, finished_recving=["d1"])  # no sleep (woken just before); the news arrives in this step's output
    st = step(d)
    assert st.so.total_num_scheduled_tokens > 0 and len(calls) == 2


def test_news_that_arrived_with_the_wake_up_step_lets_the_next_idle_step_sleep(monkeypatch) -> None:
    """Without a batch queue the news comes in the output of the step that woke: the next idle step sleeps as
    usual (no step is taken for nothing)."""
    calls: list[float] = []
    monkeypatch.setattr(StepWaiter, "wait", lambda self, seconds: calls.append(seconds) or True)
    p = make_scheduler(make_vllm_config("kv_producer", engine_id="p-idle5"), num_blocks=100)
    prefill_on_p(p, "p1", tokens(40))
    step(p)  # ships the hold
    step(p, finished_sending=["p1"])  # woken, and the release arrives in the same step's output
    assert len(calls) == 1
    step(p)
    assert len(calls) == 2
