"""``vllm-kvp2p check``: each check finds what it is for (a port in use, an address this host lacks, timers that
do not fit, the wrong connector, ports in Mooncake's range, an Ascend node without CANN) and passes otherwise.
Real sockets, a real Mooncake engine, the real console script."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.support.ports import free_port
from vllm_kvp2p.cli import main
from vllm_kvp2p.cli.check import PROBLEM, WARNING, ascend_findings, run, transport_findings

PRODUCER = {"kv_connector": "MooncakeP2PConnector", "kv_role": "kv_producer"}
BASE_ENV = {"VLLM_KVP2P_HOST": "127.0.0.1", "VLLM_KVP2P_SECRET": "x" * 32}


def _env(**settings: str) -> dict[str, str]:
    return {**BASE_ENV, **{f"VLLM_KVP2P_{k.upper()}": v for k, v in settings.items()}}


def problems(report) -> list[tuple[str, str]]:
    return [(f.setting, f.message) for f in report.findings if f.level == PROBLEM]


def test_a_free_configuration_passes() -> None:
    report = run(PRODUCER, _env(side_channel_port=str(free_port())), engine=False)
    assert report.ok, report.to_text()
    assert ("hold_timeout", "120", "default") in report.settings
    assert ("host", "127.0.0.1", "VLLM_KVP2P_HOST") in report.settings


def test_a_side_channel_port_in_use_is_a_problem_naming_the_setting() -> None:
    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen(1)
    try:
        report = run(PRODUCER, _env(side_channel_port=str(port)), engine=False)
    finally:
        holder.close()
    assert ("side_channel_port", f"port {port} on 127.0.0.1 is in use (another instance on this host? give each "
            "its own side_channel_port range)") in problems(report)
    assert run(PRODUCER, _env(side_channel_port=str(port)), engine=False).ok  # the same, once the port is free


def test_every_rank_port_is_checked() -> None:
    base = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", base + 5))  # DP rank 1, TP rank 1 of TP 4 x DP 2
    holder.listen(1)
    try:
        report = run(PRODUCER, _env(side_channel_port=str(base)), tp_size=4, dp_size=2, engine=False)
    finally:
        holder.close()
    assert [s for s, m in problems(report)] == ["side_channel_port"] and f"port {base + 5}" in problems(report)[0][1]


def test_ports_reaching_into_mooncakes_range_are_a_problem() -> None:
    report = run(PRODUCER, _env(side_channel_port="14998"), tp_size=4, engine=False)
    assert any(s == "side_channel_port" and "15000..17000" in m for s, m in problems(report)), report.to_text()


def test_an_address_this_host_lacks_cannot_be_bound() -> None:
    report = run(PRODUCER, _env(host="192.0.2.7", side_channel_port=str(free_port())), engine=False)
    assert any(s == "host" and "not an address of this host" in m for s, m in problems(report)), report.to_text()
    # Behind NAT: bind every interface, advertise the outside address: only a warning.
    report = run(PRODUCER, _env(host="192.0.2.7", bind_host="0.0.0.0", side_channel_port=str(free_port())),
                 engine=False)
    assert report.ok, report.to_text()
    assert any(f.level == WARNING and f.setting == "host" and "not an address of this host" in f.message
               for f in report.findings)


def test_timers_that_do_not_fit_name_both_settings() -> None:
    report = run(PRODUCER, _env(lease_timeout="10"), engine=False)
    ((setting, message),) = problems(report)
    assert setting == "lease_timeout" and "transfer_timeout" in message


def test_the_wrong_connector_or_role() -> None:
    report = run({"kv_connector": "NixlConnector", "kv_role": "kv_decoder"}, _env(), engine=False)
    assert {s for s, _ in problems(report)} == {"kv_connector", "kv_role"}


def test_no_secret_is_a_warning() -> None:
    env = _env(side_channel_port=str(free_port()))
    del env["VLLM_KVP2P_SECRET"]
    report = run(PRODUCER, env, engine=False)
    assert report.ok and any(f.level == WARNING and f.setting == "secret" for f in report.findings)


def test_a_real_mooncake_engine_starts_and_moves_data() -> None:
    report = run(PRODUCER, _env(side_channel_port=str(free_port())))
    assert any(f.setting == "mooncake engine" and "reads 64 KiB" in f.message for f in report.findings), \
        report.to_text()


def test_rdma_without_the_nic_is_a_problem_though_mooncake_starts_with_it(tmp_path) -> None:
    from vllm_kvp2p.contract.config import KVP2PConfig

    config = KVP2PConfig.from_sources({"protocol": "rdma", "device_name": "mlx5_0"}, {})
    (tmp_path / "none").mkdir()
    assert [f.setting for f in transport_findings(config, "rdma", tmp_path / "none") if f.level == PROBLEM] == [
        "protocol"]
    (tmp_path / "nics" / "mlx5_1").mkdir(parents=True)
    assert [f.setting for f in transport_findings(config, "rdma", tmp_path / "nics") if f.level == PROBLEM] == [
        "device_name"]
    (tmp_path / "nics" / "mlx5_0").mkdir()
    assert all(f.level != PROBLEM for f in transport_findings(config, "rdma", tmp_path / "nics"))
    # Mooncake itself does not tell: it starts with rdma and a NIC that does not exist, and moves data (over TCP).
    report = run(PRODUCER, _env(side_channel_port=str(free_port()), protocol="rdma", device_name="no-such-nic0"))
    assert any(f.setting == "mooncake engine" and "reads 64 KiB" in f.message for f in report.findings)
    assert any(s == "protocol" and "no RDMA device" in m for s, m in problems(report)), report.to_text()


def test_ascend_protocol_needs_the_npu_build_of_mooncake() -> None:
    from vllm_kvp2p.contract.config import KVP2PConfig

    found = transport_findings(KVP2PConfig.from_sources({"protocol": "ascend"}, {}), "ascend")
    assert [(f.level, f.setting) for f in found] == [(PROBLEM, "protocol")]  # the non-cuda build is installed


def test_ascend_checks_on_a_node_without_torch_npu_or_cann(tmp_path) -> None:
    found = ascend_findings({"ASCEND_TOOLKIT_HOME": str(tmp_path / "missing")}, "tcp")
    by_setting = {f.setting: f.level for f in found}
    assert by_setting["torch_npu"] == PROBLEM  # not installed here
    assert by_setting["protocol"] == WARNING and by_setting["HCCL_IF_IP"] == WARNING
    (tmp_path / "cann" / "include" / "acl").mkdir(parents=True)
    (tmp_path / "cann" / "include" / "acl" / "acl.h").write_text("")
    found = ascend_findings({"ASCEND_TOOLKIT_HOME": str(tmp_path / "cann"), "HCCL_IF_IP": "10.0.0.1"}, "ascend")
    assert {f.setting: f.level for f in found}.get("ASCEND_TOOLKIT_HOME") == "ok"


def test_main_exits_1_with_json_for_scripts(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in _env(lease_timeout="10").items():
        monkeypatch.setenv(key, value)
    assert main(["check", "--no-engine", "--json", "--kv-transfer-config", json.dumps(PRODUCER)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["problems"][0]["setting"] == "lease_timeout"


def test_the_console_script_runs() -> None:
    script = shutil.which("vllm-kvp2p", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.fail("the vllm-kvp2p console script is not installed next to this Python (pip install -e .)")
    env = {**os.environ, **_env(side_channel_port=str(free_port()))}
    done = subprocess.run([script, "check", "--no-engine", "--kv-transfer-config", json.dumps(PRODUCER)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 problem(s)" in done.stdout and "side_channel_port" in done.stdout
    ref = subprocess.run([script, "config-reference"], capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0 and "| `hold_timeout` | `VLLM_KVP2P_HOLD_TIMEOUT` |" in ref.stdout


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "@/nonexistent/kv.json"])
def test_an_unreadable_kv_transfer_config_exits_2_with_one_line(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--no-engine", "--kv-transfer-config", text]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("PROBLEM  --kv-transfer-config: ")


@pytest.mark.parametrize("extra", [5, "x" * 100_000, [1, 2]])
def test_extra_config_of_the_wrong_type_is_a_problem(extra: object) -> None:
    report = run({**PRODUCER, "kv_connector_extra_config": extra}, _env(side_channel_port=str(free_port())),
                 engine=False)
    assert ("kv_connector_extra_config", f"must be a JSON object, got {extra!r}") in problems(report)


@pytest.mark.parametrize("value", ["-5", "1e309", "99999999999999999999", "nan"])
def test_absurd_setting_values_are_problems_naming_the_setting(value: str) -> None:
    report = run(PRODUCER, _env(side_channel_port=value), engine=False)
    # A value that does not parse is named as given (the variable), one that parses but is out of range by key.
    assert [s for s, _ in problems(report)] in (["side_channel_port"], ["VLLM_KVP2P_SIDE_CHANNEL_PORT"]), \
        report.to_text()


def test_pipeline_stages_count_in_the_side_channel_ports() -> None:
    """P at PP 2 x TP 2 x DP 2 listens on 8 ports: each DP rank's 4 ranks (stage * tp_size + tp rank)."""
    from vllm_kvp2p.cli.check import side_channel_ports
    from vllm_kvp2p.contract.config import KVP2PConfig

    config = KVP2PConfig.from_sources({"side_channel_port": 20000}, {})
    assert side_channel_ports(config, 2, 2, pp_size=2) == list(range(20000, 20008))
    assert [config.side_channel_port_for(dp, 4, rank) for dp in range(2) for rank in range(4)] == \
        side_channel_ports(config, 2, 2, pp_size=2)
