"""The vLLM plugin: found through the installed entry point, cheap, idempotent, and polite to other names."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points


def test_entry_point_is_installed() -> None:
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value == "vllm_kvp2p:register"]
    assert eps, "vllm_kvp2p:register is not registered under vllm.general_plugins (package not installed?)"


def test_importing_the_plugin_imports_neither_torch_nor_mooncake() -> None:
    code = "import sys, vllm_kvp2p; print(sorted(m for m in ('torch', 'mooncake', 'vllm', 'zmq') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_register_is_idempotent_and_resolves_the_connector() -> None:
    code = """
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
KVConnectorFactory.register_connector("SomeoneElsesConnector", "some.module", "SomeClass")
import vllm_kvp2p
for _ in range(3):
    vllm_kvp2p.register()
from vllm.config import KVTransferConfig
cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="MooncakeP2PConnector", kv_role="kv_both"))
print(cls.__module__, cls.__name__, "MooncakeConnector" in KVConnectorFactory._registry)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "vllm_kvp2p.connector.facade MooncakeP2PConnector True"


def test_sleep_mode_is_refused() -> None:
    """vLLM >= 0.33 asks connectors before honouring --enable-sleep-mode (config/vllm.py) and its base says yes;
    sleep would free or remap the KV cache Mooncake has registered for peers, so this connector says no."""
    from vllm_kvp2p.connector.facade import MooncakeP2PConnector

    assert MooncakeP2PConnector.supports_sleep_mode(None) is False
