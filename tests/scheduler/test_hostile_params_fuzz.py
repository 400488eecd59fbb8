"""Hostile ``kv_transfer_params`` against vLLM's real ``Scheduler`` on D (kv_consumer), on every supported vLLM.

Any client of D's HTTP API sends any JSON as a request's params, and they reach the connector's scheduler hooks
inside EngineCore, where one exception kills the engine and every request in flight. Hypothesis draws params (any
JSON value for each field; genuine params with a few fields made hostile; params forged to pass the prompt and
coverage checks; with a shared secret, signed params with hostile signatures), serves them with both of vLLM's
``kv_load_failure_policy`` values next to a genuine request and a plain one, and checks after every example:

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

The guard itself is checked deterministically: a connector bug injected into one request's hook fails that
request's load under the policy, the others are served, the error is logged once with its traceback; without the
guard the same bug escapes ``Scheduler.schedule()``.
"""

from __future__ import annotations

import copy
import hmac
import ipaddress
import itertools
import logging
import math
import operator
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
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
from vllm_kvp2p.connector.scheduler import SchedulerSide
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import MAX_BLOCK_ID, MAX_BLOCK_SIZE, MAX_TOKENS, RemotePrefill, prompt_digest
from vllm_kvp2p.lifecycle import consumer as consumer_module
from vllm_kvp2p.lifecycle.admission import MAX_REASON
from vllm_kvp2p.lifecycle.consumer import ConsumerSchedule, PullPlan
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


@pytest.fixture(scope="module")
def d_schedulers() -> Iterator[Callable[..., Scheduler]]:
    """One D scheduler per (policy, secret, number of blocks), reused by every example: empty, with its prefix
    cache reset, so each example starts from the same state. One left dirty by a failing example is replaced."""
    made: dict[tuple[str, bool, int], Scheduler] = {}

    def get(policy: str, secret: bool, num_blocks: int = NUM_BLOCKS) -> Scheduler:
        key = (policy, secret, num_blocks)
        sched = made.get(key)
        if sched is None or sched.requests or not sched.reset_prefix_cache():
            sched = made[key] = new_d_scheduler(policy, secret, num_blocks)
        assert_scheduler_empty(sched)
        return sched

    get("recompute", False)  # the first Scheduler of a process is the slow one (vLLM inspects the model)
    yield get


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


# --------------------------------------------------------------------------- strategies

SPECIAL_TEXT = ["", " ", "é…", "é" * 64, "\ud800", "\udfff", "a\ud800b", "\x00", "\n", "ａｂｃ", "٠١٢",
                "127.0.0.1", "::1", "[::1]", "localhost", "0.0.0.0", "fe80::1%eth0", "1.2.3.4\n", "p-req", "hold-1"]
LONG_TEXT = st.builds(operator.mul, st.sampled_from(["a", "é", "\ud800", "0", "1.", "…"]),
                      st.sampled_from([10**5, 253, 254, 256, 257, 64]))
SURROGATES = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=8)
TEXT = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(exclude_categories=()), max_size=12),  # any code point, lone surrogates included
    SURROGATES, LONG_TEXT, st.sampled_from(SPECIAL_TEXT),
)
INTS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2, 15, 16, 17, 40, 65535, 65536, 2**31, 2**62 - 1, 2**62, 2**63, 2**64, 10**30,
                     -(10**30), MAX_TOKENS, MAX_TOKENS + 1, MAX_BLOCK_ID, MAX_BLOCK_ID + 1]),
)
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([1e308, -1e308, 16.0, 40.0, 0.5, -0.0, 5e-324]))
KEYS = st.one_of(st.text(max_size=8), st.sampled_from(FIELDS), SURROGATES)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSON = st.recursive(SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(KEYS, kids,
                                                                                                max_size=4)),
                    max_leaves=10)
EXTRA_KEYS = st.dictionaries(  # a key with a lone surrogate makes the params unconvertible: not too often
    st.one_of(st.text(max_size=10), st.text(max_size=10), st.text(max_size=10), SURROGATES,
              st.sampled_from(["kvp2p_test_corrupt", "kvp2p_last_token_held_back", "kvp2p_pull", "__proto__"]))
    .filter(lambda k: k not in FIELDS),
    JSON, max_size=2)

