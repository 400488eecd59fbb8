"""Hostile kv_transfer_params sent straight to a real D (any client of its HTTP API can): each request ends within
seconds with D's own answer (this cluster's D recomputes failed loads), nothing is sent to the addresses the params
name, both engines end idle, and a normal P/D request afterwards still works."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
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
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.cluster import kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, free_port

BOUND_S = 10.0  # each request on its own; generous for a loaded 2-core machine


def real_params(cluster: Cluster, prompt: list[int]) -> dict:
    p = post(cluster.prefill.url + "/v1/completions",
             {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    return p["kv_transfer_params"]


def fabricated_params(prompt: list[int], port: int, **change: object) -> dict:
    """Params no P issued, naming a listener of this test as P's side channel."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "nobody", "remote_request_id": "r",
        "remote_host": "127.0.0.1", "remote_port": port, "remote_block_ids": [[1, 2, 3]], "remote_hold_id": "h",
        "remote_num_tokens": len(prompt), "remote_block_size": 32, "tp_size": 1, **change,
    }


@pytest.mark.parametrize("change", [
    {"tp_size": 2_000_000},
    {"tp_size": -3},
    {"remote_host": "x" * 5000},
    {"remote_port": 70000},
], ids=["tp-huge", "tp-negative", "host-5000", "port-out-of-range"])
def test_unaddressable_params_end_fast_without_contacting_anyone(cluster: Cluster, change: dict) -> None:
    prompt = prompt_ids(96, seed=31337)
    listener = socket.socket()  # where the params point: it must see no connection
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    params = fabricated_params(prompt, listener.getsockname()[1], **change)
    # A changed host or port points nowhere a listener can stand: there "nobody contacted" rests on the failure
    # kind below (invalid_params: admission's verdict, before any I/O), not on this listener.
    points_at_listener = not ({"remote_host", "remote_port"} & change.keys())
    start = time.monotonic()
    out = post(cluster.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
    took = time.monotonic() - start
    if points_at_listener:
        with pytest.raises(TimeoutError):
            listener.accept()
    listener.close()
    assert took < BOUND_S, took
    assert max_logprob_gap(out, baseline(cluster, prompt)) <= LOGPROB_TOL  # recomputed by D
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and "invalid kv_transfer_params" in report["reason"], report
    assert report["failure"] == "invalid_params"


@pytest.mark.parametrize("change", [
    {"remote_block_ids": [[-1, -2, -3]]},
    {"remote_block_ids": [list(range(200_000))]},
    {"remote_num_tokens": 10**12},
], ids=["negative-ids", "200k-ids", "tokens-huge"])
def test_invalid_content_ends_fast_and_p_is_released(cluster: Cluster, change: dict) -> None:
    """P really holds the prompt; the client changed what it sends to D: nothing is read, P's hold is released
    (its address is valid), D recomputes."""
    prompt = prompt_ids(96, seed=31338)
    params = {**real_params(cluster, prompt), **change}
    start = time.monotonic()
    out = post(cluster.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
    assert time.monotonic() - start < BOUND_S
    assert max_logprob_gap(out, baseline(cluster, prompt)) <= LOGPROB_TOL
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and "invalid kv_transfer_params" in report["reason"], report
    assert wait_kv_idle(cluster.prefill) == 0.0


def test_out_of_range_block_ids_fail_at_pull_time_and_p_is_released(cluster: Cluster) -> None:
    """Plausible ids that P does not have (only P's registration knows its block count): the pull fails at once,
    P's real hold is released, and D recomputes."""
    prompt = prompt_ids(64, seed=4444)
    params = {**real_params(cluster, prompt), "remote_block_ids": [[2**62 - 2, 2**62 - 1]]}
    start = time.monotonic()
    out = post(cluster.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
    assert time.monotonic() - start < BOUND_S
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and "the params name blocks beyond the" in report["reason"], report
    assert report["failure"] == "incompatible"
    assert max_logprob_gap(out, baseline(cluster, prompt)) <= LOGPROB_TOL


@pytest.fixture(scope="module")
def failing_decode(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A second D beside the cluster's, with vLLM's other policy: failed loads end the request with an error."""
    with VllmServer(cluster.model_path, free_port(), cpus="1", log_path=tmp_path_factory.mktemp("fail-d") / "d.log",
                    extra_args=("--kv-transfer-config", kv_transfer_config("kv_consumer", "fail"))) as server:
        yield server


@pytest.mark.parametrize("change", [{"tp_size": 2_000_000}, {"remote_block_ids": [[-1, -2, -3]]}],
                         ids=["unaddressable", "invalid-content"])
def test_under_the_fail_policy_bad_params_end_with_an_error_and_a_warning_naming_the_field(
        cluster: Cluster, failing_decode: VllmServer, change: dict) -> None:
    """vLLM answers a failed load under ``kv_load_failure_policy: fail`` with its own HTTP 500 (its error carries no
    connector text); D's log has one WARNING naming the field and the failure kind."""
    prompt = prompt_ids(96, seed=4545 + len(change))
    # A real hold only where D can release it (unaddressable params would leave it to P's hold timeout).
    params = fabricated_params(prompt, 20000, **change) if "tp_size" in change else {
        **real_params(cluster, prompt), **change}
    start = time.monotonic()
    r = httpx.post(failing_decode.url + "/v1/completions", json=completion_body(prompt, kv_transfer_params=params),
                   timeout=60)
    assert time.monotonic() - start < BOUND_S
    assert r.status_code == 500, r.text
    field = next(iter(change))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in failing_decode.log_path.read_text(errors="replace").splitlines() if "WARNING" in line
                 and "failed (invalid_params): invalid kv_transfer_params:" in line and field in line]
        if lines:
            break
        time.sleep(0.2)
    assert len(lines) == 1, lines
    ok = post(failing_decode.url + "/v1/completions",
              completion_body(prompt, kv_transfer_params=real_params(cluster, prompt)))
    assert ok["kv_transfer_params"][PULL_REPORT_KEY]["ok"]
    assert wait_kv_idle(failing_decode) == 0.0


def fill_cache(server: VllmServer, count: int = 6, length: int = 200) -> None:
    """Other prompts through D first: its free blocks then hold their KV, what an unread block would keep."""
    for seed in range(count):
        post(server.url + "/v1/completions", {"model": "tiny", "prompt": prompt_ids(length, seed=5000 + seed),
                                              "max_tokens": 1})


def test_a_cut_block_list_is_refused_not_read_in_part(cluster: Cluster) -> None:
    """Genuine params whose block list a client cut to one block, remote_num_tokens still claiming the prompt:
    before exact coverage D told vLLM it loaded the whole prompt, read one block, and the rest kept an earlier
    request's KV (then cached under this prompt). Now the verdict refuses them and D recomputes."""
    fill_cache(cluster.decode)
    prompt = prompt_ids(200, seed=6060)
    params = real_params(cluster, prompt)
    params["remote_block_ids"] = [params["remote_block_ids"][0][:1]]
    out = post(cluster.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and "remote_block_ids[0] has 1 blocks" in report["reason"], report
    assert report["bytes"] == 0
    assert max_logprob_gap(out, baseline(cluster, prompt)) <= LOGPROB_TOL
    assert wait_kv_idle(cluster.prefill) == 0.0  # P's hold was released (the params are for this prompt)


def test_engines_idle_and_normal_requests_work_afterwards(cluster: Cluster) -> None:
    prompt = prompt_ids(150, seed=2024)
    out = post(cluster.decode.url + "/v1/completions",
               completion_body(prompt, kv_transfer_params=real_params(cluster, prompt)))
    assert out["kv_transfer_params"][PULL_REPORT_KEY]["ok"]
    assert max_logprob_gap(out, baseline(cluster, prompt)) <= LOGPROB_TOL
    assert wait_kv_idle(cluster.prefill) == 0.0
    assert wait_kv_idle(cluster.decode) == 0.0
