"""Data and tensor parallel addressing: every (DP rank, TP rank) of an instance has its own side-channel port, the
scheduler advertises exactly the port its rank-0 worker listens on, and P's params carry its TP size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.scheduler.harness import make_kv_cache_config, make_vllm_config
from vllm_kvp2p.connector.scheduler import SchedulerSide
from vllm_kvp2p.contract.config import KVP2PConfig
from vllm_kvp2p.contract.protocol import RemotePrefill


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize(("dp_rank", "tp_size"), [(0, 1), (1, 1), (1, 2), (3, 4)])
def test_advertised_port_is_rank_zero_port_of_this_dp_rank(dp_rank: int, tp_size: int, moe: bool) -> None:
    vllm_config = make_vllm_config("kv_producer")
    vllm_config.parallel_config.tensor_parallel_size = tp_size
    # What vLLM's engine-core process sets (v1/engine/core.py): the launch rank is always in data_parallel_index;
    # a dense model's DP ranks run as independent engines whose data_parallel_rank is reset to 0.
    vllm_config.parallel_config.data_parallel_index = dp_rank
    vllm_config.parallel_config.data_parallel_rank = dp_rank if moe else 0
    config = KVP2PConfig.from_sources({"side_channel_port": 20000, "host": "127.0.0.1"}, env={})
    side = SchedulerSide(vllm_config, f"engine_dp{dp_rank}", config, make_kv_cache_config(16, 100))
    assert side.side_channel_port == 20000 + dp_rank * tp_size
    worker_ports = {config.side_channel_port_for(dp_rank, tp_size, r) for r in range(tp_size)}
    assert side.side_channel_port in worker_ports  # D adds the P rank to it

    from vllm.v1.request import RequestStatus

    request = SimpleNamespace(request_id="r", kv_transfer_params={"do_remote_decode": True},
                              status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=40,
                              all_token_ids=list(range(41)))
    delay, params = side.request_finished(request, ([1, 2, 3],))
    remote = RemotePrefill.from_params(params)
    assert delay and remote is not None
    assert remote.tp_size == tp_size and remote.remote_port == side.side_channel_port
    assert remote.remote_host == "127.0.0.1"


def test_ports_of_all_ranks_of_two_dp_instances_never_collide() -> None:
    config = KVP2PConfig.from_sources({}, env={})
    ports = [config.side_channel_port_for(dp, 4, tp) for dp in range(8) for tp in range(4)]
    assert len(set(ports)) == len(ports)
