"""Hostile ``kv_transfer_params`` against vLLM's real ``Scheduler`` on D with no shared secret, on every supported
vLLM. Hypothesis draws params (any JSON value for each field; genuine params with a few fields made hostile; params
forged to pass the prompt and coverage checks), serves them with both of vLLM's ``kv_load_failure_policy`` values
next to a genuine request and a plain one, and checks after every example what tests/scheduler/hostile_params.py
``serve`` promises: no exception, never an ``internal`` failure, every request ended as the policy says, one plan
per request, P contacted only at the valid address the params name, KV loaded only for params that cover exactly
the prompt, the scheduler empty."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scheduler.harness import tokens
from tests.scheduler.hostile_params import (
    BS,
    FUZZ,
    NUM_BLOCKS,
    POLICIES,
    TIGHT_BLOCKS,
    Case,
    SchedulerPool,
    control,
    d_scheduler_pool,
    genuine,
    serve,
)
from tests.scheduler.hostile_params_strategies import ABORTS, any_json_params, forged, mutate, prompts


@pytest.fixture(scope="module")
def d_schedulers() -> SchedulerPool:
    return d_scheduler_pool()


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
