"""P at DP 2 with one engine core per node (the second a headless secondary on its own namespace), D on a third:
each engine core advertises its own node's address in the params it returns, D pulls from whichever core
prefilled, the proxy and the params stay as they are, and the answers equal a single instance's."""

from __future__ import annotations

import math
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
    wait_kv_idle,
)
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.netns import listening_sockets

if TYPE_CHECKING:
    from tests.e2e_multinode.conftest import MultiNodeDeployment

pytestmark = pytest.mark.e2e


def test_each_engine_core_names_its_own_node_and_d_pulls_from_it(dp_over_nodes: MultiNodeDeployment) -> None:
    """Prefill directly on P until both engine cores answered (vLLM sends a request to the less loaded core, and
    a prefilled request stays there until D releases it), then D finishes each from its params."""
    d = dp_over_nodes
    held: list[tuple[list[int], dict]] = []
    for i in range(8):  # bounded
        prompt = prompt_ids(40 + 9 * i, seed=2000 + i)
        p = post(d.head.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                   "kv_transfer_params": {"do_remote_decode": True}})
        held.append((prompt, p["kv_transfer_params"]))
        if len({params["remote_host"] for _, params in held}) == 2:
            break
    hosts = {params["remote_host"]: params["remote_port"] for _, params in held}
    assert hosts == {d.net["p0"].address: d.side_channel_port, d.net["p1"].address: d.side_channel_port + 1}, hosts
    # The single-host assumption (the head's address for every core) would find no core 1 on the head node.
    assert not {(d.net["p0"].address, d.side_channel_port + 1), ("0.0.0.0", d.side_channel_port + 1)} & \
        listening_sockets(d.net["p0"].name)
    for prompt, params in held:
        out = post(d.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
        report = out["kv_transfer_params"][PULL_REPORT_KEY]
        blocks = math.ceil(len(prompt) / BLOCK_SIZE)
        assert report["ok"] and report["blocks"] == blocks and report["bytes"] == blocks * BYTES_PER_BLOCK, report
        single = baseline(d, prompt)
        assert max_logprob_gap(out, single) <= LOGPROB_TOL, (tokens_and_logprobs(out), tokens_and_logprobs(single))


def test_through_the_proxy(dp_over_nodes: MultiNodeDeployment) -> None:
    d = dp_over_nodes
    for i in range(3):
        prompt = prompt_ids(3 * BLOCK_SIZE + i, seed=3000 + i)
        pd = post(d.proxy_url + "/v1/completions", completion_body(prompt))
        assert pd["kv_transfer_params"][PULL_REPORT_KEY]["ok"], pd["kv_transfer_params"]
        assert max_logprob_gap(pd, baseline(d, prompt)) <= LOGPROB_TOL


def test_both_engines_end_idle(dp_over_nodes: MultiNodeDeployment) -> None:
    d = dp_over_nodes
    assert wait_kv_idle(d.head, timeout=60) == 0.0
    assert wait_kv_idle(d.decode, timeout=30) == 0.0
