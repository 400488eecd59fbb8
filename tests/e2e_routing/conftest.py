"""Two prefill engines and one decode engine publishing their KV events, and two proxies in front of them: one
routing by those events (``--routing prefix-aware`` with ``--prefill-kv-events`` / ``--decode-kv-events``, the
default policy), one with ``--routing least-outstanding`` as the control. All on 127.0.0.1; started once for the
package.

The engines set ``PYTHONHASHSEED`` and the routing proxy gets the same ``--hash-seed``: vLLM 0.23 hashes with a
random per-process seed without it, so no router could match its hashes (vLLM 0.32's fixed default is covered by
tests/unit/test_kv_events_vllm.py). Each P keeps 64 blocks of KV (4 MiB, one of them vLLM's null block): a few
prompts evict the oldest. Both proxies run with ``--cache-headers``: the tests read the cached-token counts.
The two P engines are started as ``kv_both`` (D's test hooks on): every routing test uses them as P, and
test_kv_both_end_to_end.py as P and D of each other at once, behind proxies of its own (``--kv-both``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vllm_kvp2p.testing.cluster import ProxyProcess, kv_events_config, kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, free_port
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

HASH_SEED = "12345"
P_KV_BYTES = 4 * 2**20  # 64 blocks of 32 tokens of the tiny model
#: The tests read X-KVP2P-*-Cached-Tokens, which a proxy sends only when told (an oracle over other clients' prompts).
CACHE_HEADERS = ("--cache-headers",)


#: Modules run after the others: they fill the P engines' small prefix caches, whose contents the routing tests count.
LAST = ("test_kv_both_end_to_end.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This package's modules in file order, but :data:`LAST` after the rest of the package (and still before the
    next package: its engines are started once). The hook sees the whole session's items: only this package's
    run of them is reordered."""
    here = Path(__file__).parent
    mine = [i for i, item in enumerate(items) if item.path.parent == here]
    if mine:
        block = items[mine[0]:mine[-1] + 1]
        block.sort(key=lambda item: item.path.parent == here and item.path.name in LAST)  # stable
        items[mine[0]:mine[-1] + 1] = block


@dataclass
class RoutingCluster:
    producers: list[VllmServer]
    decode: VllmServer
    events: dict[str, tuple[int, int]]  # url -> (publisher port, replay port)
    proxy: ProxyProcess | None = None  # prefix-aware, by the engines' KV events
    control: ProxyProcess | None = None  # least-outstanding
    log_dir: object = None
    _all: list[VllmServer] = field(default_factory=list)

    @property
    def prefill(self) -> VllmServer:  # tests.e2e.helpers.baseline answers on the first P
        return self.producers[0]

    @property
    def proxy_url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def endpoints(self, server: VllmServer) -> str:
        pub, replay = self.events[server.url]
        return f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}"

    def stop(self) -> None:
        for proxy in (self.proxy, self.control):
            if proxy is not None:
                proxy.stop()
        for server in (self.decode, *self.producers):
            server.stop()


def _engine(model: object, name: str, role: str, cpus: str, logs: object, extra: tuple[str, ...], env: dict[str, str],
            events: dict[str, tuple[int, int]], **extra_config: object) -> VllmServer:
    pub, replay = free_port(), free_port()
    server = VllmServer(
        model, free_port(), cpus=cpus, log_path=logs / f"{name}.log",  # type: ignore[operator]
        extra_args=("--kv-transfer-config",
                    kv_transfer_config(role, "recompute" if role == "kv_consumer" else "fail", **extra_config),
                    "--kv-events-config", kv_events_config(pub, replay), *extra),
        env={"MC_LOG_LEVEL": "ERROR", "PYTHONHASHSEED": HASH_SEED, **env},
        ready_timeout=400,
    )
    events[server.url] = (pub, replay)
    return server


@pytest.fixture(scope="package")
def routing_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RoutingCluster]:
    model = make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")
    logs = tmp_path_factory.mktemp("routing-logs")
    events: dict[str, tuple[int, int]] = {}
    small_kv = ("--kv-cache-memory-bytes", str(P_KV_BYTES), "--max-model-len", "1024")  # 63 blocks + the null one
    p_env = {"VLLM_KVP2P_HOLD_TIMEOUT": "30", "VLLM_KVP2P_TRANSFER_TIMEOUT": "20"}
    # kv_both (with D's test hooks): the routing tests use them as P; tests/e2e_routing/test_kv_both_end_to_end.py
    # as P and D of each other at once.
    producers = [
        _engine(model, f"prefill{i}", "kv_both", str(i), logs, small_kv,
                {**p_env, "VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port())}, events, test_hooks=True)
        for i in range(2)
    ]
    decode = _engine(model, "decode", "kv_consumer", "0", logs, (), {"VLLM_KVP2P_TRANSFER_TIMEOUT": "20"}, events)
    cluster = RoutingCluster(producers, decode, events, log_dir=logs)
    try:
        for server in (*producers, decode):
            server.start()
        for server in (*producers, decode):
            server.wait_ready()
        urls = [p.url for p in producers]
        cluster.proxy = ProxyProcess.start(
            urls, [decode.url], logs / "proxy.log",
            extra_args=("--prefill-kv-events", *(cluster.endpoints(p) for p in producers),
                        "--decode-kv-events", cluster.endpoints(decode), "--hash-seed", HASH_SEED, *CACHE_HEADERS),
        )
        cluster.control = ProxyProcess.start(urls, [decode.url], logs / "control-proxy.log",
                                             extra_args=("--routing", "least-outstanding", *CACHE_HEADERS))
        yield cluster
    finally:
        cluster.stop()