BLOCK_ID = st.one_of(st.integers(0, 400), st.sampled_from([0, -1, MAX_BLOCK_ID, MAX_BLOCK_ID + 1, 2**63, 10**30]))
BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 24, 48, 1 << 20]
# Values close to each field's type: they pass or barely fail the type check, so the later checks see them.
TYPED: dict[str, st.SearchStrategy[Any]] = {
    "remote_engine_id": TEXT,
    "remote_request_id": TEXT,
    "remote_hold_id": TEXT,
    "remote_incarnation": TEXT,
    "remote_host": st.one_of(TEXT, st.sampled_from([
        "127.0.0.1", "::1", "[::1]", "10.0.0.1", "0.0.0.0", "255.255.255.255", "fe80::1%eth0", "::ffff:127.0.0.1",
        "localhost", "p.example.com", "127.0.0.1 ", " 127.0.0.1", "127.0.0.1\x00", "256.0.0.1", "1.2.3",
        "127.0.0.1:14600", "http://127.0.0.1", "[127.0.0.1]", "１２７.０.０.１", "a" * 253, "1" * 254])),
    "remote_port": st.one_of(INTS, st.sampled_from([-1, 0, 1, 1023, 1024, 14999, 15000, 17000, 17001, 65535,
                                                    65536])),
    "tp_size": st.one_of(INTS, st.sampled_from([0, 1, 2, 400, 1024, 1025, 50_000])),
    "pp_size": st.one_of(INTS, st.sampled_from([0, 1, 2, 64, 65, 1 << 40])),
    "remote_block_ids": st.one_of(
        st.lists(st.lists(BLOCK_ID, max_size=8), max_size=3),
        st.sampled_from([[], [[]], [[1, 1, 1]], [[0, 1, 2]], [[1, 2, 3], [4, 5, 6]], [[7, 8, 9]] * 65,
                         [[[1]]], [["1", "2", "3"]], [[1.0, 2.0, 3.0]], [[True, False]], [[None]], {"0": [1]}])),
    "remote_num_tokens": st.one_of(INTS, st.integers(-2, 100)),
    "remote_block_size": st.one_of(INTS, st.sampled_from([0, *BLOCK_SIZES, MAX_BLOCK_SIZE + 1, -16])),
    "do_remote_prefill": st.sampled_from([True, False, 1, 0, "yes", "", "false", None, [], [0], {}, {"a": 1}]),
    "do_remote_decode": st.sampled_from([True, False, 1, 0, "yes", "", None, [], {}]),
    "remote_prompt_digest": st.one_of(TEXT, st.sampled_from(["", "0" * 32, "0" * 31, "g" * 32, "0" * 256])),
    "expires_ms": st.one_of(INTS, st.sampled_from([0, -1, 1 << 62, (1 << 62) + 1])),
    "mac": st.one_of(TEXT, st.sampled_from(["", "é…", "é" * 64, "\ud800" * 64, "a" * 63, "a" * 65, "A" * 64,
                                            "0" * 64, "g" * 64, "０" * 64, "a" * 256, "a" * 257])),
}
ANY_CHAR_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)  # lone surrogates included
HOSTS = ["127.0.0.1", "::1", "[::1]", "10.0.0.1", "0.0.0.0", "255.255.255.255", "fe80::1%eth0", "::ffff:127.0.0.1",
         "localhost", "p.example.com", "127.0.0.1 ", "256.0.0.1", "1.2.3", "127.0.0.1:14600", "[127.0.0.1]"]
