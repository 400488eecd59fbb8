"""Hostile ``kv_transfer_params`` served by vLLM's real ``Scheduler`` on D (kv_consumer), and what every example
must show (the tests: test_hostile_params_unsigned_fuzz.py, test_hostile_params_signed_fuzz.py,
test_hostile_params_each_check.py, test_scheduler_hook_guard.py).

Any client of D's HTTP API sends any JSON as a request's params, and they reach the connector's scheduler hooks
inside EngineCore, where one exception kills the engine and every request in flight. :func:`serve` serves a batch
of cases next to a genuine request and a plain one and checks, after every example:

* no exception leaves a connector hook or the scheduler, and the connector's own guard (``SchedulerSide._survive``)
  never had to catch one: every input gets a verdict, never an ``internal`` failure;
* every request ends, with the finish reason the policy gives (a failed load: ``recompute`` runs the prompt locally
  and finishes LENGTH, ``fail`` finishes ERROR; a plain or admitted request finishes LENGTH);
* exactly one plan per request that asked for a remote prefill (none for the others; at most one when aborted);
* a plan contacts P (``contact_p``) only at the valid address the params name (an IP, every rank's port inside
  ``peer_ports``), never for params that convert but were issued for another prompt, and, with a secret, only
  for exactly the params P signed; a plan loads KV only for params that cover exactly this request's prompt, and
  P's genuine params (unknown keys aside) are admitted;
* the scheduler is empty afterwards (``assert_scheduler_empty``).
"""

from __future__ import annotations

import ipaddress
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.control import currently_in_test_context
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from tests.scheduler.harness import (
    FakeWorkers,
    Step,
    assert_scheduler_empty,
    connector_side,
    make_request,
    make_scheduler,
    make_vllm_config,
    tokens,
)
from tests.scheduler.p_and_d import remote_params
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import RemotePrefill, prompt_digest
from vllm_kvp2p.lifecycle.admission import MAX_REASON
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.failure import Failure
from vllm_kvp2p.lifecycle.shared_holds import hold_key

BS = 16
NUM_BLOCKS = 400
TIGHT_BLOCKS = 8  # 7 usable: requests wait for blocks (asked again each step) and running ones get preempted
MAX_OUT = 2  # tokens each request generates: few steps per example
POLICIES = ("recompute", "fail")
SECRET = "hostile-params-fuzz-secret-0123456789"  # D's VLLM_KVP2P_SECRET (>= 16 bytes)
OTHER_SECRET = b"another-deployment-secret-987654321"
# The default peer_ports setting (docs): what params may name as P's side-channel ports.
PEER_PORTS = ((1024, 14999), (17001, 65535))
FIELDS = tuple(RemotePrefill.__struct_fields__)
FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.data_too_large])


# --------------------------------------------------------------------------- D schedulers


_engine_ids = itertools.count()


