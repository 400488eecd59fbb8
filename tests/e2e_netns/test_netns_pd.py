"""P and D in two network namespaces, with no host settings: each engine advertises the address vLLM detects in
its namespace, D pulls the prompt's KV from P across the bridge, the outputs equal a single instance's and both
engines end idle. test_netns_loopback_default.py shows the same checks failing with the former default."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    BYTES_PER_BLOCK,
    LOGPROB_TOL,
    baseline,
    completion_body,
    max_logprob_gap,
    post,
    prompt_ids,
    tokens_and_logprobs,
    tokens_by_source,
    wait_kv_idle,
)
from tests.e2e_netns.conftest import NO_HOST_SETTINGS, P_LONGEST_PIN_S, listening_sockets
from vllm_kvp2p.scheduler import PULL_REPORT_KEY

if TYPE_CHECKING:
    from tests.e2e_netns.conftest import NetnsPair

pytestmark = pytest.mark.e2e

LENGTHS = [10, 2 * BLOCK_SIZE, 5 * BLOCK_SIZE + 7, 300]


def test_engines_run_without_host_settings_and_advertise_their_namespace_address(pair: NetnsPair) -> None:
    for server, ns in ((pair.prefill, pair.net.prefill), (pair.decode, pair.net.decode)):
        assert not set(NO_HOST_SETTINGS) & set(server.env), server.env
        assert server.cmd[:4] == ["ip", "netns", "exec", ns.name]
        log = server.log_path.read_text(errors="replace")
        assert f"Mooncake engine up: segment {ns.address}:" in log, server.log_path
    log = pair.prefill.log_path.read_text(errors="replace")
    side_channel = f"{pair.net.prefill.address}:{pair.side_channel_port}"
    assert f"side channel binds {side_channel}, advertised as {pair.net.prefill.address}" in log


def test_side_channel_listens_on_the_advertised_address_mooncake_on_every_interface(pair: NetnsPair) -> None:
    """What docs/configuration.md says: bind_host (here: the advertised address) binds the side channel only."""
    listening = listening_sockets(pair.net.prefill.name)
    assert (pair.net.prefill.address, pair.side_channel_port) in listening, listening
    assert not {("0.0.0.0", pair.side_channel_port), ("::", pair.side_channel_port)} & listening
    log = pair.prefill.log_path.read_text(errors="replace")
    rpc_port = int(re.search(rf"segment {re.escape(pair.net.prefill.address)}:(\d+)", log).group(1))
    assert {("0.0.0.0", rpc_port), ("::", rpc_port)} & listening, (rpc_port, listening)


def test_p_params_name_p_namespace_address(pair: NetnsPair) -> None:
    """P's own answer to a prefill request names its namespace address; D, handed those params, pulls from it."""
    prompt = prompt_ids(70, seed=70)
    p = post(pair.prefill.url + "/v1/completions",
             {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
              "kv_transfer_params": {"do_remote_decode": True}})
    params = p["kv_transfer_params"]
    assert params["remote_host"] == pair.net.prefill.address and params["remote_port"] == pair.side_channel_port
    d = post(pair.decode.url + "/v1/completions", {**completion_body(prompt), "kv_transfer_params": params})
    assert d["kv_transfer_params"][PULL_REPORT_KEY]["ok"], d["kv_transfer_params"]


@pytest.mark.parametrize("length", LENGTHS)
def test_disaggregated_output_equals_single_instance_across_namespaces(pair: NetnsPair, length: int) -> None:
    prompt = prompt_ids(length, seed=length)
    before = tokens_by_source(pair)
    pd = post(pair.proxy_url + "/v1/completions", completion_body(prompt))
    single = baseline(pair, prompt)
    assert max_logprob_gap(pd, single) <= LOGPROB_TOL, (tokens_and_logprobs(pd), tokens_and_logprobs(single))

    report = pd["kv_transfer_params"][PULL_REPORT_KEY]
    blocks = math.ceil(length / BLOCK_SIZE)
    assert report["ok"] and report["blocks"] == blocks, report
    assert report["bytes"] == blocks * BYTES_PER_BLOCK
    after = tokens_by_source(pair)
    assert after["local_compute"] - before["local_compute"] == 0
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == length


SIDE_CHANNEL_TIMEOUT = 5.0  # D's default
MARGIN_S = 2.0  # a loaded 2-core machine


def test_p_cut_off_costs_one_side_channel_timeout_and_pulls_resume_when_the_link_returns(pair: NetnsPair) -> None:
    """P's link goes down (its veth, in the root namespace) after it prefilled: D answers the request itself
    within one side-channel timeout; once the link is back, a P/D request pulls again."""
    import subprocess
    import time

    prompt = prompt_ids(3 * BLOCK_SIZE + 5, seed=4242)
    params = post(pair.prefill.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                          "kv_transfer_params": {"do_remote_decode": True}})
    veth = pair.net.prefill.veth
    subprocess.run(["ip", "link", "set", veth, "down"], check=True, timeout=30)
    try:
        t0 = time.monotonic()
        out = post(pair.decode.url + "/v1/completions",
                   completion_body(prompt, kv_transfer_params=params["kv_transfer_params"]))
        took = time.monotonic() - t0
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True, timeout=30)
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and report["failure"] == "unreachable", report
    assert took < SIDE_CHANNEL_TIMEOUT + 1 + MARGIN_S, took  # before: 10.2 s
    # The link is back: the next request pulls (bridge ports need a moment to forward again).
    deadline = time.monotonic() + 30
    while True:
        prompt = prompt_ids(3 * BLOCK_SIZE + 9, seed=int(deadline))
        pd = post(pair.proxy_url + "/v1/completions", completion_body(prompt))
        if pd["kv_transfer_params"][PULL_REPORT_KEY]["ok"] or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert pd["kv_transfer_params"][PULL_REPORT_KEY]["ok"], pd["kv_transfer_params"]
    assert max_logprob_gap(pd, baseline(pair, prompt)) <= LOGPROB_TOL


def test_both_engines_end_idle(pair: NetnsPair) -> None:
    # The cut-off request's hold, or a late claim for it (see SHORT_P_TIMERS): at most P_LONGEST_PIN_S.
    assert wait_kv_idle(pair.prefill, timeout=P_LONGEST_PIN_S + 10) == 0.0, pair.prefill.log_path
    assert wait_kv_idle(pair.decode) == 0.0, pair.decode.log_path
