"""A whole P/D deployment on one machine: a prefill ``vllm serve`` (kv_producer), a decode ``vllm serve``
(kv_consumer) and the ``vllm-kvp2p-proxy`` console script in front, all on 127.0.0.1 (each engine gets
``VLLM_KVP2P_HOST=127.0.0.1`` from :class:`VllmServer`: the connector's default is this node's address, and the
P/D traffic of one machine stays on loopback). Used by the demo and the end-to-end tests. Everything it starts,
it stops (by PID / process group).

The connector is found through the installed ``vllm.general_plugins`` entry point, exactly as a user runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvp2p.testing.server import VllmServer, free_port


def start_producer(model_path: Path, log_path: Path, env: Mapping[str, str], cpus: str = "0") -> VllmServer:
    """One more prefill instance (own side-channel port), e.g. to kill or starve in a test."""
    server = VllmServer(
        model_path, free_port(), cpus=cpus, log_path=log_path,
        extra_args=("--kv-transfer-config", kv_transfer_config("kv_producer")),
        env={"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"),
             "VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port()), **env},
    )
    return server


def kv_events_config(endpoint_port: int, replay_port: int) -> str:
    """``--kv-events-config`` for vLLM's ZMQ publisher: PUB on every interface (vLLM binds only a ``*`` endpoint,
    and connects to any other), its replay ROUTER on 127.0.0.1."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{endpoint_port}",
                       "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": ""})


def kv_transfer_config(role: str, failure_policy: str = "fail", **extra: object) -> str:
    """The ``--kv-transfer-config`` value a user passes to ``vllm serve``."""
    config: dict[str, object] = {"kv_connector": "MooncakeP2PConnector", "kv_role": role,
                                 "kv_load_failure_policy": failure_policy}
    if extra:
        config["kv_connector_extra_config"] = extra
    return json.dumps(config)


@dataclass
class ProxyProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def start(
        cls,
        prefill: list[str],
        decode: list[str],
        log_path: Path,
        timeout: float = 120,
        extra_args: tuple[str, ...] = (),
    ) -> ProxyProcess:
        port = free_port()
        script = shutil.which("vllm-kvp2p-proxy", path=os.path.dirname(sys.executable))
        if not script:
            raise RuntimeError("the vllm-kvp2p-proxy console script is not installed next to this Python")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [script, "--host", "127.0.0.1", "--port", str(port), *(("--prefill", *prefill) if prefill else ()),
                 *(("--decode", *decode) if decode else ()), "--timeout", str(timeout), *extra_args],
                stdout=log, stderr=subprocess.STDOUT,
            )
        proxy = cls(f"http://127.0.0.1:{port}", proc, log_path)
        try:  # whatever ends the wait (a signal included), a proxy that is not returned is stopped
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"proxy exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
                try:
                    with urllib.request.urlopen(proxy.url + "/health", timeout=2):
                        return proxy
                except OSError:
                    time.sleep(0.2)
            raise RuntimeError("proxy did not become healthy in 30 s")
        except BaseException:
            proxy.stop()
            raise

    @classmethod
    def start_instances(cls, urls: list[str], log_path: Path, timeout: float = 120) -> ProxyProcess:
        """The proxy of ordinary instances (``--instances``): whole requests, no P step."""
        return cls.start([], [], log_path, timeout, extra_args=("--instances", *urls))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_deployment(producers: list[VllmServer], decoders: list[VllmServer], proxy_log: Path) -> ProxyProcess:
    """Start every engine (they boot in parallel), wait until all serve, then the proxy in front of them; if
    anything fails, stop what was started."""
    servers = [*producers, *decoders]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        return ProxyProcess.start([p.url for p in producers], [d.url for d in decoders], proxy_log)
    except BaseException:
        stop_deployment(None, servers)
        raise


def stop_deployment(proxy: ProxyProcess | None, servers: list[VllmServer]) -> None:
    """The proxy first, then the engines, decoders before producers (the reverse of start_deployment)."""
    if proxy is not None:
        proxy.stop()
    for server in reversed(servers):
        server.stop()


@dataclass
class PDCluster:
    """P on core 0, D on core 1 (vLLM's CPU workers are pinned), proxy in front."""

    model_path: Path
    log_dir: Path
    prefill_env: Mapping[str, str] = field(default_factory=dict)
    decode_env: Mapping[str, str] = field(default_factory=dict)
    decode_extra_config: Mapping[str, object] = field(default_factory=dict)
    decode_failure_policy: str = "fail"  # vLLM's kv_load_failure_policy on D: "fail" or "recompute"
    engine_args: tuple[str, ...] = ()  # more `vllm serve` flags for both engines
    ready_timeout: float = 400.0

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.side_channel_port = free_port()  # P's side-channel base port (rank 0)
        common = {"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
        self.prefill = VllmServer(
            self.model_path, free_port(), cpus="0", log_path=self.log_dir / "prefill.log",
            extra_args=(*self.engine_args, "--kv-transfer-config", kv_transfer_config("kv_producer")),
            env={**common, "VLLM_KVP2P_SIDE_CHANNEL_PORT": str(self.side_channel_port), **self.prefill_env},
            ready_timeout=self.ready_timeout,
        )
        self.decode = VllmServer(
            self.model_path, free_port(), cpus="1", log_path=self.log_dir / "decode.log",
            extra_args=(*self.engine_args, "--kv-transfer-config",
                        kv_transfer_config("kv_consumer", self.decode_failure_policy, **self.decode_extra_config)),
            env={**common, **self.decode_env},
            ready_timeout=self.ready_timeout,
        )
        self.proxy: ProxyProcess | None = None

    @property
    def proxy_url(self) -> str:
        assert self.proxy is not None, "cluster not started"
        return self.proxy.url

    def start(self) -> PDCluster:
        self.proxy = start_deployment([self.prefill], [self.decode], self.log_dir / "proxy.log")
        return self

    def stop(self) -> None:
        stop_deployment(self.proxy, [self.prefill, self.decode])

    def __enter__(self) -> PDCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
