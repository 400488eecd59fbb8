"""vLLM's real ``Scheduler`` with ``n > 1``: vLLM fans a request out into n children (ids ``{index}_{parent}``)
carrying the same ``kv_transfer_params``. On D one child reads P's hold and the others wait for its blocks and take
them from D's prefix cache (vllm_kvp2p/lifecycle/shared_holds.py); on P the children offer one hold
(vllm_kvp2p/lifecycle/sibling_offers.py). Before these, D planned one pull per child (P refuses every claim of a
hold but the first) and P kept one hold per child while vLLM returned the params of only one.

Each child's verdict and part are decided when vLLM first asks about it and kept until it ends
(vllm_kvp2p/lifecycle/consumer.py's Admission; issue 45): before that, a child first asked after its reader ended
(queued behind a request that did not fit) became a second reader and failed on P's refusal, and with the secret a
follower judged again past its params' expiry was kept forever at its end, or failed as expired when re-admitted
after a preemption. The tests of that section fail on the code before it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from tests.scheduler.harness import (
    Spy,
    Step,
    assert_scheduler_empty,
    connector_side,
    make_request,
    model_runner_output,
    num_free_blocks,
    request_block_ids,
    run_until_idle,
    step,
    tokens,
)
from tests.scheduler.p_and_d import (
    NUM_BLOCKS,
    collect_plans,
    d_scheduler,
    p_scheduler,
    remote_params,
    report,
)
from vllm_kvp2p.connector import scheduler as scheduler_module
from vllm_kvp2p.connector.metadata import KVP2PWorkerMetadata
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import RemotePrefill
from vllm_kvp2p.lifecycle.consumer import PullPlan

PARENT = "cmpl-abc-0-1a2b3c4d"  # vLLM's internal id of the parent: the client's id and a random suffix
CHILDREN = [f"{i}_{PARENT}" for i in range(3)]


def add_children(sched, params: dict, num_tokens: int = 40, max_tokens: int = 3) -> None:
    for child in CHILDREN:  # each child has its own copy, as after the trip from vLLM's front end to EngineCore
        sched.add_request(make_request(child, num_tokens, max_tokens=max_tokens, kv_transfer_params=dict(params)))


def test_d_children_share_one_pull_and_compute_only_the_last_partial_block():
    sched = d_scheduler()
    params = remote_params(40)  # 40 tokens: two full blocks of 16 and 8 tokens in a third
    add_children(sched, params)

    first = step(sched)
    (plan,) = first.meta.pulls  # one plan for the hold, by the first child
    assert plan.request_id == CHILDREN[0] and plan.awaiting
    assert sched.requests[CHILDREN[0]].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    for child in CHILDREN[1:]:  # the others wait for it, with no blocks and no plan
        assert sched.requests[child].status == RequestStatus.WAITING
        assert sched.kv_cache_manager.get_block_ids(child) == ([],) or not any(
            sched.kv_cache_manager.get_block_ids(child))
    assert collect_plans([step(sched) for _ in range(2)]) == []  # while the pull runs: nothing new

    meta = KVP2PWorkerMetadata({CHILDREN[0]: report(3)})
    step(sched, finished_recving={CHILDREN[0]}, worker_meta=meta)
    landed = step(sched)
    assert landed.so.num_scheduled_tokens == {CHILDREN[0]: 1}  # the reader runs with its pulled blocks
    followers = step(sched)
    # The followers find the reader's two full blocks in the prefix cache: 8 tokens computed each, nothing pulled.
    assert {c: followers.so.num_scheduled_tokens.get(c) for c in CHILDREN[1:]} == {c: 40 - 32 for c in CHILDREN[1:]}
    for child in CHILDREN[1:]:
        assert request_block_ids(sched, child)[:2] == request_block_ids(sched, CHILDREN[0])[:2]
    assert followers.meta.pulls == []

    steps = run_until_idle(sched)
    assert collect_plans(steps) == []  # no follower contacts P, not even to release at its end
    finished = {o.request_id: o for s in [first, landed, followers, *steps] for o in s.outputs
                if o.finish_reason is not None}
    assert set(finished) == set(CHILDREN)
    assert finished[CHILDREN[0]].kv_transfer_params[PULL_REPORT_KEY]["ok"] is True
    assert_scheduler_empty(sched)
    assert len(connector_side(sched).consumer.shared) == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_d_followers_of_a_failed_pull_compute_the_prompt_themselves(policy):
    sched = d_scheduler(kv_load_failure_policy=policy)
    add_children(sched, remote_params(40))
    (plan,) = step(sched).meta.pulls
    meta = KVP2PWorkerMetadata({CHILDREN[0]: report(0, ok=False, reason="claim refused")})
    st = step(sched, finished_recving={CHILDREN[0]}, failed_recving={CHILDREN[0]}, worker_meta=meta)
    steps = [st, *run_until_idle(sched)]
    assert collect_plans(steps) == []
    finished = {o.request_id: o for s in steps for o in s.outputs if o.finish_reason is not None}
    assert set(finished) == set(CHILDREN)
    want_reader = FinishReason.ERROR if policy == "fail" else FinishReason.LENGTH
    assert finished[CHILDREN[0]].finish_reason == want_reader
    assert all(finished[c].finish_reason == FinishReason.LENGTH for c in CHILDREN[1:])
    assert_scheduler_empty(sched)
    assert len(connector_side(sched).consumer.shared) == 0


def test_d_a_follower_aborted_while_it_waits_releases_nothing():
    sched = d_scheduler()
    add_children(sched, remote_params(40))
    (plan,) = step(sched).meta.pulls
    sched.finish_requests(CHILDREN[1], RequestStatus.FINISHED_ABORTED)
    assert step(sched).meta.pulls == []  # a release by the follower would end the reader's lease on P
    steps = run_until_idle(sched, finished_recving={CHILDREN[0]},
                           worker_meta=KVP2PWorkerMetadata({CHILDREN[0]: report(3)}))
    assert collect_plans(steps) == []
    assert_scheduler_empty(sched)
    assert len(connector_side(sched).consumer.shared) == 0


def test_d_followers_wait_for_a_reader_that_finishes_first():
    """A reader that ends before its followers were admitted (one decode step) leaves the hold record to them:
    they do not claim the hold it released."""
    sched = d_scheduler(max_num_seqs=1)  # one running request at a time: the followers wait for the reader's end
    add_children(sched, remote_params(40), max_tokens=1)
    (plan,) = step(sched).meta.pulls
    steps = run_until_idle(sched, finished_recving={CHILDREN[0]},
                           worker_meta=KVP2PWorkerMetadata({CHILDREN[0]: report(3)}))
    assert collect_plans(steps) == []
    assert {o.request_id for s in steps for o in s.outputs if o.finish_reason is not None} == set(CHILDREN)
    assert_scheduler_empty(sched)


def test_d_requests_of_other_holds_are_not_held_back():
    sched = d_scheduler()
    sched.add_request(make_request("a", 40, max_tokens=2, kv_transfer_params=remote_params(40, hold_id="h-a")))
    sched.add_request(make_request("b", 40, max_tokens=2, kv_transfer_params=remote_params(40, hold_id="h-b")))
    plans = step(sched).meta.pulls
    assert sorted(p.request_id for p in plans) == ["a", "b"]


def test_p_children_offer_one_hold_and_free_the_others_blocks():
    sched = p_scheduler()
    prompt = tokens(40)
    free = num_free_blocks(sched)
    for child in CHILDREN:
        sched.add_request(make_request(child, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    st = step(sched)
    outputs = {child: st.output(child) for child in CHILDREN}
    # vLLM 0.32 adds each child's own prefix-cache hit (remote_prefill_cached_tokens) to what the connector returns.
    params = [{k: v for k, v in out.kv_transfer_params.items() if k != "remote_prefill_cached_tokens"}
              for out in outputs.values()]
    assert all(p == params[0] for p in params)  # whichever child vLLM answers with, the same hold
    (hold,) = step(sched).meta.holds  # request_finished ran after this step's metadata: the next one carries it
    assert hold.request_id == CHILDREN[0] and params[0]["remote_hold_id"] == hold.hold_id
    assert all(out.finish_reason == FinishReason.LENGTH for out in outputs.values())
    # Only the first child's three blocks stay held; the others' were freed when they finished.
    assert set(sched.requests) == {CHILDREN[0]}
    assert num_free_blocks(sched) == free - 3
    step(sched, finished_sending={CHILDREN[0]})
    assert_scheduler_empty(sched)


def test_p_children_with_different_prompts_and_unrelated_requests_hold_their_own():
    sched = p_scheduler()
    sched.add_request(make_request(f"0_{PARENT}", tokens(40), max_tokens=1,
                                   kv_transfer_params={"do_remote_decode": True}))
    sched.add_request(make_request(f"1_{PARENT}", tokens(40, seed=5), max_tokens=1,
                                   kv_transfer_params={"do_remote_decode": True}))
    sched.add_request(make_request("0_other-parent", tokens(40), max_tokens=1,
                                   kv_transfer_params={"do_remote_decode": True}))
    st = step(sched)
    assert len({st.output(r).kv_transfer_params["remote_hold_id"] for r in sched.requests}) == 3
    assert len(step(sched).meta.holds) == 3
    step(sched, finished_sending=set(sched.requests))
    assert_scheduler_empty(sched)



# ------------------------------------------------------------------------------------------------ roles decided once
# A request's verdict and role (the reader of its hold, or a follower) are decided when vLLM first asks about it and
# kept until it ends (issue 45, finding 3). D's workers and P are played by WorkersAndP: P grants a hold to its first
# claim and refuses any claim after the hold was released, as the real P does.

SECRET = "parallel-sampling-secret-0123456789"  # D's VLLM_KVP2P_SECRET (>= 16 bytes)
EXPIRES_S = 120.0  # P signs params that expire hold_timeout (120 s by default) after it issued them


class WorkersAndP:
    """Every plan is carried out in the step that ships it; a plan that reads a hold already released fails
    (``claim refused``), so a second reader of one hold meets vLLM's kv_load_failure_policy as on real engines."""

    def __init__(self) -> None:
        self.plans: list[PullPlan] = []
        self.released: set[str] = set()
        self.refused: list[str] = []

    def step(self, sched) -> Step:
        so = sched.schedule()
        pulls = so.kv_connector_metadata.pulls
        self.plans.extend(pulls)
        recv, failed, reports = set(), set(), {}
        for plan in pulls:
            hold = plan.remote.remote_hold_id
            refused = bool(plan.num_blocks) and hold in self.released
            if refused:
                self.refused.append(plan.request_id)
            if plan.contact_p:
                self.released.add(hold)  # P is released in every outcome
            if plan.awaiting:
                recv.add(plan.request_id)
                if refused or plan.error:
                    failed.add(plan.request_id)
                reports[plan.request_id] = report(0 if refused else plan.num_blocks, ok=not refused,
                                                  reason="claim refused: hold released" if refused else "")
        blocks = {b for p in pulls if p.request_id in failed for b in p.all_local_block_ids}
        out = model_runner_output(list(so.num_scheduled_tokens), finished_recving=recv, failed_recving=failed,
                                  worker_meta=KVP2PWorkerMetadata(reports) if reports else None,
                                  load_error_blocks=blocks)
        return Step(so, [o for eco in sched.update_from_output(so, out).values() for o in eco.outputs])

    def run(self, sched, until: Callable[[list[Step]], bool] | None = None, max_steps: int = 200) -> list[Step]:
        """Step until the scheduler is empty, or ``until(steps)``."""
        steps: list[Step] = []
        while sched.requests and not (until and until(steps)):
            assert len(steps) < max_steps, f"scheduler did not drain: {list(sched.requests)}"
            steps.append(self.step(sched))
        return steps


