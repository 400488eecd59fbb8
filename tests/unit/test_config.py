"""Settings: sources, precedence, and errors that name the setting and what is allowed."""

from __future__ import annotations

import pytest

from vllm_kvp2p.config import ConfigError, KVP2PConfig


def test_defaults_need_no_settings() -> None:
    c = KVP2PConfig.from_sources({}, env={})
    assert c.host == "127.0.0.1" and c.max_batch_entries == 1024 and c.protocol == ""


def test_env_then_extra_config_precedence() -> None:
    env = {"VLLM_KVP2P_HOLD_TIMEOUT": "30", "VLLM_KVP2P_PROTOCOL": "RDMA"}
    assert KVP2PConfig.from_sources({}, env).hold_timeout == 30.0
    assert KVP2PConfig.from_sources({}, env).protocol == "rdma"
    assert KVP2PConfig.from_sources({"hold_timeout": 5}, env).hold_timeout == 5.0


@pytest.mark.parametrize(
    ("extra", "env", "must_say"),
    [
        ({"protocol": "hccl"}, {}, ["protocol='hccl'", "tcp, rdma, ascend"]),
        ({}, {"VLLM_KVP2P_MAX_BATCH_ENTRIES": "4096"}, ["max_batch_entries=4096", "1..1024"]),
        ({"side_channel_port": 16000}, {}, ["side_channel_port=16000", "15000..17000"]),
        ({"transfer_timeout": 1}, {}, ["transfer_timeout=1", ">= 5"]),
        ({}, {"VLLM_KVP2P_HOLD_TIMEOUT": "soon"}, ["VLLM_KVP2P_HOLD_TIMEOUT='soon'", "seconds"]),
        ({"test_hooks": "maybe"}, {}, ["test_hooks", "true/false"]),
        ({"hold_timeuot": 3}, {}, ["hold_timeuot", "allowed keys"]),
    ],
)
def test_bad_values_name_the_setting_and_allowed_values(extra: dict, env: dict, must_say: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        KVP2PConfig.from_sources(extra, env)
    for text in must_say:
        assert text in str(info.value)


def test_ports_differ_per_dp_and_tp_rank() -> None:
    c = KVP2PConfig.from_sources({"side_channel_port": 20000}, {})
    ports = {c.side_channel_port_for(dp, 4, tp) for dp in range(2) for tp in range(4)}
    assert ports == set(range(20000, 20008))
