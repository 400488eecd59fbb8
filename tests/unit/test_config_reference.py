"""docs/configuration.md's settings table is generated from vllm_kvp2p/contract/config.py: the two cannot drift."""

from __future__ import annotations

from pathlib import Path

from vllm_kvp2p.contract.config import _PARSERS, KVP2PConfig, setting_names
from vllm_kvp2p.contract.config_reference import TABLE_BEGIN, TABLE_END, reference_table, with_reference_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def generated_section(text: str) -> str:
    start = text.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    return text[start:text.index(TABLE_END, start)]


def test_configuration_doc_has_the_generated_table() -> None:
    assert generated_section(DOC.read_text()) == reference_table(), (
        "docs/configuration.md is out of date: regenerate its settings table with `vllm-kvp2p config-reference`")


def test_a_changed_setting_shows_as_drift() -> None:
    doc = generated_section(DOC.read_text())
    assert doc.replace("`14600`", "`14700`") != reference_table()


def test_regenerating_replaces_only_the_table() -> None:
    text = DOC.read_text()
    stale = text.replace("`14600`", "`14700`", 1)
    assert stale != text and with_reference_table(stale) == text


def test_every_setting_is_documented_parsed_and_named_in_the_table() -> None:
    table = reference_table()
    for name in setting_names():
        assert name in _PARSERS, name
        assert f"| `{name}` | `VLLM_KVP2P_{name.upper()}` |" in table
    assert "secret" not in setting_names() and "sources" not in setting_names()


def test_sources_say_where_each_setting_came_from() -> None:
    config = KVP2PConfig.from_sources({"hold_timeout": 3}, {"VLLM_KVP2P_PROTOCOL": "tcp",
                                                            "VLLM_KVP2P_HOLD_TIMEOUT": "9"})
    rows = {key: (value, source) for key, value, source in config.resolved()}
    assert rows["hold_timeout"] == ("3", "kv_connector_extra_config")  # the extra config wins
    assert rows["protocol"] == ("tcp", "VLLM_KVP2P_PROTOCOL")
    assert rows["lease_timeout"] == ("60", "default")
    assert rows["secret"] == ("not set", "default")
    line = config.describe()
    assert "hold_timeout=3 (kv_connector_extra_config)" in line and "lease_timeout=60," in line


def test_the_secret_is_never_shown(tmp_path: Path) -> None:
    secret = "s3cret-" + "x" * 20
    config = KVP2PConfig.from_sources({}, {"VLLM_KVP2P_SECRET": secret})
    assert secret not in config.describe() and secret not in repr(config.resolved())
    assert ("secret", "set", "VLLM_KVP2P_SECRET") in config.resolved()
    path = tmp_path / "s"
    path.write_text(secret)
    config = KVP2PConfig.from_sources({"secret_file": str(path)}, {})
    assert ("secret", "set", f"secret_file {path}") in config.resolved()
