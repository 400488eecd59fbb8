"""Hostile ``kv_transfer_params`` against vLLM's real ``Scheduler`` on D with a shared secret: signed params with
hostile fields and hostile signatures (hypothesis; the checks of tests/scheduler/hostile_params.py ``serve``, and a
plan contacts P only for exactly the params P signed), and the macs that used to kill EngineCore (non-ASCII text
compared with ``hmac.compare_digest``) sent one by one through the Scheduler next to a genuine request."""

from __future__ import annotations

import hmac

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scheduler.harness import tokens
from tests.scheduler.hostile_params import (
    FUZZ,
    OTHER_SECRET,
    POLICIES,
    Case,
    SchedulerPool,
    control,
    d_scheduler_pool,
    genuine,
    serve,
    sign,
)
from tests.scheduler.hostile_params_strategies import ABORTS, HOSTILE_MACS, MAC_TWEAKS, any_json_params, mutate, prompts


@pytest.fixture(scope="module")
def d_schedulers() -> SchedulerPool:
    return d_scheduler_pool()


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
