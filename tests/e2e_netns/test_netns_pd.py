"""P and D in two network namespaces, with no host settings: each engine advertises the address vLLM detects in
its namespace, D pulls the prompt's KV from P across the bridge, the outputs equal a single instance's and both
engines end idle. test_netns_loopback_default.py shows the same checks failing with the former default."""

from __future__ import annotations

import math
import re
import time
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    BYTES_PER_BLOCK,
    LOGPROB_TOL,
    baseline,
    completion_body,
    max_logprob_gap,
    metric,
    post,
    prompt_ids,
    tokens_and_logprobs,
    tokens_by_source,
    wait_kv_idle,
)
from tests.e2e_netns.conftest import (
    HOLD_TIMEOUT,
    LEASE_TIMEOUT,
    NO_HOST_SETTINGS,
    P_LONGEST_PIN_S,
    TRANSFER_TIMEOUT,
)
from tests.support.ci_mode import lacks
from tests.support.fault_bounds import (
    FROZEN_P_S,
    KILLED_P_S,
    assert_within_doc_bound,
    cut_during_read_s,
    lease_lapse_s,
)
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.netns import listening_sockets

if TYPE_CHECKING:
    from tests.e2e_netns.conftest import NetnsPair
    from vllm_kvp2p.testing.server import VllmServer

pytestmark = pytest.mark.e2e

LENGTHS = [10, 2 * BLOCK_SIZE, 5 * BLOCK_SIZE + 7, 300]


def test_engines_run_without_host_settings_and_advertise_their_namespace_address(pair: NetnsPair) -> None:
    for server, ns in ((pair.prefill, pair.net["prefill"]), (pair.decode, pair.net["decode"])):
        assert not set(NO_HOST_SETTINGS) & set(server.env), server.env
        assert server.cmd[:4] == ["ip", "netns", "exec", ns.name]
        log = server.log_path.read_text(errors="replace")
        assert f"Mooncake engine up: segment {ns.address}:" in log, server.log_path
    log = pair.prefill.log_path.read_text(errors="replace")
    side_channel = f"{pair.net['prefill'].address}:{pair.side_channel_port}"
    assert f"side channel binds {side_channel}, advertised as {pair.net['prefill'].address}" in log


def test_side_channel_listens_on_the_advertised_address_mooncake_on_every_interface(pair: NetnsPair) -> None:
    """What docs/configuration.md says: bind_host (here: the advertised address) binds the side channel only."""
    listening = listening_sockets(pair.net["prefill"].name)
    assert (pair.net["prefill"].address, pair.side_channel_port) in listening, listening
    assert not {("0.0.0.0", pair.side_channel_port), ("::", pair.side_channel_port)} & listening
    log = pair.prefill.log_path.read_text(errors="replace")
    rpc_port = int(re.search(rf"segment {re.escape(pair.net['prefill'].address)}:(\d+)", log).group(1))
    assert {("0.0.0.0", rpc_port), ("::", rpc_port)} & listening, (rpc_port, listening)


def test_p_params_name_p_namespace_address(pair: NetnsPair) -> None:
    """P's own answer to a prefill request names its namespace address; D, handed those params, pulls from it."""
    prompt = prompt_ids(70, seed=70)
    p = post(pair.prefill.url + "/v1/completions",
             {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
              "kv_transfer_params": {"do_remote_decode": True}})
    params = p["kv_transfer_params"]
    assert params["remote_host"] == pair.net["prefill"].address and params["remote_port"] == pair.side_channel_port
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




def test_p_cut_off_costs_one_side_channel_timeout_and_pulls_resume_when_the_link_returns(pair: NetnsPair) -> None:
    """P's link goes down (its veth, in the root namespace) after it prefilled: D answers the request itself
    within one side-channel timeout; once the link is back, a P/D request pulls again."""
    import subprocess

    prompt = prompt_ids(3 * BLOCK_SIZE + 5, seed=4242)
    params = post(pair.prefill.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                          "kv_transfer_params": {"do_remote_decode": True}})
    veth = pair.net["prefill"].veth
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
    assert_within_doc_bound(took, FROZEN_P_S, "P's link cut while D holds its params")  # before: 10.2 s
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