# Values of each field's type and within its bounds: they pass the type check, so the later checks judge them.
IN_TYPE: dict[str, st.SearchStrategy[Any]] = {
    "remote_engine_id": ANY_CHAR_TEXT.filter(bool),
    "remote_request_id": ANY_CHAR_TEXT.filter(bool),
    "remote_hold_id": st.one_of(ANY_CHAR_TEXT.filter(bool), st.just("h" * 256)),
    "remote_incarnation": ANY_CHAR_TEXT,
    "remote_host": st.one_of(st.sampled_from(HOSTS), ANY_CHAR_TEXT.filter(bool)),
    "remote_port": st.one_of(st.integers(1, 65535), st.sampled_from([1, 1023, 1024, 14999, 15000, 17000, 17001,
                                                                     65535])),
    "tp_size": st.one_of(st.integers(1, 1024), st.sampled_from([1, 2, 1024])),
    "pp_size": st.one_of(st.integers(1, 64), st.sampled_from([1, 2, 64])),
    "remote_block_ids": st.lists(st.lists(st.one_of(st.integers(0, 400), st.just(MAX_BLOCK_ID)), max_size=8),
                                 min_size=1, max_size=3),
    "remote_num_tokens": st.one_of(st.integers(1, 100), st.sampled_from([MAX_TOKENS])),
    "remote_block_size": st.one_of(st.sampled_from(BLOCK_SIZES), st.integers(1, MAX_BLOCK_SIZE)),
    "do_remote_prefill": st.just(True),
    "do_remote_decode": st.booleans(),
    "remote_prompt_digest": st.one_of(ANY_CHAR_TEXT, st.sampled_from(["", "0" * 32])),
    "expires_ms": st.integers(0, 1 << 62),
    "mac": st.one_of(ANY_CHAR_TEXT, st.sampled_from(["é" * 64, "a" * 64, "A" * 64])),
}
assert set(TYPED) == set(FIELDS) == set(IN_TYPE)
# The fields mutations pick: those the checks past the type judge come twice (address, prompt, coverage, signature).
DEEP = ("remote_block_ids", "remote_num_tokens", "remote_block_size", "remote_host", "remote_port", "tp_size",
        "pp_size",
        "remote_prompt_digest", "mac", "expires_ms")
MUTATED = DEEP + FIELDS
SCALAR_FIELDS = [f for f in FIELDS if f != "do_remote_prefill"]

# What a client might do to the mac of params P signed (the last four are not ASCII; compare_digest raised on them).
MAC_TWEAKS: dict[str, Callable[[str], str]] = {
    "upper": str.upper,
    "flip-last": lambda m: m[:-1] + ("1" if m[-1] == "0" else "0"),
    "short": lambda m: m[:-1],
    "long": lambda m: m + "0",
    "leading-space": lambda m: " " + m[1:],
    "trailing-newline": lambda m: m + "\n",
    "newline-inside": lambda m: m[:-1] + "\n",
    "fullwidth": lambda m: m.translate({c: c + 0xFEE0 for c in range(0x21, 0x7F)}),
    "e-acute": lambda m: m[:-1] + "é",
    "ellipsis": lambda m: m[:-2] + "é…",
    "surrogate": lambda m: m[:-1] + "\ud800",
}
HOSTILE_MACS = st.one_of(
    st.sampled_from(["é…", "é" * 64, "\ud800" * 64, "\ud800", "é" * 32, "a" * 63, "a" * 65, "g" * 64, "", "a" * 257]),
    TEXT,
)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def sign(remote: RemotePrefill, *, secret: bytes = SECRET.encode(), expires_in_ms: int = 600_000) -> RemotePrefill:
    return Authenticator(secret, 30.0).sign_params(remote, now_ms() + expires_in_ms)


@st.composite
def prompts(draw: st.DrawFn, seed: int) -> list[int]:
    """A prompt of its own (seed): no prefix shared with another request of the example."""
    return tokens(draw(st.integers(1, 70) | st.sampled_from([1, 2, 16, 17, 32, 33])), seed)


@st.composite
def mutate(draw: st.DrawFn, params: dict[str, Any], max_fields: int = 3) -> dict[str, Any]:
    """``params`` with one to ``max_fields`` fields replaced (mostly by a value of the field's type, so that the
    later checks judge it; or just outside its type or bounds; or by any JSON value) or removed, and perhaps
    unknown keys added."""
    out = copy.deepcopy(params)
    for name in draw(st.lists(st.sampled_from(MUTATED), min_size=1, max_size=max_fields, unique=True)):
        how = draw(st.sampled_from(["in type", "in type", "in type", "near type", "json", "delete"]))
        if how == "delete":
            out.pop(name, None)
        else:
            out[name] = draw({"in type": IN_TYPE, "near type": TYPED}.get(how, {}).get(name, JSON))
    if draw(st.integers(0, 2)) == 0:
        out.update(draw(EXTRA_KEYS))
    return out


@st.composite
def any_json_params(draw: st.DrawFn) -> dict[str, Any]:
    """do_remote_prefill and, for each other field of RemotePrefill (each perhaps absent), any JSON value."""
    fields = draw(st.fixed_dictionaries({}, optional={f: JSON for f in SCALAR_FIELDS}))
    return {**draw(EXTRA_KEYS), **fields, "do_remote_prefill": True}


