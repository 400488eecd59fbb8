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
from tests.e2e_netns.conftest import NO_HOST_SETTINGS, listening_sockets
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


def test_both_engines_end_idle(pair: NetnsPair) -> None:
    assert wait_kv_idle(pair.prefill) == 0.0, pair.prefill.log_path
    assert wait_kv_idle(pair.decode) == 0.0, pair.decode.log_path