def finish_reasons(steps: list[Step]) -> dict[str, FinishReason]:
    return {o.request_id: o.finish_reason for s in steps for o in s.outputs if o.finish_reason is not None}


def ended(request_id: str) -> Callable[[list[Step]], bool]:
    return lambda steps: request_id in finish_reasons(steps)


def asked(spy: Spy) -> set[str]:
    return {args[0].request_id for args, _ in spy.calls}


@pytest.mark.parametrize("secret", [False, True], ids=["open", "secret"])
def test_d_a_child_first_asked_after_the_reader_ended_follows_it(monkeypatch, secret):
    """vLLM adds the children one at a time: a request that comes between them and does not fit while the reader
    runs keeps the later children from being asked until after the reader ended. They follow the ended hold (D's
    prefix cache, or computed), never claim what the reader released: P refuses that, and under `fail` the child
    ends in error (the review of issue 45: children 0 and 2 `length`, child 1 `error`)."""
    if secret:  # 7 usable blocks: the reader's 3 and "big"'s 5 do not fit together
        sched, params = signed_d_scheduler(monkeypatch, Clock(monkeypatch), num_blocks=8)
    else:
        sched, params = d_scheduler(num_blocks=8), remote_params(40)
    sched.add_request(make_request(CHILDREN[0], 40, max_tokens=3, kv_transfer_params=dict(params)))
    sched.add_request(make_request("big", tokens(80, seed=7), max_tokens=3))
    for child in CHILDREN[1:]:
        sched.add_request(make_request(child, 40, max_tokens=3, kv_transfer_params=dict(params)))
    matched = Spy(sched, "get_num_new_matched_tokens")
    play = WorkersAndP()
    steps = play.run(sched, until=ended(CHILDREN[0]))
    assert asked(matched) & set(CHILDREN[1:]) == set()  # the case: not asked while the reader lived
    steps += play.run(sched)
    assert [p.request_id for p in play.plans] == [CHILDREN[0]], play.plans  # one pull for the hold, nothing more
    assert play.refused == []
    assert finish_reasons(steps) == {**{c: FinishReason.LENGTH for c in CHILDREN}, "big": FinishReason.LENGTH}
    assert_scheduler_empty(sched)


