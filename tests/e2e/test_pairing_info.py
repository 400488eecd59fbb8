"""``vllm:kvp2p_pairing_info`` on the real engines' /metrics (issue 46 item 5): both engines of the cluster export
it (absent fails: the proxy would learn nothing), with equal keys but their role, so the proxy's decision pairs
them, and with the values P's workers actually register: what D's own check compares (lifecycle/compatibility.py)
is what the API server's config says."""

from __future__ import annotations

import dataclasses

import pytest

from tests.e2e.helpers import BLOCK_SIZE, Cluster
from vllm_kvp2p.contract.protocol import PROTOCOL_VERSION, GetRegistration, Registration
from vllm_kvp2p.contract.side_channel import SideChannelClient
from vllm_kvp2p.proxy.pairing import PairingKey, mismatch, read_metrics
from vllm_kvp2p.testing.server import VllmServer

pytestmark = pytest.mark.e2e


def pairing_key(server: VllmServer) -> PairingKey:
    status, body = server.request("GET", "/metrics", timeout=30.0)
    assert status == 200, status
    key = read_metrics(body.decode())
    assert isinstance(key, PairingKey), f"{server.url}/metrics: {key}"
    return key


def test_both_engines_export_equal_keys_but_the_role_and_the_proxy_pairs_them(cluster: Cluster) -> None:
    p, d = pairing_key(cluster.prefill), pairing_key(cluster.decode)
    assert (p.role, d.role) == ("producer", "consumer")
    assert dataclasses.replace(d, role=p.role) == p
    assert mismatch(p, d) is None
    assert mismatch(d, p) is not None  # the other way round: a consumer cannot prefill
    assert (p.protocol_version, p.block_size, p.use_mla, p.draft, p.linear_state, p.tp_size, p.pp_size) == (
        PROTOCOL_VERSION, BLOCK_SIZE, False, "none", False, 1, 1)


def test_the_key_says_what_ps_workers_register(cluster: Cluster) -> None:
    """The API server derives the key from its config; P's rank registers what D checks. They must agree, or the
    proxy would pair what D refuses (or refuse what D accepts)."""
    key = pairing_key(cluster.prefill)
    client = SideChannelClient(timeout=10)
    try:
        reply = client.request("127.0.0.1", cluster.side_channel_port, GetRegistration(0))
    finally:
        client.close()
    assert isinstance(reply, Registration), reply
    reg = reply.registration
    assert (key.protocol_version, key.model_fingerprint, key.kv_cache_dtype, key.block_size, key.use_mla,
            key.tp_size, key.pp_size) == (reg.protocol_version, reg.model_fingerprint, reg.dtype, reg.block_size,
                                          reg.use_mla, reg.tp_size, reg.pp_size)
