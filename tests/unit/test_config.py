"""Settings: sources, precedence, and errors that name the setting and what is allowed."""

from __future__ import annotations

import pytest

from vllm_kvp2p.contract.config import ConfigError, KVP2PConfig


def test_defaults_need_no_settings() -> None:
    c = KVP2PConfig.from_sources({}, env={})
    assert c.host == "" and c.bind_host == "" and c.max_batch_entries == 1024 and c.protocol == ""


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


# ------------------------------------------------------------------ bind and advertise

def test_unset_host_advertises_the_detected_address_and_binds_it() -> None:
    c = KVP2PConfig.from_sources({}, env={})
    host = c.advertised_host(lambda: "10.1.2.3")
    assert host == "10.1.2.3" and c.side_channel_bind_host(host) == "10.1.2.3"


def test_set_host_wins_over_detection_and_bind_host_over_it() -> None:
    def detect() -> str:
        raise AssertionError("host is set: nothing to detect")

    c = KVP2PConfig.from_sources({"bind_host": "0.0.0.0"}, env={"VLLM_KVP2P_HOST": " 127.0.0.1 "})
    assert c.advertised_host(detect) == "127.0.0.1"
    assert c.side_channel_bind_host(c.advertised_host(detect)) == "0.0.0.0"
    env = {"VLLM_KVP2P_BIND_HOST": "10.0.0.9", "VLLM_KVP2P_HOST": "fd00::7"}
    c = KVP2PConfig.from_sources({}, env=env)
    assert (c.advertised_host(detect), c.side_channel_bind_host("fd00::7")) == ("fd00::7", "10.0.0.9")


def test_a_host_name_is_advertised_as_its_address_resolved_once_at_start_up() -> None:
    """D accepts only addresses in params (nothing on the request path waits for a resolver): P resolves a name
    it is given when it starts, or refuses to start naming the setting."""
    c = KVP2PConfig.from_sources({}, env={"VLLM_KVP2P_HOST": "localhost"})
    assert c.advertised_host(lambda: "") in ("127.0.0.1", "::1")
    with pytest.raises(ConfigError, match="host='no-such-host.invalid' does not resolve.*VLLM_KVP2P_HOST"):
        KVP2PConfig.from_sources({}, env={"VLLM_KVP2P_HOST": "no-such-host.invalid"}).advertised_host(lambda: "")


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_wildcard_host_is_refused_naming_the_settings(wildcard: str) -> None:
    for extra, env in (({}, {"VLLM_KVP2P_HOST": wildcard}), ({"host": wildcard}, {})):
        with pytest.raises(ConfigError) as info:
            KVP2PConfig.from_sources(extra, env)
        for text in (f"host={wildcard!r}", "VLLM_KVP2P_HOST", "VLLM_HOST_IP", "bind_host"):
            assert text in str(info.value)


@pytest.mark.parametrize("detected", ["0.0.0.0", "", "::"])
def test_detection_without_an_address_is_refused_naming_the_settings(detected: str) -> None:
    """vLLM's get_ip() returns 0.0.0.0 when no route leads anywhere (and VLLM_HOST_IP=0.0.0.0 gives the same)."""
    c = KVP2PConfig.from_sources({}, env={})
    with pytest.raises(ConfigError) as info:
        c.advertised_host(lambda: detected)
    assert "VLLM_KVP2P_HOST" in str(info.value) and "VLLM_HOST_IP" in str(info.value)


def test_detection_is_vllms_get_ip_which_honours_vllm_host_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_kvp2p.connector import compat

    monkeypatch.setenv("VLLM_HOST_IP", "10.9.8.7")
    assert KVP2PConfig.from_sources({}, env={}).advertised_host(compat.node_ip) == "10.9.8.7"