class Clock:
    """The adapter's clocks (vllm_kvp2p/connector/scheduler.py:
    the wall clock params expire by, the monotonic one of D's
    hold table), moved by the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1_800_000_000.0  # seconds
        monkeypatch.setattr(scheduler_module, "_now_ms", lambda: int(self.now * 1000))
        monkeypatch.setattr(scheduler_module, "_monotonic", lambda: self.now, raising=False)

    def advance(self, seconds: float) -> None:
        self.now += seconds


def signed_d_scheduler(monkeypatch: pytest.MonkeyPatch, clock: Clock, num_blocks: int = NUM_BLOCKS) -> tuple:
    """D with the secret, and the params P signed for the harness's 40-token prompt, expiring in EXPIRES_S."""
    monkeypatch.delenv("VLLM_KVP2P_SECRET_FILE", raising=False)
    monkeypatch.setenv("VLLM_KVP2P_SECRET", SECRET)
    sched = d_scheduler(num_blocks=num_blocks)
    assert connector_side(sched).auth is not None
    remote = RemotePrefill.from_params(remote_params(40))
    signed = Authenticator(SECRET.encode(), 30.0).sign_params(remote, int((clock.now + EXPIRES_S) * 1000))
    return sched, signed.to_params()


def test_d_followers_that_end_after_their_params_expired_leave_no_record(monkeypatch):
    """With the secret, params expire: a follower admitted in time and ending after the expiry (a long generation)
    is forgotten at its end like any other. It was judged again there, refused as expired, and kept forever: after
    MAX_HOLDS_IN_USE of them every child of a new n > 1 request planned its own pull."""
    clock = Clock(monkeypatch)
    sched, params = signed_d_scheduler(monkeypatch, clock)
    add_children(sched, params, max_tokens=6)
    play = WorkersAndP()
    steps = play.run(sched, until=lambda s: {r.request_id for r in sched.running} == set(CHILDREN))
    clock.advance(EXPIRES_S + 60)  # past the expiry and clock_skew (30 s), mid-generation
    steps += play.run(sched)
    assert [p.request_id for p in play.plans] == [CHILDREN[0]] and play.refused == []
    assert finish_reasons(steps) == {c: FinishReason.LENGTH for c in CHILDREN}
    assert_scheduler_empty(sched)


