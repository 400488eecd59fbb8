"""Every check of ``admission.judge`` is reached through vLLM's real ``Scheduler`` on D: one request per check in
one batch, each refused by its own check (or admitted), with and without a shared secret, so the fuzzers' inputs
are not all stopped at the type check; a refusal contacts P only when P is authentic and addressable (to release
its hold)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from tests.scheduler.harness import tokens
from tests.scheduler.hostile_params import OTHER_SECRET, Case, SchedulerPool, d_scheduler_pool, genuine, serve, sign
from tests.scheduler.hostile_params_strategies import MAC_TWEAKS
from vllm_kvp2p.contract.protocol import RemotePrefill, prompt_digest
from vllm_kvp2p.lifecycle.failure import Failure


@pytest.fixture(scope="module")
def d_schedulers() -> SchedulerPool:
    return d_scheduler_pool()


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
