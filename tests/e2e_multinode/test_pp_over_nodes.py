"""P at PP 2 with one pipeline stage per node (two namespaces), D at TP 2 on a third: each P stage registers and
serves the layers it holds, D learns where stage 1 listens from P's rank table and each D rank reads its KV head of
every layer from the stage that holds the layer. Answers equal a single instance's; a corrupted transfer makes them
differ (the comparison can fail); both engines end idle."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    BYTES_PER_BLOCK,
    LOGPROB_TOL,
    NUM_LAYERS,
    baseline,
    completion_body,
    max_logprob_gap,
    post,
    prompt_ids,
    through_the_proxy,
    wait_kv_idle,
)
from tests.e2e_multinode.conftest import SECRET
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import GetRegistration, Registration
from vllm_kvp2p.contract.side_channel import SideChannelClient
from vllm_kvp2p.lifecycle.consumer import TEST_CORRUPT_KEY
from vllm_kvp2p.testing.netns import listening_sockets

if TYPE_CHECKING:
    from tests.e2e_multinode.conftest import MultiNodeDeployment

pytestmark = pytest.mark.e2e

LENGTHS = [10, 2 * BLOCK_SIZE, 5 * BLOCK_SIZE + 7]


def test_each_stage_serves_its_own_layers_from_its_own_node(pp_over_nodes: MultiNodeDeployment) -> None:
    d = pp_over_nodes
    p0, p1, port = d.net["p0"].address, d.net["p1"].address, d.side_channel_port
    head_log = d.head.log_path.read_text(errors="replace")
    assert f"rank 0 at {p0}:{port}, rank 1 at {p1}:{port + 1}" in head_log, d.head.log_path
    client = SideChannelClient(timeout=10, auth=Authenticator(SECRET.encode(), clock_skew=30))  # every P node has it
    try:
        replies = [client.request(host, port + rank, GetRegistration(rank)) for rank, host in enumerate((p0, p1))]
    finally:
        client.close()
    assert all(isinstance(r, Registration) for r in replies), replies
    stages = [r.registration for r in replies]
    assert [(s.pp_rank, s.pp_size, s.tp_size, s.rank) for s in stages] == [(0, 2, 1, 0), (1, 2, 1, 1)]
    first, second = (s.layer_names for s in stages)
    assert first and second and not set(first) & set(second)  # each stage its own layers
    assert len(first) + len(second) == NUM_LAYERS
    assert stages[1].segment.startswith(f"{p1}:")  # stage 1's KV is read on its own node
    # The single-host assumption (rank r at remote_host:remote_port + r) would find no stage 1 on P's head node.
    assert not {(p0, port + 1), ("0.0.0.0", port + 1)} & listening_sockets(d.net["p0"].name)


@pytest.mark.parametrize("length", LENGTHS)
def test_output_equals_single_instance_with_p_stages_on_two_nodes(pp_over_nodes: MultiNodeDeployment,
                                                                   length: int) -> None:
    d = pp_over_nodes
    prompt = prompt_ids(length, seed=900 + length)
    report, moved = through_the_proxy(d, prompt)
    blocks = math.ceil(length / BLOCK_SIZE)
    # D's two ranks together: every byte of every block, each layer from its stage, every unit verified.
    assert report["ok"] and report["blocks"] == blocks and report["bytes"] == blocks * BYTES_PER_BLOCK, report
    assert report["verified"] == 2 * blocks * NUM_LAYERS and "unverified" not in report, report
    assert moved["local_compute"] == 0 and moved["external_kv_transfer"] == length, moved


def test_a_corrupted_transfer_changes_the_answer(pp_over_nodes: MultiNodeDeployment) -> None:
    """The comparison above can fail: the same pull with its blocks overwritten after the read (the test hook)
    answers differently from the single instance."""
    d = pp_over_nodes
    prompt = prompt_ids(5 * BLOCK_SIZE + 7, seed=990)
    p = post(d.head.url + "/v1/completions",
             {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = {**p["kv_transfer_params"], TEST_CORRUPT_KEY: True}
    corrupted = post(d.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
    assert corrupted["kv_transfer_params"][PULL_REPORT_KEY]["ok"]
    assert max_logprob_gap(corrupted, baseline(d, prompt)) > 100 * LOGPROB_TOL


def test_both_engines_end_idle(pp_over_nodes: MultiNodeDeployment) -> None:
    d = pp_over_nodes
    assert wait_kv_idle(d.head, timeout=60) == 0.0
    assert wait_kv_idle(d.decode, timeout=30) == 0.0
