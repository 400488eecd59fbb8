"""The Kubernetes manifests of docs/deploy-ascend.md (deploy/k8s/): valid YAML, LeaderWorkerSets whose pods give the
connector what it needs on every node (its own address from the pod IP, the secret from a Secret, the gloo/HCCL
interface, a side-channel port for each of its ranks) and whose commands start the engine the way the tests start
it over two hosts (tests/e2e_multinode: node rank 0 with the API server, the other node --headless). Each check is
shown to fail on a manifest with the field taken out."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_kvp2p.contract.config import KVP2PConfig

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
PREFILL = K8S / "prefill-tp16-lws.yaml"
DECODE = K8S / "decode-dp16-ep-lws.yaml"
CONNECTOR = "MooncakeP2PConnector"


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def command_of(container: dict[str, Any]) -> list[str]:
    """The engine's command line (``sh -c "<args>"``), split as the shell would (variables left as written)."""
    assert container["command"] == ["sh", "-c"], container["command"]
    return shlex.split(container["args"][0])


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def pod_problems(role: str, container: dict[str, Any], ranks: range, producer: bool) -> list[str]:
    """What is missing for the connector in one pod of an engine whose ranks ``ranks`` run there."""
    problems = []
    env = env_of(container)
    host = env.get("VLLM_HOST_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if host != "status.podIP":
        problems.append(f"{role}: VLLM_HOST_IP is not the pod IP (status.podIP)")
    secret = env.get("VLLM_KVP2P_SECRET", {})
    if "value" in secret or not secret.get("valueFrom", {}).get("secretKeyRef", {}).get("name"):
        problems.append(f"{role}: VLLM_KVP2P_SECRET does not come from a Kubernetes Secret (secretKeyRef)")
    if not env.get("GLOO_SOCKET_IFNAME", {}).get("value"):
        problems.append(f"{role}: GLOO_SOCKET_IFNAME is not set")
    argv = command_of(container)
    config = json.loads(flag(argv, "--kv-transfer-config") or "{}")
    role_wanted = "kv_producer" if producer else "kv_consumer"
    if config.get("kv_connector") != CONNECTOR or config.get("kv_role") != role_wanted:
        problems.append(f"{role}: --kv-transfer-config is not {CONNECTOR} as {role_wanted}")
    if producer:
        base = int(env.get("VLLM_KVP2P_SIDE_CHANNEL_PORT", {}).get("value", KVP2PConfig().side_channel_port))
        open_ports = {p["containerPort"] for p in container.get("ports", [])}
        missing = [base + r for r in ranks if base + r not in open_ports]
        if missing:
            problems.append(f"{role}: no containerPort for the side channels {missing}")
    return problems


def engine_problems(docs: list[dict[str, Any]], producer: bool) -> list[str]:
    (lws,) = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    problems = []
    assert lws["apiVersion"].startswith("leaderworkerset.x-k8s.io/")
    template = lws["spec"]["leaderWorkerTemplate"]
    nodes = template["size"]
    if template.get("restartPolicy") != "RecreateGroupOnPodRestart":
        problems.append("restartPolicy is not RecreateGroupOnPodRestart (a lost node must restart the engine)")
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    leader_argv, worker_argv = command_of(leader), command_of(worker)
    if "--headless" in leader_argv or "--headless" not in worker_argv:
        problems.append("the leader must run the API server and the worker --headless")
    tp = int(flag(leader_argv, "--tensor-parallel-size") or 1)
    per_node = tp // nodes if flag(leader_argv, "--nnodes") else tp
    if flag(leader_argv, "--nnodes"):
        if flag(leader_argv, "--node-rank") != "0" or flag(worker_argv, "--node-rank") != "${LWS_WORKER_INDEX}":
            problems.append("node ranks: the leader 0, each worker its LWS_WORKER_INDEX")
        if flag(leader_argv, "--master-addr") != "${LWS_LEADER_ADDRESS}":
            problems.append("--master-addr is not the leader's address")
    problems += pod_problems("leader", leader, range(per_node), producer)
    problems += pod_problems("worker", worker, range(per_node, 2 * per_node), producer)
    services = [d for d in docs if d["kind"] == "Service"]
    if not any(s["spec"]["selector"].get("role") == "leader" for s in services):
        problems.append("no Service selects the leader (the API server)")
    return problems


def test_the_manifests_are_valid_yaml_of_leader_worker_sets() -> None:
    for path in (PREFILL, DECODE):
        kinds = [d["kind"] for d in load(path)]
        assert kinds == ["LeaderWorkerSet", "Service"], (path, kinds)


def test_the_prefill_engine_over_two_nodes_gives_the_connector_what_it_needs() -> None:
    docs = load(PREFILL)
    assert engine_problems(docs, producer=True) == []
    lws = docs[0]["spec"]["leaderWorkerTemplate"]
    assert lws["size"] == 2 and flag(command_of(lws["leaderTemplate"]["spec"]["containers"][0]),
                                     "--tensor-parallel-size") == "16"


def test_the_decode_engine_over_two_nodes_gives_the_connector_what_it_needs() -> None:
    docs = load(DECODE)
    assert engine_problems(docs, producer=False) == []
    worker = docs[0]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    argv = command_of(worker)
    assert flag(argv, "--data-parallel-start-rank") == "$((LWS_WORKER_INDEX*8))"
    assert flag(argv, "--data-parallel-address") == "${LWS_LEADER_ADDRESS}"
    # D may contact every side channel of the 16-rank P above, and nothing else
    peer_ports = env_of(worker)["VLLM_KVP2P_PEER_PORTS"]["value"]
    assert KVP2PConfig.from_sources({"peer_ports": peer_ports}, {}).peer_port_ranges() == ((14600, 14615),)


def _without(docs: list[dict[str, Any]], where: str, name: str) -> list[dict[str, Any]]:
    changed = copy.deepcopy(docs)
    container = changed[0]["spec"]["leaderWorkerTemplate"][where]["spec"]["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != name]  # its own copy of the anchored list
    return changed


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: _without(d, "workerTemplate", "VLLM_HOST_IP"), "worker: VLLM_HOST_IP is not the pod IP"),
    (lambda d: _without(d, "leaderTemplate", "GLOO_SOCKET_IFNAME"), "leader: GLOO_SOCKET_IFNAME is not set"),
    (lambda d: _without(d, "leaderTemplate", "VLLM_KVP2P_SECRET"), "leader: VLLM_KVP2P_SECRET does not come"),
    ("literal secret", "worker: VLLM_KVP2P_SECRET does not come from a Kubernetes Secret"),
    ("port dropped", "worker: no containerPort for the side channels [14615]"),
    ("leader headless", "the leader must run the API server"),
])
def test_each_check_fails_on_a_manifest_without_its_field(change: Any, message: str) -> None:
    docs = load(PREFILL)
    if change == "literal secret":
        docs = _without(docs, "workerTemplate", "VLLM_KVP2P_SECRET")
        docs[0]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["env"].append(
            {"name": "VLLM_KVP2P_SECRET", "value": "0" * 64})
    elif change == "port dropped":
        docs = copy.deepcopy(docs)
        worker = docs[0]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
        worker["ports"] = [p for p in worker["ports"] if p["containerPort"] != 14615]
    elif change == "leader headless":
        docs = copy.deepcopy(docs)
        leader = docs[0]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
        leader["args"] = [re.sub(r"--port 8100", "--headless", leader["args"][0])]
    else:
        docs = change(docs)
    assert any(message in p for p in engine_problems(docs, producer=True)), engine_problems(docs, producer=True)
