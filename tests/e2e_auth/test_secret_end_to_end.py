"""Real engines with the shared secret: P/D answers equal the baseline; params a client changed (host, block list,
expiry), signed params past their expiry, or made-up params are refused before D contacts anything: every one of
them names a listener of the test's as P's side channel, and that listener sees no connection (while the same
params, signed and unchanged, do make D connect to it); a raw ZMQ client without the secret gets no registration
and cannot release a live hold, which D then pulls."""

from __future__ import annotations

import concurrent.futures
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
from tests.e2e_auth.conftest import SECRET
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.contract import protocol
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import ErrorReply, GetRegistration, Release, RemotePrefill

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


def signed_at(params: dict, port: int, expires_ms: int | None = None) -> dict:
    """P's params moved to the side channel at ``port`` (on P's host) and signed there with the deployment's secret,
    as P would have issued them had it listened at ``port``; ``expires_ms``: another expiry, signed too."""
    auth = Authenticator(SECRET.encode(), clock_skew=0)
    issued = RemotePrefill.from_params(params)
    assert issued is not None and auth.sign_params(issued, issued.expires_ms).mac == params["mac"]  # P's signer
    moved = {**params, "remote_port": port, "mac": ""}
    remote = RemotePrefill.from_params(moved)
    assert remote is not None
    expiry = params["expires_ms"] if expires_ms is None else expires_ms
    return {**moved, "expires_ms": expiry, "mac": auth.sign_params(remote, expiry).mac}


def test_signed_params_naming_the_listener_make_d_connect_to_it(secured_cluster: Cluster) -> None:
    """The control of the next test: valid params that name the listener make D connect there, so a listener that
    sees nothing shows D contacted nothing. (The listener speaks no ZMQ: D's pull fails and D recomputes.)"""
    prompt = prompt_ids(96, seed=99)
    ear = listener()
    ear.settimeout(BOUND_S)
    params = signed_at(issued_params(secured_cluster, prompt), ear.getsockname()[1])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        decoded = pool.submit(decode_with, secured_cluster, prompt, params)
        conn, _ = ear.accept()  # D's side channel connects here
        conn.close()
        out, _ = decoded.result(timeout=120)
    ear.close()
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and not report["reason"].startswith("unauthenticated"), report
    assert max_logprob_gap(out, baseline(secured_cluster, prompt)) <= LOGPROB_TOL  # D recomputed


@pytest.mark.parametrize("tamper", ["host", "block-list", "expiry", "expired", "made-up"])
def test_changed_or_made_up_params_are_refused_before_any_contact(secured_cluster: Cluster, tamper: str) -> None:
    """Every case's params name the listener as P's side channel (the control above shows D would connect)."""
    prompt = prompt_ids(96, seed=100 + len(tamper))
    params = issued_params(secured_cluster, prompt)
    ear = listener()
    port = ear.getsockname()[1]
    if tamper == "host":  # the real hold, sent to the client's own side channel
        params = {**params, "remote_port": port}
    elif tamper == "block-list":  # valid params for a P at the listener, then the block list changed
        params = signed_at(params, port)
        params = {**params, "remote_block_ids": [list(reversed(params["remote_block_ids"][0]))]}
    elif tamper == "expiry":  # ... then the expiry pushed an hour on
        params = signed_at(params, port)
        params = {**params, "expires_ms": params["expires_ms"] + 3_600_000}
    elif tamper == "expired":  # unchanged and signed, but expired an hour ago (far past D's clock_skew)
        params = signed_at(params, port, expires_ms=int(time.time() * 1000) - 3_600_000)
    else:
        params = {k: v for k, v in params.items() if k not in ("mac", "expires_ms")} | {"remote_port": port}
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == port  # where the listener is
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