@pytest.fixture()
def slow_p_link(pair: NetnsPair):
    """P's outgoing traffic throttled (a token bucket on its eth0) so that a pull lasts seconds, then restored."""
    import subprocess

    tc = ["ip", "netns", "exec", pair.net["prefill"].name, "tc", "qdisc"]
    added = subprocess.run([*tc, "add", "dev", "eth0", "root", "tbf", "rate", THROTTLE, "burst", "32kbit",
                            "latency", "10s"], capture_output=True, text=True, timeout=30)
    if added.returncode != 0:
        lacks(f"cannot throttle a link here (tc tbf): {added.stderr.strip()}")
    yield
    subprocess.run([*tc, "del", "dev", "eth0", "root"], check=True, timeout=30)


THROTTLE = "2mbit"  # the pull below: 10 blocks of 64 KiB, about 2.6 s at this rate
D_TRANSFER_TIMEOUT = TRANSFER_TIMEOUT  # the pair's D (VLLM_KVP2P_TRANSFER_TIMEOUT)


def test_p_cut_off_during_a_read_ends_within_transfer_timeout(pair: NetnsPair, slow_p_link: None) -> None:
    """P's link goes down while D's Mooncake read from it is under way: the read (which cannot be cancelled) ends
    within D's transfer_timeout, D answers the request itself, and nothing it read is used."""
    import subprocess
    import threading

    prompt = prompt_ids(10 * BLOCK_SIZE, seed=8181)
    params = post(pair.prefill.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                          "kv_transfer_params": {"do_remote_decode": True}})
    result: dict[str, object] = {}

    def decode() -> None:
        t0 = time.monotonic()
        result["out"] = post(pair.decode.url + "/v1/completions",
                             completion_body(prompt, kv_transfer_params=params["kv_transfer_params"]))
        result["seconds"] = time.monotonic() - t0

    veth = pair.net["prefill"].veth
    thread = threading.Thread(target=decode)
    thread.start()
    time.sleep(1.0)  # claimed (a round trip) and about a third of the read done
    subprocess.run(["ip", "link", "set", veth, "down"], check=True, timeout=30)
    try:
        thread.join(timeout=D_TRANSFER_TIMEOUT + 30)
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True, timeout=30)
    assert not thread.is_alive(), "D hung on a read from a cut-off P"
    out = result["out"]
    report = out["kv_transfer_params"][PULL_REPORT_KEY]  # type: ignore[index]
    assert not report["ok"] and report["failure"] in ("read_failed", "timeout"), report  # cut during the read
    assert_within_doc_bound(result["seconds"], cut_during_read_s(D_TRANSFER_TIMEOUT),  # type: ignore[arg-type]
                            "P's link cut during a read")
    assert max_logprob_gap(out, baseline(pair, prompt)) <= LOGPROB_TOL  # type: ignore[arg-type]


def test_both_engines_end_idle(pair: NetnsPair) -> None:
    # The cut-off request's hold, or a late claim for it (see SHORT_P_TIMERS): at most P_LONGEST_PIN_S.
    assert wait_kv_idle(pair.prefill, timeout=P_LONGEST_PIN_S + 10) == 0.0, pair.prefill.log_path
    assert wait_kv_idle(pair.decode) == 0.0, pair.decode.log_path


# ---------------------------------------------------------------- engines that die (last: they restart them)

CLAIM_AFTER_S = HOLD_TIMEOUT / 2  # claimed well before the hold would expire; its lease outlives the hold

def _idle_within(server: VllmServer, seconds: float) -> float:
    t0 = time.monotonic()
    assert wait_kv_idle(server, timeout=seconds) == 0.0, server.log_path
    return time.monotonic() - t0


def test_p_killed_and_restarted_on_the_same_address_pulls_resume_at_once(pair: NetnsPair) -> None:
    """P dies (SIGKILL) holding a request D has not pulled yet: D answers it itself within 2 s; P comes back on
    the same address with a new incarnation and the very next P/D request pulls from it."""
    prompt = prompt_ids(4 * BLOCK_SIZE + 3, seed=5151)
    params = post(pair.prefill.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                          "kv_transfer_params": {"do_remote_decode": True}})
    pair.prefill.kill()
    t0 = time.monotonic()
    out = post(pair.decode.url + "/v1/completions",
               completion_body(prompt, kv_transfer_params=params["kv_transfer_params"]))
    took = time.monotonic() - t0
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and report["failure"] == "unreachable", report  # nothing listens: known at once
    assert_within_doc_bound(took, KILLED_P_S, "a killed P")

    pair.prefill.start().wait_ready()
    again = prompt_ids(4 * BLOCK_SIZE + 3, seed=5152)
    pd = post(pair.proxy_url + "/v1/completions", completion_body(again))
    assert pd["kv_transfer_params"][PULL_REPORT_KEY]["ok"], pd["kv_transfer_params"]  # first try, no wait
    assert max_logprob_gap(pd, baseline(pair, again)) <= LOGPROB_TOL
    assert max_logprob_gap(out, baseline(pair, prompt)) <= LOGPROB_TOL  # D's own answer for the dead P's one
    assert wait_kv_idle(pair.decode) == 0.0 and wait_kv_idle(pair.prefill) == 0.0