def test_the_lease_must_outlast_the_longest_action_and_the_renewal_after_it() -> None:
    """A read that outlives its lease can read blocks P has freed: refused at start-up, naming the settings."""
    with pytest.raises(ConfigError) as info:
        KVP2PConfig.from_sources({"lease_timeout": 48, "transfer_timeout": 30}, {})
    message = str(info.value)
    assert "lease_timeout=48 with transfer_timeout=30 and side_channel_timeout=5" in message
    assert "48.75 s" in message and "VLLM_KVP2P_LEASE_TIMEOUT" in message  # 1.5 x (0.5 + 30 + 1 + 1)
    assert KVP2PConfig.from_sources({"lease_timeout": 49, "transfer_timeout": 30}, {}).lease_timeout == 49
    # A side-channel call longer than any read is the longest action then.
    with pytest.raises(ConfigError, match=r"lease_timeout=40 with transfer_timeout=5 and side_channel_timeout=30"):
        KVP2PConfig.from_sources({"lease_timeout": 40, "transfer_timeout": 5, "side_channel_timeout": 30}, {})
    assert KVP2PConfig.from_sources({"lease_timeout": 47, "transfer_timeout": 5, "side_channel_timeout": 30},
                                    {}).lease_timeout == 47  # > 1.5 x (30 + 1)
    # What was valid stays valid: the defaults, and the short timers of the soak and the two-host tests.
    assert KVP2PConfig().lease_timeout == 60 and KVP2PConfig.from_sources({}, {}).lease_timeout == 60
    assert KVP2PConfig.from_sources({"lease_timeout": 20, "transfer_timeout": 10, "hold_timeout": 20}, {})


@pytest.mark.parametrize("transfer_timeout", [5.0, 10.0, 30.0])
def test_a_lease_the_check_refuses_does_lapse_under_the_longest_read(transfer_timeout: float) -> None:
    """The check's pair: on a simulated clock against P's real ledger, the worst case (the longest read starts just
    before a renewal is due; the renewal then takes RENEWAL_REACHES_P_S to reach P). A lease just short of the
    check's bound lapses (P frees the blocks mid-pull); one just above it holds through the pull."""
    from tests.unit.consumer_pulls import held_ledgers, run_against_p, tp2_pull
    from vllm_kvp2p.contract.config import READ_RETRY_WITHIN, READ_SLOT_WAIT_S, RENEWAL_REACHES_P_S
    from vllm_kvp2p.lifecycle.pull import Outcome

    longest_read = READ_SLOT_WAIT_S + transfer_timeout + READ_RETRY_WITHIN
    bound = 1.5 * (longest_read + RENEWAL_REACHES_P_S)
    for lease, valid in ((bound - 0.05, False), (bound + 0.05, True)):
        settings = {"lease_timeout": lease, "transfer_timeout": transfer_timeout}
        if valid:
            KVP2PConfig.from_sources(settings, {})
        else:
            with pytest.raises(ConfigError):
                KVP2PConfig.from_sources(settings, {})
        ledgers = held_ledgers(lease)
        result = run_against_p(tp2_pull(max_batch_entries=1), ledgers,
                               read_seconds={0: longest_read, 1: longest_read}, read_from=lease / 3 - 0.001,
                               renew_reaches_p=RENEWAL_REACHES_P_S)
        assert (result.outcome is Outcome.PULLED) is valid, result.reason
        assert ledgers[0].counters["lease_lapsed"] == (0 if valid else 1)


def test_a_rank_port_inside_mooncakes_range_is_refused_naming_the_setting() -> None:
    import pytest as _pytest

    from vllm_kvp2p.contract.config import ConfigError, KVP2PConfig

    config = KVP2PConfig.from_sources({"side_channel_port": 14998}, {})
    assert config.side_channel_port_for(0, 2, 1) == 14999
    with _pytest.raises(ConfigError, match=r"side_channel_port=14998: DP rank 0 rank 2 .* 15000\.\.17000"):
        config.side_channel_port_for(0, 4, 2)
    with _pytest.raises(ConfigError, match="above 65535"):
        KVP2PConfig.from_sources({"side_channel_port": 65000}, {}).side_channel_port_for(1, 600, 0)


@pytest.mark.parametrize("value", [0, -1, 1.5, 1e308, "nan", "inf", "abc", "½", [0.5]])
def test_an_absurd_share_of_verified_pulls_is_refused_naming_the_setting(value: object) -> None:
    with pytest.raises(ConfigError, match="integrity_sampled_pulls"):
        KVP2PConfig.from_sources({"integrity_sampled_pulls": value}, env={})


def test_the_share_of_verified_pulls_from_the_environment() -> None:
    config = KVP2PConfig.from_sources({}, env={"VLLM_KVP2P_INTEGRITY_SAMPLED_PULLS": "0.5"})
    assert config.integrity_sampled_pulls == 0.5