def genuine(prompt: list[int], num_tokens: int, request_id: str) -> RemotePrefill:
    """What P issues for the first ``num_tokens`` of ``prompt`` (like p_and_d.remote_params)."""
    made = RemotePrefill.from_params(remote_params(num_tokens, prompt=prompt, request_id=request_id,
                                                   hold_id=f"hold-{request_id}"))
    assert made is not None
    return made


@st.composite
def forged(draw: st.DrawFn, prompt: list[int]) -> dict[str, Any]:
    """Params anyone can make without a secret that pass the type, address and prompt checks: the digest of the
    prompt's first n tokens is public. What is left to refuse them is coverage; or they are admitted, and then
    the plan must map them onto vLLM's blocks exactly."""
    n = draw(st.integers(1, len(prompt) + 1))
    p_bs = draw(st.sampled_from(BLOCK_SIZES))
    want = math.ceil(n / p_bs)
    count = max(0, want + draw(st.sampled_from([0, 0, 0, -1, 1])))
    ids = draw(st.one_of(
        st.lists(st.integers(1, MAX_BLOCK_ID), min_size=count, max_size=count, unique=True),
        st.lists(BLOCK_ID.filter(lambda b: isinstance(b, int) and 0 <= b <= MAX_BLOCK_ID), min_size=count,
                 max_size=count),
    ))
    groups = [ids] + draw(st.sampled_from([[], [], [], [ids]]))
    tp = draw(st.sampled_from([1, 1, 2, 4]))
    return RemotePrefill(
        remote_engine_id=draw(st.sampled_from(["P", "p-engine-0", "é"])),
        remote_request_id=draw(st.sampled_from(["p-req", "x" * 256])),
        remote_host=draw(st.sampled_from(["127.0.0.1", "10.1.2.3", "::1", "[::1]", "fe80::1%eth0"])),
        remote_port=draw(st.sampled_from([1024, 14600, 14999 - tp + 1, 17001, 65535 - tp + 1])),
        remote_block_ids=groups,
        remote_hold_id=draw(st.sampled_from(["hold", "é…", "h" * 256])),
        remote_num_tokens=n,
        remote_block_size=p_bs,
        tp_size=tp,
        remote_prompt_digest=prompt_digest(prompt[: min(n, len(prompt))]),
    ).to_params()


def control(seed: int, *, secret: bool) -> Case:
    """A genuine request in the same batch: it must be served as if nothing else happened."""
    prompt = tokens(40, seed)
    remote = genuine(prompt, 40, "p-control")
    if secret:
        remote = sign(remote)
    return Case("control", prompt, remote.to_params(), authentic=remote)


ABORTS = st.sampled_from(["", "", "", "", "before", "after"])


# --------------------------------------------------------------------------- hypothesis: no secret on D


@settings(FUZZ, max_examples=60)
@given(policy=st.sampled_from(POLICIES), data=st.data())
def test_any_json_value_for_each_field(d_schedulers, policy: str, data: st.DataObject) -> None:
    """Every field of RemotePrefill (and unknown keys) any JSON value, lone surrogates, 10^5-character strings,
    10**30 and 1e308 included: refused at the type check (or the Unicode check), each request's load fails under
    the policy, no one is contacted but a valid address the params happen to name (to release its hold), and the
    engine serves on."""
    cases = [Case(f"h{i}", data.draw(prompts(seed=10 + i)), data.draw(any_json_params()),
                  abort=data.draw(ABORTS)) for i in range(data.draw(st.integers(1, 3)))]
    serve(d_schedulers(policy, False), policy, [*cases, control(1, secret=False)], secret=False)


@settings(FUZZ, max_examples=120)
@given(policy=st.sampled_from(POLICIES), blocks=st.sampled_from([NUM_BLOCKS, TIGHT_BLOCKS]), data=st.data())
def test_genuine_params_with_hostile_fields(d_schedulers, policy: str, blocks: int, data: st.DataObject) -> None:
    """P's params for the request's own prompt with up to three fields made hostile (near their type, or any
    JSON, or removed) and unknown keys added: the examples reach every check (address, digest, coverage). With
    few blocks, requests also wait for blocks (judged again each step), are aborted while waiting, preempted."""
    cases = []
    for i in range(data.draw(st.integers(1, 3))):
        prompt = data.draw(prompts(seed=10 + i))
        remote = genuine(prompt, data.draw(st.integers(1, len(prompt))), f"p{i}")
        cases.append(Case(f"h{i}", prompt, data.draw(mutate(remote.to_params())), authentic=remote,
                          abort=data.draw(ABORTS)))
    serve(d_schedulers(policy, False, blocks), policy, [*cases, control(1, secret=False)], secret=False)


