"""P at TP 2 with one rank per node (two namespaces), D at TP 2 on a third (the package's D): D learns where P's
rank 1 listens from P's rank table (served by the entry point the params name), each D rank pulls its half of every
block from the P rank of its index (one per P node), and D's answers equal a single instance's. The negative
control: under the former single-host assumption D would contact rank 1 at remote_host:remote_port + 1, where
nothing listens in this layout."""

from __future__ import annotations

import math
import subprocess
from typing import TYPE_CHECKING

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    BYTES_PER_BLOCK,
    prompt_ids,
    through_the_proxy,
    wait_kv_idle,
)
from vllm_kvp2p.testing.netns import listening_sockets

if TYPE_CHECKING:
    from tests.e2e_multinode.conftest import MultiNodeDeployment

pytestmark = pytest.mark.e2e

LENGTHS = [10, 2 * BLOCK_SIZE, 5 * BLOCK_SIZE + 7]


def test_each_rank_advertises_its_own_node_and_the_table_says_so(tp_over_nodes: MultiNodeDeployment) -> None:
    d = tp_over_nodes
    p0, p1, port = d.net["p0"].address, d.net["p1"].address, d.side_channel_port
    head_log = d.head.log_path.read_text(errors="replace")
    worker_log = d.worker.log_path.read_text(errors="replace")
    assert f"rank 0 at {p0}:{port}, rank 1 at {p1}:{port + 1}" in head_log, d.head.log_path
    assert f"side channel binds {p1}:{port + 1}, advertised as {p1}" in worker_log, d.worker.log_path
    assert f"Mooncake engine up: segment {p1}:" in worker_log
    for log in (head_log, worker_log, d.decode.log_path.read_text(errors="replace")):
        assert "; authenticated; protocol v" in log  # the secret is set on every node
    assert (p1, port + 1) in listening_sockets(d.net["p1"].name)


def test_the_single_host_assumption_reaches_nothing(tp_over_nodes: MultiNodeDeployment) -> None:
    """remote_host:remote_port + 1 (where D looked for rank 1 before rank tables) is not served in this layout:
    from D's node a connection there is refused, so a D without the table would get no pull for rank 1."""
    d = tp_over_nodes
    p0, port = d.net["p0"].address, d.side_channel_port
    assert not {(p0, port + 1), ("0.0.0.0", port + 1)} & listening_sockets(d.net["p0"].name)
    probe = ("import socket,sys\ns=socket.socket(); s.settimeout(5)\n"
             "sys.exit(s.connect_ex((sys.argv[1], int(sys.argv[2]))))")
    refused = subprocess.run(["ip", "netns", "exec", d.net["d"].name, d.decode.python, "-c", probe, p0,
                              str(port + 1)], timeout=30).returncode
    reached = subprocess.run(["ip", "netns", "exec", d.net["d"].name, d.decode.python, "-c", probe,
                              d.net["p1"].address, str(port + 1)], timeout=30).returncode
    assert refused != 0 and reached == 0, (refused, reached)


@pytest.mark.parametrize("length", LENGTHS)
def test_output_equals_single_instance_with_p_ranks_on_two_nodes(tp_over_nodes: MultiNodeDeployment,
                                                                  length: int) -> None:
    d = tp_over_nodes
    prompt = prompt_ids(length, seed=700 + length)
    report, moved = through_the_proxy(d, prompt)
    blocks = math.ceil(length / BLOCK_SIZE)
    # Each D rank reads the heads of its P rank, one on each node: all bytes of every block, from both nodes.
    assert report["ok"] and report["blocks"] == blocks and report["bytes"] == blocks * BYTES_PER_BLOCK, report
    assert moved["local_compute"] == 0 and moved["external_kv_transfer"] == length, moved


def test_both_engines_end_idle(tp_over_nodes: MultiNodeDeployment) -> None:
    d = tp_over_nodes
    assert wait_kv_idle(d.head, timeout=60) == 0.0
    assert wait_kv_idle(d.decode, timeout=30) == 0.0
