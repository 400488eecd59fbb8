"""One real P/D deployment per test session, on 127.0.0.1: a prefill `vllm serve` (kv_producer), a decode
`vllm serve` (kv_consumer, test hooks on) and the `vllm-kvp2p-proxy` console script in front of them.

The connector is found through the installed ``vllm.general_plugins`` entry point (no module path), exactly as a
user runs it. Each vLLM worker is pinned to its own core. Everything started here is stopped here, by PID.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_kvp2p.testing.server import VllmServer, free_port
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

BLOCK_SIZE = 32


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def kv_config(role: str, **extra: object) -> str:
    return json.dumps({"kv_connector": "MooncakeP2PConnector", "kv_role": role, "kv_connector_extra_config": extra})


@dataclass
class Proxy:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_proxy(prefill: list[str], decode: list[str], log_path: Path, timeout: float = 120) -> Proxy:
    port = free_port()
    script = shutil.which("vllm-kvp2p-proxy", path=os.path.dirname(sys.executable))
    assert script, "the vllm-kvp2p-proxy console script is not installed"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [script, "--host", "127.0.0.1", "--port", str(port), "--prefill", *prefill, "--decode", *decode,
         "--timeout", str(timeout)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    proxy = Proxy(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"proxy exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(proxy.url + "/health", timeout=2):
                return proxy
        except OSError:
            time.sleep(0.2)
    proxy.stop()
    raise RuntimeError("proxy did not become healthy in 30 s")


@dataclass
class Cluster:
    prefill: VllmServer
    decode: VllmServer
    proxy: Proxy
    side_channel_port: int


@pytest.fixture(scope="session")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("pd-logs")
    side_port = free_port()  # P's side channel: base port, rank 0
    common_env = {"MC_LOG_LEVEL": "ERROR", "VLLM_KVP2P_TRANSFER_TIMEOUT": "5"}
    prefill = VllmServer(
        tiny_model_dir, free_port(), cpus="0", log_path=logs / "prefill.log",
        extra_args=("--kv-transfer-config", kv_config("kv_producer")),
        env={**common_env, "VLLM_KVP2P_SIDE_CHANNEL_PORT": str(side_port), "VLLM_KVP2P_HOLD_TIMEOUT": "60"},
        ready_timeout=400,
    )
    decode = VllmServer(
        tiny_model_dir, free_port(), cpus="1", log_path=logs / "decode.log",
        extra_args=("--kv-transfer-config", kv_config("kv_consumer", test_hooks=True)),
        env={**common_env, "VLLM_KVP2P_CLAIM_WAIT": "5"},
        ready_timeout=400,
    )
    proxy: Proxy | None = None
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        proxy = start_proxy([prefill.url], [decode.url], logs / "proxy.log")
        yield Cluster(prefill, decode, proxy, side_port)
    finally:
        if proxy is not None:
            proxy.stop()
        decode.stop()
        prefill.stop()