@settings(FUZZ, max_examples=80)
@given(policy=st.sampled_from(POLICIES), data=st.data())
def test_forged_params_that_pass_the_prompt_check(d_schedulers, policy: str, data: st.DataObject) -> None:
    """Without a secret anyone can compute a prompt's digest: forged params naming any block ids and block size,
    perhaps after D cached part of the prompt itself. Each is refused for its coverage, or admitted and planned
    onto exactly the blocks vLLM allocated (never an internal failure, never a request left waiting)."""
    cases, warm = [], []
    for i in range(data.draw(st.integers(1, 3))):
        prompt = data.draw(prompts(seed=10 + i))
        local_blocks = data.draw(st.integers(0, len(prompt) // BS))
        if local_blocks:  # D already caches the first blocks (a plain request that shared them ran before)
            warm.append(prompt[: local_blocks * BS] + tokens(3, seed=50 + i))
        params = data.draw(forged(prompt))
        if data.draw(st.booleans()):
            params = data.draw(mutate(params, max_fields=1))
        cases.append(Case(f"h{i}", prompt, params, abort=data.draw(ABORTS)))
    serve(d_schedulers(policy, False), policy, [*cases, control(1, secret=False)], secret=False, warm=warm)


# --------------------------------------------------------------------------- hypothesis: a shared secret on D


@st.composite
def signed_cases(draw: st.DrawFn, index: int) -> Case:
    prompt = draw(prompts(seed=10 + index))
    remote = genuine(prompt, draw(st.integers(1, len(prompt))), f"p{index}")
    base = draw(st.sampled_from(["signed", "signed", "signed", "expired", "other secret", "unsigned", "any json"]))
    authentic = None
    if base == "any json":
        return Case(f"h{index}", prompt, draw(any_json_params()), abort=draw(ABORTS))
    if base == "signed":
        issued = authentic = sign(remote)
    elif base == "expired":
        issued = sign(remote, expires_in_ms=-120_000)  # beyond clock_skew (30 s)
    elif base == "other secret":
        issued = sign(remote, secret=OTHER_SECRET)
    else:
        issued = remote
    params = issued.to_params()
    how = draw(st.sampled_from(["as issued", "mac tweak", "mac tweak", "mac", "fields", "fields", "mac and fields"]))
    if how == "mac tweak" and issued.mac:
        params["mac"] = MAC_TWEAKS[draw(st.sampled_from(sorted(MAC_TWEAKS)))](issued.mac)
    elif how in ("mac", "mac and fields"):
        params["mac"] = draw(HOSTILE_MACS)
    if how in ("fields", "mac and fields"):
        params = draw(mutate(params))
    return Case(f"h{index}", prompt, params, authentic=authentic, abort=draw(ABORTS))


@settings(FUZZ, max_examples=120)
@given(policy=st.sampled_from(POLICIES), data=st.data())
def test_signed_params_with_hostile_fields_and_signatures(d_schedulers, policy: str, data: st.DataObject) -> None:
    """D has a shared secret. Params P signed for the prompt (or expired, or signed with another secret, or not
    signed), with hostile macs (non-ASCII, lone surrogates, wrong lengths, P's mac changed) and hostile fields: a
    plan contacts P only for exactly the params P signed, and nothing a client sends kills the engine."""
    cases = [data.draw(signed_cases(i)) for i in range(data.draw(st.integers(1, 3)))]
    serve(d_schedulers(policy, True), policy, [*cases, control(1, secret=True)], secret=True)


# --------------------------------------------------------------------------- the mac that used to kill EngineCore


def test_compare_digest_raises_on_non_ascii_text() -> None:
    """The hole: before the signature's format was checked, D compared the mac a client sent with
    hmac.compare_digest on str, which raises TypeError for non-ASCII text, in the scheduler, killing EngineCore
    with every request in flight. The tests below send exactly such macs through vLLM's Scheduler."""
    with pytest.raises(TypeError):
        hmac.compare_digest("é" * 64, "a" * 64)
    with pytest.raises(TypeError):
        hmac.compare_digest("é…", "a" * 64)
    with pytest.raises(UnicodeEncodeError):
        ("\ud800" * 64).encode()
    assert hmac.compare_digest("a" * 64, "a" * 64)  # ASCII str was always fine


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("mac", "expected"), [
    ("é" * 64, "signature is malformed"),
    ("é…", "signature is malformed"),
    ("\ud800" * 64, "mac is not valid Unicode"),
    ("a" * 63, "signature is malformed"),
    ("a" * 65, "signature is malformed"),
    ("A" * 64, "signature is malformed"),
    ("a" * 257, "Expected `str` of length <= 256 - at `$.mac`"),
], ids=["e-acute-64", "e-acute-ellipsis", "lone-surrogates", "63-hex", "65-hex", "upper-hex", "257-chars"])
def test_non_ascii_or_malformed_mac_fails_one_load(d_schedulers, policy: str, mac: str, expected: str) -> None:
    """The macs that raised in compare_digest, through the real Scheduler next to a genuine request: the one
    request's load fails (unauthenticated or invalid, contacting no one), the genuine one is served."""
    prompt = tokens(40, seed=3)
    params = sign(genuine(prompt, 40, "p-mac")).to_params()
    params["mac"] = mac
    plans = serve(d_schedulers(policy, True), policy, [Case("h-mac", prompt, params), control(1, secret=True)],
                  secret=True)
    (plan,) = plans["h-mac"]
    assert expected in plan.error and not plan.contact_p and plan.awaiting
    (ok,) = plans["control"]
    assert not ok.error and ok.contact_p


# --------------------------------------------------------------------------- every check is reached


def _set(**fields: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda params: {**params, **fields}


def _without(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda params: {k: v for k, v in params.items() if k != name}


PROMPT = tokens(40, seed=4)


@dataclass(frozen=True)
class Check:
    secret: bool
    params: dict[str, Any]
    words: str  # in the reason; "" admitted
    failure: Failure | None
    contact_p: bool  # to release P's hold: P authentic (with a secret) and addressable
    authentic: RemotePrefill | None = None  # with a secret: params P signed


def checks() -> dict[str, Check]:
    """Made when the test runs: signatures expire."""
    unsigned = genuine(PROMPT, 40, "p-check")
    signed = sign(unsigned)
    signed_too_long = sign(msgspec.structs.replace(unsigned, remote_num_tokens=41))  # P's, for a longer prompt
    return {
        "type": Check(False, _without("remote_host")(unsigned.to_params()), "missing required field `remote_host`",
                      Failure.INVALID_PARAMS, False),
        "unicode": Check(False, _set(remote_hold_id="h\ud800")(unsigned.to_params()),
                         "remote_hold_id is not valid Unicode", Failure.INVALID_PARAMS, False),
        "host": Check(False, _set(remote_host="localhost")(unsigned.to_params()), "is not an IP address",
                      Failure.INVALID_PARAMS, False),
        "port": Check(False, _set(remote_port=15000)(unsigned.to_params()), "not inside the allowed side-channel ports",
                      Failure.INVALID_PARAMS, False),
        "tp ports": Check(False, _set(remote_port=14999, tp_size=2)(unsigned.to_params()), "ports 14999..15000",
                          Failure.INVALID_PARAMS, False),
        "too many tokens": Check(False, _set(remote_num_tokens=41)(unsigned.to_params()), "outside 1..40",
                                 Failure.INVALID_PARAMS, True),
        "damaged, addressable": Check(False, _set(remote_block_ids=[])(unsigned.to_params()),
                                      "Expected `array` of length >= 1 - at `$.remote_block_ids`",
                                      Failure.INVALID_PARAMS, True),  # without a secret its hold is released
        "damaged, not addressable": Check(False, _set(remote_block_ids=[], remote_port=80)(unsigned.to_params()),
                                          "Expected `array` of length >= 1", Failure.INVALID_PARAMS, False),
        "no digest": Check(False, _without("remote_prompt_digest")(unsigned.to_params()),
                           "remote_prompt_digest is missing", Failure.INVALID_PARAMS, False),
        "other prompt": Check(False, _set(remote_prompt_digest=prompt_digest(tokens(40, seed=5)))(unsigned.to_params()),
                              "does not match this request's first 40", Failure.INVALID_PARAMS, False),
        "groups": Check(False, _set(remote_block_ids=[[200, 201, 202]] * 2)(unsigned.to_params()),
                        "KV-cache groups differ", Failure.INVALID_PARAMS, True),
        "block size": Check(False, _set(remote_block_size=24)(unsigned.to_params()), "P uses 24, D uses 16",
                            Failure.INVALID_PARAMS, True),
        "too few blocks": Check(False, _set(remote_block_ids=[[200, 201]])(unsigned.to_params()), "has 2 blocks",
                                Failure.INVALID_PARAMS, True),
        "null block": Check(False, _set(remote_block_ids=[[200, 0, 202]])(unsigned.to_params()), "names block 0",
                            Failure.INVALID_PARAMS, True),
        "repeated block": Check(False, _set(remote_block_ids=[[200, 200, 202]])(unsigned.to_params()),
                                "repeats a block id", Failure.INVALID_PARAMS, True),
        "admitted": Check(False, unsigned.to_params(), "", None, True),
        # Its own hold: one hold named twice for one prompt is read once, by the first (vLLM's n > 1 children).
        "admitted, extra keys": Check(False, {**unsigned.to_params(), "remote_hold_id": "other-hold", "é": ["\ud800"],
                                              "x": 10**30}, "", None, True),
        "unsigned": Check(True, unsigned.to_params(), "are not signed", Failure.UNAUTHENTICATED, False),
        "mac mismatch": Check(True, _set(mac=MAC_TWEAKS["flip-last"](signed.mac))(signed.to_params()),
                              "signature does not match", Failure.UNAUTHENTICATED, False),
        "signed field changed": Check(True, _set(remote_port=14601)(signed.to_params()), "signature does not match",
                                      Failure.UNAUTHENTICATED, False),
        "other secret": Check(True, sign(unsigned, secret=OTHER_SECRET).to_params(), "signature does not match",
                              Failure.UNAUTHENTICATED, False),
        "expired": Check(True, sign(unsigned, expires_in_ms=-120_000).to_params(), "expired", Failure.UNAUTHENTICATED,
                         False),
        "damaged, signed": Check(True, _set(remote_block_ids=[])(signed.to_params()), "Expected `array` of length >= 1",
                                 Failure.INVALID_PARAMS, False),
        "signed, other prompt": Check(True, sign(genuine(tokens(40, seed=5), 40, "p-check")).to_params(),
                                      "does not match this request's first 40", Failure.INVALID_PARAMS, False),
        "mac malformed": Check(True, _set(mac="é…")(signed.to_params()), "signature is malformed",
                               Failure.UNAUTHENTICATED, False),
        "signed, too many tokens": Check(True, signed_too_long.to_params(), "outside 1..40", Failure.INVALID_PARAMS,
                                         True, authentic=signed_too_long),
        "signed, admitted": Check(True, signed.to_params(), "", None, True, authentic=signed),
    }


@pytest.mark.parametrize("secret", [False, True], ids=["no-secret", "secret"])
def test_each_check_is_reached_through_the_scheduler(d_schedulers, secret: bool) -> None:
    """One request per check of admission.judge in one batch, each refused by its own check (or admitted): the
    fuzzers' inputs are not all stopped at the type check, and a refusal contacts P only when P is authentic and
    addressable (to release its hold)."""
    table = {name: check for name, check in checks().items() if check.secret == secret}
    unsigned = genuine(PROMPT, 40, "p-check")
    cases = [Case(f"c{i}", PROMPT, check.params, authentic=check.authentic if secret else unsigned)
             for i, check in enumerate(table.values())]
    plans = serve(d_schedulers("fail", secret), "fail", cases, secret=secret)
    for case, (name, check) in zip(cases, table.items()):
        (plan,) = plans[case.request_id]
        assert plan.awaiting, name
        if check.words:
            assert check.words in plan.error and plan.failure is check.failure, (name, plan.error)
        else:
            assert plan.error == "", (name, plan.error)
        assert plan.contact_p is check.contact_p, (name, plan)


# --------------------------------------------------------------------------- the guard itself


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
