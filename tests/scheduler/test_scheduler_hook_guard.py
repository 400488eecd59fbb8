"""The connector's guard in its scheduler hooks (``SchedulerSide._survive``), checked deterministically on vLLM's
real ``Scheduler`` on D: a connector bug injected into one request's hook fails that request's load under the
policy, the others are served, the error is logged once with its traceback; without the guard the same bug escapes
``Scheduler.schedule()`` (in EngineCore: the end of the engine and of every request in flight)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from tests.scheduler.harness import FakeWorkers, assert_scheduler_empty, connector_side, make_request, tokens
from tests.scheduler.hostile_params import MAX_OUT, POLICIES, Case, genuine, new_d_scheduler
from tests.scheduler.p_and_d import remote_params
from vllm_kvp2p.connector.scheduler import SchedulerSide
from vllm_kvp2p.lifecycle import consumer as consumer_module
from vllm_kvp2p.lifecycle.consumer import ConsumerSchedule, PullPlan
from vllm_kvp2p.lifecycle.failure import Failure

INJECTED = "injected connector bug"


def _inject(monkeypatch: pytest.MonkeyPatch, hook: str, victim: str) -> None:
    """Make the connector raise RuntimeError on the request whose params name ``victim``, in ``hook``."""
    if hook == "update_state_after_alloc":
        real_plan = ConsumerSchedule._plan

        def plan(self: ConsumerSchedule, request_id: str, admitted: Any, *args: Any) -> PullPlan:
            if admitted.remote.remote_request_id == victim:
                raise RuntimeError(INJECTED)
            return real_plan(self, request_id, admitted, *args)

        monkeypatch.setattr(ConsumerSchedule, "_plan", plan)
        return
    real_judge = consumer_module.judge

    def judge(params: Any, *args: Any) -> Any:
        if isinstance(params, dict) and params.get("remote_request_id") == victim:
            raise RuntimeError(INJECTED)
        return real_judge(params, *args)

    monkeypatch.setattr(consumer_module, "judge", judge)  # the name consumer.py calls


@pytest.mark.parametrize("policy", POLICIES)
# update_state_after_alloc: found by this test, fixed (on_alloc marked the request planned before building the
# plan, so a failure there left it with no plan, waiting in WAITING_FOR_REMOTE_KVS forever).
@pytest.mark.parametrize("hook", ["get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"])
def test_guard_turns_a_connector_bug_into_one_failed_load(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, policy: str, hook: str) -> None:
    """A bug in the connector on one request (its verdict raises; for update_state_after_alloc, its plan; for
    request_finished, the verdict of a request aborted before it was scheduled): the scheduler serves on, that
    request's load fails under the policy without contacting anyone (or, aborted, it just ends), the other
    requests of the same batch are served normally, and the error is logged once, with its traceback."""
    _inject(monkeypatch, hook, victim="p-bad")
    sched = new_d_scheduler(policy, secret=False)
    bad_prompt = tokens(40, seed=6)
    cases = [
        Case("bad", bad_prompt, remote_params(40, request_id="p-bad", prompt=bad_prompt),
             abort="before" if hook == "request_finished" else ""),
        Case("good", tokens(40, seed=7), remote_params(40, request_id="p-good", prompt=tokens(40, seed=7)),
             authentic=genuine(tokens(40, seed=7), 40, "p-good")),
        Case("plain", tokens(30, seed=8), None),
    ]
    caught: list[str] = []
    side = connector_side(sched)
    guard = side._survive
    side._survive = lambda h, request, exc, **kw: (caught.append(h), guard(h, request, exc, **kw))  # type: ignore
    workers = FakeWorkers()
    with caplog.at_level(logging.ERROR, logger="vllm.kvp2p"):
        for case in cases:
            sched.add_request(make_request(case.request_id, case.prompt, max_tokens=MAX_OUT,
                                           kv_transfer_params=case.params))
        if cases[0].abort:
            sched.finish_requests("bad", RequestStatus.FINISHED_ABORTED)
        steps = workers.run_until_empty(sched)
    assert caught == [hook]

    plans: dict[str, list[PullPlan]] = {}
    for plan in workers.plans:
        plans.setdefault(plan.request_id, []).append(plan)
    finished = {o.request_id: o.finish_reason for s in steps for o in s.outputs if o.finish_reason is not None}
    if hook == "request_finished":
        assert "bad" not in plans and "bad" not in finished  # aborted: no plan, so no one is contacted
    else:
        (bad,) = plans["bad"]
        assert bad.error.startswith(f"internal error in {hook}: RuntimeError: {INJECTED}"), bad.error
        assert bad.failure is Failure.INTERNAL and not bad.contact_p and bad.awaiting
        assert finished["bad"] == (FinishReason.ERROR if policy == "fail" else FinishReason.LENGTH)
    (good,) = plans["good"]
    assert good.error == "" and good.awaiting and good.contact_p and good.num_blocks == 3
    assert finished["good"] == finished["plain"] == FinishReason.LENGTH
    assert "plain" not in plans

    logged = [r for r in caplog.records if r.name.startswith("vllm.kvp2p") and r.levelno >= logging.ERROR]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    (record,) = logged
    assert f"{hook} failed on request bad" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError
    assert INJECTED in caplog.text and "Traceback" in caplog.text
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("hook", ["get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"])
def test_without_the_guard_the_bug_escapes_the_scheduler(monkeypatch: pytest.MonkeyPatch, hook: str) -> None:
    """Paired with the test above: the same injected bug, with ``SchedulerSide._survive`` re-raising (no guard),
    escapes vLLM's Scheduler (schedule(), or finish_requests() for an abort): in EngineCore that is the end of the
    engine and of every request in flight."""
    _inject(monkeypatch, hook, victim="p-bad")

    def no_guard(self: SchedulerSide, hook: str, request: Any, exc: Exception, **kwargs: Any) -> None:
        raise exc

    monkeypatch.setattr(SchedulerSide, "_survive", no_guard)
    sched = new_d_scheduler("recompute", secret=False)
    prompt = tokens(40, seed=6)
    sched.add_request(make_request("bad", prompt, max_tokens=MAX_OUT,
                                   kv_transfer_params=remote_params(40, request_id="p-bad", prompt=prompt)))
    with pytest.raises(RuntimeError, match=INJECTED):
        if hook == "request_finished":
            sched.finish_requests("bad", RequestStatus.FINISHED_ABORTED)
        else:
            sched.schedule()