def new_d_scheduler(policy: str, secret: bool, num_blocks: int = NUM_BLOCKS) -> Scheduler:
    """A D (kv_consumer) Scheduler; with ``secret`` its connector reads VLLM_KVP2P_SECRET (never extra config)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VLLM_KVP2P_SECRET_FILE", raising=False)
        if secret:
            mp.setenv("VLLM_KVP2P_SECRET", SECRET)
        else:
            mp.delenv("VLLM_KVP2P_SECRET", raising=False)
        sched = make_scheduler(make_vllm_config(
            "kv_consumer", engine_id=f"d-fuzz-{next(_engine_ids)}", kv_load_failure_policy=policy,
            extra_config={"idle_step_sleep": 0},  # FakeWorkers report at once: idle steps need not wait
        ), num_blocks=num_blocks)
    side = connector_side(sched)
    assert (side.auth is not None) == secret
    assert side.consumer.decoder.peer_ports == PEER_PORTS
    return sched


#: What a test module's ``d_schedulers`` fixture gives: ``(policy, secret, num_blocks=NUM_BLOCKS) -> Scheduler``.
SchedulerPool = Callable[..., Scheduler]


def d_scheduler_pool() -> SchedulerPool:
    """One D scheduler per (policy, secret, number of blocks), reused by every example: empty, with its prefix
    cache reset, so each example starts from the same state. One left dirty by a failing example is replaced.
    Each test module serves it as its own module-scoped ``d_schedulers`` fixture (a Scheduler costs ms)."""
    made: dict[tuple[str, bool, int], Scheduler] = {}

    def get(policy: str, secret: bool, num_blocks: int = NUM_BLOCKS) -> Scheduler:
        key = (policy, secret, num_blocks)
        sched = made.get(key)
        if sched is None or sched.requests or not sched.reset_prefix_cache():
            sched = made[key] = new_d_scheduler(policy, secret, num_blocks)
        assert_scheduler_empty(sched)
        return sched

    get("recompute", False)  # the first Scheduler of a process is the slow one (vLLM inspects the model)
    return get


# --------------------------------------------------------------------------- one example, served and checked


@dataclass
class Case:
    request_id: str
    prompt: list[int]
    params: dict[str, Any] | None
    # The params P issued for this prompt (signed, unexpired, with D's secret): with a secret, the only params
    # that may make D contact anyone; equal params (extra keys aside) must be admitted.
    authentic: RemotePrefill | None = None
    abort: str = ""  # "before": aborted before its first schedule; "after": after the first step


def asks(params: Any) -> bool:
    return isinstance(params, dict) and bool(params.get("do_remote_prefill"))


def named_address(params: Any) -> tuple[str, int, int] | None:
    """The side channel the raw params name, if D may contact it: an IP address (never a name) and every rank's
    port (``remote_port + rank``, ranks below ``tp_size * pp_size``) inside peer_ports; None otherwise."""
    host, port = params.get("remote_host"), params.get("remote_port")
    tp, pp = params.get("tp_size", 1), params.get("pp_size", 1)
    if not (isinstance(host, str) and type(port) is int and type(tp) is int and tp >= 1 and type(pp) is int
            and pp >= 1):
        return None
    tp *= pp
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if not any(lo <= port and port + tp - 1 <= hi for lo, hi in PEER_PORTS):
        return None
    return host, port, tp


def stage(plan: PullPlan) -> str:
    """Which check refused the params (for hypothesis' statistics: the examples get past the type check)."""
    if not plan.error:
        return "admitted" if plan.awaiting else "release only"
    for words, name in (("- at `$", "type"), ("Object missing required field", "type"), ("Unicode", "unicode"),
                        ("not signed", "unsigned"), ("malformed", "mac malformed"),
                        ("does not match (changed", "mac mismatch"), ("expired", "expired"),
                        ("remote_port", "port"), ("remote_host", "host"), ("outside 1..", "num_tokens"),
                        ("remote_prompt_digest", "digest"), ("groups differ", "groups"),
                        ("block sizes", "block size"), ("blocks;", "coverage"), ("repeats", "repeated/null"),
                        ("invalid kv_transfer_params", "type")):
        if words in plan.error:
            return name
    return "other: " + plan.error[:60]


def serve(sched: Scheduler, policy: str, cases: list[Case], *, secret: bool,
          warm: list[list[int]] = ()) -> dict[str, list[PullPlan]]:
    """Serve ``cases`` (after plain requests for the ``warm`` prompts, to leave them in D's prefix cache) with
    workers that carry out every plan at once, then check everything the module docstring promises."""
    side = connector_side(sched)
    caught: list[tuple[str, str, BaseException]] = []
    guard = side._survive

    def survive(hook: str, request: Any, exc: Exception, **kwargs: Any) -> None:
        caught.append((hook, request.request_id, exc))
        guard(hook, request, exc, **kwargs)

    side._survive = survive  # type: ignore[method-assign]  # the guard still runs; we only see that it did
    workers = FakeWorkers()
    steps: list[Step] = []
    try:
        for i, prompt in enumerate(warm):
            sched.add_request(make_request(f"warm-{i}", prompt, max_tokens=1))
        if warm:
            steps += workers.run_until_empty(sched)
        for case in cases:
            sched.add_request(make_request(case.request_id, case.prompt, max_tokens=MAX_OUT,
                                           kv_transfer_params=case.params))
        sched.finish_requests([c.request_id for c in cases if c.abort == "before"], RequestStatus.FINISHED_ABORTED)
        steps.append(workers.step(sched))
        waiting = [c for c in cases if c.request_id in sched.requests
                   and sched.requests[c.request_id].status == RequestStatus.WAITING]
        sched.finish_requests([c.request_id for c in cases if c.abort == "after"], RequestStatus.FINISHED_ABORTED)
        steps += workers.run_until_empty(sched)
    finally:
        del side._survive
    assert not caught, f"the connector's guard had to catch {caught!r}: hostile params must get a verdict"
    if currently_in_test_context():
        if waiting:
            event("a request waited for blocks")
        if any(getattr(s.so, "preempted_req_ids", None) for s in steps):
            event("a request was preempted")

    plans: dict[str, list[PullPlan]] = {}
    for plan in workers.plans:
        plans.setdefault(plan.request_id, []).append(plan)
    finished: dict[str, list[FinishReason]] = {}
    for s in steps:
        for out in s.outputs:
            if out.finish_reason is not None:
                finished.setdefault(out.request_id, []).append(out.finish_reason)
    assert set(plans) <= {c.request_id for c in cases}, plans

    auth = Authenticator(SECRET.encode(), 30.0) if secret else None
    # Requests whose admitted params name one hold for one prompt share its pull (vLLM's n > 1 children): the first
    # to plan reads it, the others make no plan at all (vllm_kvp2p/lifecycle/shared_holds.py).
    readers = {hold_key(p.remote): p.request_id for p in workers.plans if not p.error}
    for case in cases:
        mine, ends = plans.get(case.request_id, []), finished.get(case.request_id, [])
        if not asks(case.params):
            assert mine == [], (case, mine)
        elif not mine and _follows(case, readers):
            pass
        elif case.abort:
            assert len(mine) <= 1, (case, mine)
        else:
            assert len(mine) == 1, (case, mine)
        for plan in mine:
            check_plan(case, plan, auth)
            if currently_in_test_context() and case.request_id != "control":
                event(stage(plan))
        if case.abort:
            assert len(ends) <= 1, (case, ends)
            continue
        failed_load = bool(mine) and bool(mine[0].error) and mine[0].awaiting
        expected = FinishReason.ERROR if failed_load and policy == "fail" else FinishReason.LENGTH
        assert ends == [expected], (case, mine, ends)
    assert_scheduler_empty(sched)
    return plans


def _follows(case: Case, readers: dict[Any, str]) -> bool:
    """Whether the case's params convert and name a hold another request of the same prompt read."""
    try:
        remote = RemotePrefill.from_params(case.params)
    except Exception:  # noqa: BLE001 - params that do not convert follow no one
        return False
    if remote is None:
        return False
    reader = readers.get(hold_key(remote))
    return reader is not None and reader != case.request_id


def check_plan(case: Case, plan: PullPlan, auth: Authenticator | None) -> None:
    converted = RemotePrefill.from_params(case.params)
    assert plan.failure is not Failure.INTERNAL and not plan.error.startswith("internal"), (case, plan)
    if plan.error:
        assert plan.failure in (Failure.INVALID_PARAMS, Failure.UNAUTHENTICATED), plan
        assert len(plan.error) <= MAX_REASON + len(" [cut]")
        if plan.awaiting:
            assert plan.remote_block_ids == ()  # nothing is read
    if case.abort == "before":
        assert not plan.awaiting and plan.local_block_ids == ()  # a release, nothing else
    if plan.contact_p:
        # Contacted: exactly the side channel the params name, a valid one; with a secret, params P signed.
        remote = plan.remote
        assert named_address(case.params) == (remote.remote_host, remote.remote_port, remote.num_ranks), (case, plan)
        if auth is not None:
            assert converted is not None and converted == case.authentic, ("contacts P for forged params", case)
            assert auth.params_problem(converted, time.time_ns() // 1_000_000) == ""
        if converted is not None:
            assert plan.remote == converted
            n = converted.remote_num_tokens
            if n <= len(case.prompt):  # never another prompt's params (that request may still claim the hold)
                assert converted.remote_prompt_digest == prompt_digest(case.prompt[:n]), (case, plan)
    if not plan.error and plan.awaiting:
        # D loads KV: only what P computed for exactly this prompt, block for block.
        assert converted is not None and plan.contact_p
        n, p_bs = converted.remote_num_tokens, converted.remote_block_size
        assert n <= len(case.prompt)
        assert converted.remote_prompt_digest == prompt_digest(case.prompt[:n])
        (offered,) = converted.remote_block_ids
        assert len(offered) == math.ceil(n / p_bs) and 0 not in offered and len(set(offered)) == len(offered)
        assert p_bs % BS == 0 or BS % p_bs == 0
        assert set(plan.remote_block_ids[0]) <= set(offered)
    if (converted is not None and converted == case.authentic and converted.remote_num_tokens <= len(case.prompt)
            and converted.remote_prompt_digest == prompt_digest(case.prompt[: converted.remote_num_tokens])):
        assert not plan.error, ("genuine params refused", case, plan)  # the checks still let P's params through


# --------------------------------------------------------------------------- params as P issues them


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def sign(remote: RemotePrefill, *, secret: bytes = SECRET.encode(), expires_in_ms: int = 600_000) -> RemotePrefill:
    return Authenticator(secret, 30.0).sign_params(remote, now_ms() + expires_in_ms)


def genuine(prompt: list[int], num_tokens: int, request_id: str) -> RemotePrefill:
    """What P issues for the first ``num_tokens`` of ``prompt`` (like p_and_d.remote_params)."""
    made = RemotePrefill.from_params(remote_params(num_tokens, prompt=prompt, request_id=request_id,
                                                   hold_id=f"hold-{request_id}"))
    assert made is not None
    return made


def control(seed: int, *, secret: bool) -> Case:
    """A genuine request in the same batch: it must be served as if nothing else happened."""
    prompt = tokens(40, seed)
    remote = genuine(prompt, 40, "p-control")
    if secret:
        remote = sign(remote)
    return Case("control", prompt, remote.to_params(), authentic=remote)
