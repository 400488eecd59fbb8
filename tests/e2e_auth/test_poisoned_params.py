"""Real engines with the shared secret, and params no request of a client may turn into a dead engine or a wrong
answer: a ``mac`` (or any other text field) holding non-ASCII characters or a lone surrogate is refused and the
request answered (this D recomputes), D's ``/health`` stays 200 and the engine keeps serving; params P signed for
prompt A sent with prompt B are refused before D contacts anything, and B's answer is B's own.

Before the one verdict (vllm_kvp2p/lifecycle/admission.py) a non-ASCII ``mac`` reached ``hmac.compare_digest``,
which raises TypeError for non-ASCII text: the exception left vLLM's hook and EngineCore died with every request in
flight (tests/unit/test_auth.py pairs it)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.helpers import LOGPROB_TOL, Cluster, baseline, completion_body, max_logprob_gap, post, prompt_ids
from tests.e2e_auth.test_secret_end_to_end import decode_with, issued_params
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY

POISONS = {"latin": "é…" * 8, "surrogate": "\ud800x", "huge": "x" * 100_000}
TEXT_FIELDS = ("mac", "remote_engine_id", "remote_request_id", "remote_hold_id", "remote_host", "remote_incarnation",
               "remote_prompt_digest")


def post_escaped(cluster: Cluster, prompt: list[int], params: dict) -> dict | None:
    """A request whose JSON escapes every non-ASCII character (``\\ud800`` stays a lone surrogate once parsed,
    as any client can send it; httpx's own encoder refuses to). None when vLLM's API server itself refused it:
    vLLM cannot pass a lone surrogate to its engine ("surrogates not allowed": HTTP 400 on 0.23, 500 on 0.32)
    and answers before the connector sees the request (the connector's own handling is in tests/scheduler)."""
    body = json.dumps(completion_body(prompt, kv_transfer_params=params)).encode()
    r = httpx.post(cluster.decode.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=120)
    refused_by_vllm = "surrogates not allowed" in r.text + cluster.decode.log_path.read_text(errors="replace")
    if r.status_code in (400, 500) and refused_by_vllm and "\\ud800" in json.dumps(params):
        return None
    assert r.status_code == 200, r.text
    return r.json()


def healthy(cluster: Cluster) -> bool:
    return httpx.get(cluster.decode.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("field", TEXT_FIELDS)
def test_a_poisoned_text_field_is_refused_and_the_engine_serves_on(secured_cluster: Cluster, field: str) -> None:
    prompt = prompt_ids(70, seed=900 + TEXT_FIELDS.index(field))
    genuine = issued_params(secured_cluster, prompt)
    for name, poison in POISONS.items():
        out = post_escaped(secured_cluster, prompt, {**genuine, field: poison})
        if out is not None:
            report = out["kv_transfer_params"][PULL_REPORT_KEY]
            assert not report["ok"] and report["failure"] in ("unauthenticated", "invalid_params"), (name, report)
            assert max_logprob_gap(out, baseline(secured_cluster, prompt)) <= LOGPROB_TOL, name  # D recomputed
        assert healthy(secured_cluster), name
    # The genuine params still work: the hold was neither released nor read by the poisoned requests (another
    # cache_salt: D's own cache now holds this prompt from the recomputes).
    out = post(secured_cluster.decode.url + "/v1/completions",
               completion_body(prompt, kv_transfer_params=genuine, cache_salt="genuine"))
    assert out["kv_transfer_params"][PULL_REPORT_KEY]["ok"]


def test_params_signed_for_prompt_a_are_refused_with_prompt_b(secured_cluster: Cluster) -> None:
    prompt_a, prompt_b = prompt_ids(150, seed=31), prompt_ids(150, seed=32)
    params_a = issued_params(secured_cluster, prompt_a)
    # Nothing contacted P for B: no bytes read, and A's hold is neither read nor released (A pulls it below).
    out_b, took = decode_with(secured_cluster, prompt_b, params_a)
    report = out_b["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and "remote_prompt_digest does not match" in report["reason"], report
    assert report["failure"] == "invalid_params" and report["bytes"] == 0
    assert max_logprob_gap(out_b, baseline(secured_cluster, prompt_b)) <= LOGPROB_TOL  # B's own answer
    assert took < 10.0
    # A's request still finds its hold (D neither read nor released it for B).
    out_a, _ = decode_with(secured_cluster, prompt_a, params_a)
    assert out_a["kv_transfer_params"][PULL_REPORT_KEY]["ok"]
    assert max_logprob_gap(out_a, baseline(secured_cluster, prompt_a)) <= LOGPROB_TOL
    # B again, now from D's prefix cache: B's KV, never A's cached under B's hashes.
    again = post(secured_cluster.decode.url + "/v1/completions", completion_body(prompt_b))
    assert max_logprob_gap(again, baseline(secured_cluster, prompt_b)) <= LOGPROB_TOL