def test_a_reader_that_vanishes_holding_a_claim_is_freed_at_lease_expiry(pair: NetnsPair) -> None:
    """What P sees of a D killed mid-pull: a claim granted, then nothing (no renew, no release). P serves others
    meanwhile; the lease pins the blocks past hold_timeout and P frees them when it lapses, not never."""
    from vllm_kvp2p.contract.protocol import Claim, ClaimStatus
    from vllm_kvp2p.contract.side_channel import SideChannelClient

    prompt = prompt_ids(3 * BLOCK_SIZE, seed=6161)
    kv = post(pair.prefill.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                      "kv_transfer_params": {"do_remote_decode": True}})
    held = time.monotonic()
    kv = kv["kv_transfer_params"]
    # P keeps serving: a P/D request through the proxy pulls meanwhile. (Its engine steps also hand the hold
    # above to P's side channel, which an idle vLLM 0.23 engine does only at its next step.)
    other = prompt_ids(2 * BLOCK_SIZE + 1, seed=6162)
    pd = post(pair.proxy_url + "/v1/completions", completion_body(other))
    assert pd["kv_transfer_params"][PULL_REPORT_KEY]["ok"], pd["kv_transfer_params"]
    time.sleep(max(0.0, CLAIM_AFTER_S - (time.monotonic() - held)))  # the lease ends after the hold would have
    client = SideChannelClient(5.0)
    try:
        claim = Claim(kv["remote_request_id"], kv["remote_hold_id"], "vanished-d:0", 1, "c1")
        reply = client.request(kv["remote_host"], kv["remote_port"], claim)
    finally:
        client.close()  # the reader is gone: no renew, no release
    claimed = time.monotonic()
    assert reply.status is ClaimStatus.GRANTED, reply
    time.sleep(max(0.0, HOLD_TIMEOUT + 2 - (time.monotonic() - held)))
    assert metric(pair.prefill, "vllm:kv_cache_usage_perc") > 0  # past hold_timeout: the lease still pins them
    assert wait_kv_idle(pair.prefill, timeout=LEASE_TIMEOUT + 10) == 0.0, pair.prefill.log_path
    freed_after = time.monotonic() - claimed
    assert freed_after > LEASE_TIMEOUT - 3, freed_after  # not before the lease lapses
    assert_within_doc_bound(freed_after, lease_lapse_s(LEASE_TIMEOUT), "a vanished reader's lease lapsing")


def test_d_killed_with_requests_in_flight_p_frees_everything_and_serves_d_again(pair: NetnsPair) -> None:
    """D dies (SIGKILL) while clients' P/D requests are in flight: P keeps serving and frees every hold within
    hold_timeout + lease_timeout; D restarted, P/D requests work again and both engines end idle."""
    import threading

    errors: list[str] = []

    def client(seed: int) -> None:
        for i in range(20):
            try:
                post(pair.proxy_url + "/v1/completions", completion_body(prompt_ids(200, seed=seed * 100 + i)),
                     timeout=30)
            except Exception as exc:  # noqa: BLE001 - expected once D is gone
                errors.append(repr(exc))
                return

    threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    pair.decode.kill()
    for t in threads:
        t.join(timeout=60)
    assert errors, "D was killed after every request had finished: nothing was in flight"
    assert httpx.get(pair.prefill.url + "/health", timeout=5).status_code == 200
    # hold_timeout + lease_timeout from the last hold, which came before the kill, so before this clock starts
    assert_within_doc_bound(_idle_within(pair.prefill, P_LONGEST_PIN_S + 10), P_LONGEST_PIN_S,
                            "P idle after D was killed")
    pair.decode.start().wait_ready()
    prompt = prompt_ids(3 * BLOCK_SIZE + 1, seed=7171)
    pd = post(pair.proxy_url + "/v1/completions", completion_body(prompt))
    assert pd["kv_transfer_params"][PULL_REPORT_KEY]["ok"], pd["kv_transfer_params"]
    assert max_logprob_gap(pd, baseline(pair, prompt)) <= LOGPROB_TOL
    assert wait_kv_idle(pair.decode) == 0.0 and wait_kv_idle(pair.prefill) == 0.0
