"""vllm-router 0.1.17 in P/D mode with its ``kv_aware`` policy, fed by the same engines' KV events, in front of
this connector: it drives it (answers equal the single instance, D pulls), and it cannot route by those events at
vLLM CPU's block size.

Its ``kv_aware`` hashes the ``token_ids`` of the events itself, in 16-token chunks, and in P/D mode takes only
16-token blocks (``--pd-kv-events``: "Block size is 16"); vLLM's CPU attention needs a multiple of 32 (and
vllm-ascend runs 128), so every batch is rejected (``BlockSizeMismatch`` at debug level) and it routes by load.
vLLM 0.23's events (arrays, not tagged maps) it does not decode at all; the test expects the one message of the
running vLLM.
docs/routing.md says so; this test keeps that statement true for the pinned release.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import LOGPROB_TOL, baseline, completion_body, max_logprob_gap, prompt_ids, wait_kv_idle
from tests.e2e_routing.conftest import RoutingCluster
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.server import VllmServer, free_port
from vllm_kvp2p.testing.sse import sse_lines


@pytest.fixture(scope="module")
def kv_aware_router(
    routing_cluster: RoutingCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    binary = shutil.which("vllm-router", path=os.path.dirname(sys.executable))
    if binary is None:
        pytest.fail("vllm-router is not installed next to this Python (the test extras install vllm-router==0.1.17)")
    c = routing_cluster
    log = tmp_path_factory.mktemp("router") / "vllm-router.log"
    port = free_port()
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
           "--vllm-pd-disaggregation", "--prefill-policy", "kv_aware", "--log-level", "debug"]
    for p in c.producers:
        cmd += ["--prefill", p.url, "--pd-kv-events", f"{p.url}=tcp://127.0.0.1:{c.events[p.url][0]}"]
    cmd += ["--decode", c.decode.url]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "vllm-router did not become healthy in 60 s"
                time.sleep(0.3)
        yield url, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def test_kv_aware_router_drives_this_connector_but_rejects_its_block_size(
    routing_cluster: RoutingCluster, kv_aware_router: tuple[str, Path]
) -> None:
    c = routing_cluster
    url, log = kv_aware_router
    prefix = prompt_ids(192, seed=50)
    for k in range(3):
        prompt = prefix + prompt_ids(40, seed=60 + k)
        r = httpx.post(url + "/v1/completions", json=completion_body(prompt), timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert max_logprob_gap(body, baseline(c, prompt)) <= LOGPROB_TOL
        report = body["kv_transfer_params"][PULL_REPORT_KEY]
        assert report["ok"] and report["blocks"] > 0, report  # D pulled from whichever P the router chose
    # Every event batch dropped, with the one message this vLLM's event encoding gives (see REJECTION); never the
    # other. The router colours its log fields (escape codes inside "reason=..."): compared without them.
    expected, other = rejection_of_this_vllm()
    deadline = time.monotonic() + 10
    while expected not in plain_text(log):
        assert time.monotonic() < deadline, plain_text(log)[-3000:]
        time.sleep(0.2)
    assert other not in plain_text(log), plain_text(log)[-3000:]


#: What vllm-router 0.1.17 logs when it drops a batch of this vLLM's KV events. The difference is vLLM's encoding,
#: vllm/distributed/kv_events.py, class KVCacheEvent: in 0.23.0 (:36-42) a msgspec Struct with ``tag=True`` and
#: ``array_like=True``, so each event goes out as an array ``["BlockStored", ...]``, which the router does not
#: decode; in 0.32.0 (:41-47) ``array_like`` is gone, each event is a tagged map ``{"type": "BlockStored", ...}``:
#: decoded, then the batch refused for its block size.
UNDECODED, WRONG_BLOCK_SIZE = "KV event must be a tagged map", "reason=BlockSizeMismatch"
REJECTION = {(0, 23): UNDECODED, (0, 32): WRONG_BLOCK_SIZE}


def rejection_of_this_vllm() -> tuple[str, str]:
    """(the message expected, the one that must not appear) on the running vLLM: the literal for CI's two releases;
    on another (scripts/check_vllm_releases.sh), from the same switch in its own code."""
    import vllm
    from vllm.distributed.kv_events import KVCacheEvent

    as_arrays = KVCacheEvent.__struct_config__.array_like
    series = tuple(int(x) for x in re.findall(r"\d+", vllm.__version__)[:2])
    expected = REJECTION.get(series, UNDECODED if as_arrays else WRONG_BLOCK_SIZE)
    assert (expected == UNDECODED) == as_arrays, (vllm.__version__, as_arrays)  # the cause the table names
    return expected, WRONG_BLOCK_SIZE if expected == UNDECODED else UNDECODED


def plain_text(log: Path) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))


def _hold_counts(server: VllmServer) -> dict[str, float]:
    return {kind: server.metric(f"vllm:kvp2p_holds_{kind}_total") for kind in ("created", "released", "expired")}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_n3_behind_vllm_router_equals_one_instance_with_one_hold(
    routing_cluster: RoutingCluster, kv_aware_router: tuple[str, Path], stream: bool
) -> None:
    """vllm-router forwards the client's n to P: vLLM fans P's request out into n children that offer one hold
    (vllm_kvp2p/lifecycle/sibling_offers.py), and D's n children share its one pull (lifecycle/shared_holds.py).
    Before issue 36: D answered 500 (each child claimed the hold) and P kept n - 1 holds until its timeout."""
    c = routing_cluster
    url, _ = kv_aware_router
    prompt = prompt_ids(150, seed=3690 + stream)
    body = {**completion_body(prompt), "n": 3, "temperature": 0.8, "seed": 4321}
    before = {p.url: _hold_counts(p) for p in c.producers}
    if stream:
        texts: dict[int, str] = {}
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in sse_lines(r):
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    else:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        texts = {ch["index"]: ch["text"] for ch in r.json()["choices"]}
    single = httpx.post(c.prefill.url + "/v1/completions", json={**body, "cache_salt": "one-instance"}, timeout=120)
    assert texts == {ch["index"]: ch["text"] for ch in single.json()["choices"]}
    assert len(set(texts.values())) > 1
    for p in c.producers:  # every hold made (one, on the P the router chose) released by D, none left to expire
        assert wait_kv_idle(p, timeout=10) == 0.0
    moved = {p.url: {k: v - before[p.url][k] for k, v in _hold_counts(p).items()} for p in c.producers}
    assert sum(m["created"] for m in moved.values()) == 1, moved
    assert all(m["created"] == m["released"] and m["expired"] == 0 for m in moved.values()), moved