def test_d_a_follower_preempted_and_readmitted_after_the_expiry_computes_what_it_lacks(monkeypatch):
    """A follower preempted for blocks is asked again when it is re-admitted: past its params' expiry it was refused
    as `expired` and ended in error under `fail`, although a follower never contacts P."""
    clock = Clock(monkeypatch)
    # 6 blocks = 5 usable: reader A B C, follower A B D (two full blocks shared); at the 49th token each needs one
    # more, one block is left: the follower, last to run, is preempted, and re-admitted when the reader ends.
    sched, params = signed_d_scheduler(monkeypatch, clock, num_blocks=6)
    for child in CHILDREN[:2]:
        sched.add_request(make_request(child, 40, max_tokens=20, kv_transfer_params=dict(params)))
    follower = sched.requests[CHILDREN[1]]
    play = WorkersAndP()
    steps = play.run(sched, until=lambda s: follower.status == RequestStatus.RUNNING)
    clock.advance(EXPIRES_S + 60)
    steps += play.run(sched, until=lambda s: follower.num_preemptions > 0)
    assert follower.num_preemptions == 1, "the follower was never preempted; the block budget of this test is off"
    steps += play.run(sched)
    assert [p.request_id for p in play.plans] == [CHILDREN[0]] and play.refused == []
    assert finish_reasons(steps) == {c: FinishReason.LENGTH for c in CHILDREN[:2]}
    assert_scheduler_empty(sched)
