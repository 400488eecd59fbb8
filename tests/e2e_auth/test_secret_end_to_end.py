"""Real engines with the shared secret: P/D answers equal the baseline; params a client changed (host, block list,
expiry) or made up are refused before D contacts anything (a listener on the named address sees no connection);
a raw ZMQ client without the secret gets no registration and cannot release a live hold, which D then pulls."""

from __future__ import annotations

import socket
import time

import pytest

from tests.e2e.helpers import (
    LOGPROB_TOL,
    Cluster,
    baseline,
    completion_body,
    max_logprob_gap,
    post,
    prompt_ids,
    wait_kv_idle,
)
from vllm_kvp2p import protocol
from vllm_kvp2p.protocol import ErrorReply, GetRegistration, Release
from vllm_kvp2p.scheduler import PULL_REPORT_KEY

BOUND_S = 10.0


def issued_params(cluster: Cluster, prompt: list[int]) -> dict:
    p = post(cluster.prefill.url + "/v1/completions",
             {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    return p["kv_transfer_params"]


def decode_with(cluster: Cluster, prompt: list[int], params: dict) -> tuple[dict, float]:
    start = time.monotonic()
    out = post(cluster.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
    return out, time.monotonic() - start


def test_pd_with_the_secret_equals_the_baseline(secured_cluster: Cluster) -> None:
    for seed in (1, 2):
        prompt = prompt_ids(150, seed=seed)
        params = issued_params(secured_cluster, prompt)
        assert params["mac"] and params["expires_ms"] > time.time() * 1000
        out, _ = decode_with(secured_cluster, prompt, params)
        report = out["kv_transfer_params"][PULL_REPORT_KEY]
        assert report["ok"] and report["blocks"] > 0, report
        assert max_logprob_gap(out, baseline(secured_cluster, prompt)) <= LOGPROB_TOL
    # And through the proxy, as a user runs it.
    prompt = prompt_ids(120, seed=3)
    out = post(secured_cluster.proxy_url + "/v1/completions", completion_body(prompt))
    assert max_logprob_gap(out, baseline(secured_cluster, prompt)) <= LOGPROB_TOL


def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.settimeout(0.5)
    return sock


@pytest.mark.parametrize("tamper", ["host", "block-list", "expiry", "made-up"])
def test_changed_or_made_up_params_are_refused_before_any_contact(secured_cluster: Cluster, tamper: str) -> None:
    prompt = prompt_ids(96, seed=100 + len(tamper))
    params = issued_params(secured_cluster, prompt)
    ear = listener()
    port = ear.getsockname()[1]
    if tamper == "host":  # the real hold, sent to the client's own side channel
        params = {**params, "remote_port": port}
    elif tamper == "block-list":
        params = {**params, "remote_block_ids": [list(reversed(params["remote_block_ids"][0]))]}
    elif tamper == "expiry":
        params = {**params, "expires_ms": params["expires_ms"] + 3_600_000}
    else:
        params = {k: v for k, v in params.items() if k not in ("mac", "expires_ms")} | {"remote_port": port}
    out, took = decode_with(secured_cluster, prompt, params)
    with pytest.raises(TimeoutError):
        ear.accept()
    ear.close()
    assert took < BOUND_S, took
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and report["reason"].startswith("unauthenticated kv_transfer_params"), report
    assert report["failure"] == "unauthenticated"
    assert max_logprob_gap(out, baseline(secured_cluster, prompt)) <= LOGPROB_TOL  # D recomputed


def test_a_raw_client_without_the_secret_gets_nothing_and_the_hold_survives(secured_cluster: Cluster) -> None:
    import zmq

    prompt = prompt_ids(128, seed=77)
    params = issued_params(secured_cluster, prompt)
    ctx = zmq.Context()
    try:
        for message in (GetRegistration(0),
                        Release(params["remote_request_id"], params["remote_hold_id"], "attacker:0", 1)):
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.connect(f"tcp://{params['remote_host']}:{params['remote_port']}")
            sock.send(protocol.encode(message))
            reply = protocol.decode_reply(sock.recv())
            sock.close()
            assert isinstance(reply, ErrorReply) and reply.message.startswith("unauthenticated request"), reply
    finally:
        ctx.term()
    out, _ = decode_with(secured_cluster, prompt, params)  # the hold was not released by the raw client
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert report["ok"] and report["blocks"] > 0, report
    assert max_logprob_gap(out, baseline(secured_cluster, prompt)) <= LOGPROB_TOL


def test_engines_end_idle_and_the_logs_name_the_security_state(secured_cluster: Cluster) -> None:
    assert wait_kv_idle(secured_cluster.prefill, timeout=60) == 0.0  # the refused ones at P's hold timeout
    assert wait_kv_idle(secured_cluster.decode) == 0.0
    p_log = secured_cluster.prefill.log_path.read_text(errors="replace")
    d_log = secured_cluster.decode.log_path.read_text(errors="replace")
    assert "(authenticated)" in p_log and "unauthenticated: anyone" not in p_log
    assert "side channel unauthenticated" not in d_log
    assert "e2e-shared-secret" not in p_log + d_log  # never logged
