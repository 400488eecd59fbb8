"""vllm-router 0.1.17 in P/D mode with its ``kv_aware`` policy, fed by the same engines' KV events, in front of
this connector: it drives it (answers equal the single instance, D pulls), and it cannot route by those events at
vLLM CPU's block size.

Its ``kv_aware`` hashes the ``token_ids`` of the events itself, in 16-token chunks, and in P/D mode takes only
16-token blocks (``--pd-kv-events``: "Block size is 16"); vLLM's CPU attention needs a multiple of 32 (and
vllm-ascend runs 128), so every batch is rejected (``BlockSizeMismatch`` at debug level) and it routes by load.
vLLM 0.23's events (arrays, not tagged maps) it does not decode at all.
docs/routing.md says so; this test keeps that statement true for the pinned release.
"""

from __future__ import annotations

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

from tests.e2e.helpers import LOGPROB_TOL, baseline, completion_body, max_logprob_gap, prompt_ids
from tests.e2e_routing.conftest import RoutingCluster
from vllm_kvp2p.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.server import free_port


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
    # Every event batch dropped: vLLM 0.32's for their block size, vLLM 0.23's (events as arrays) undecoded. The
    # router colours its log fields (escape codes inside "reason=..."): compared without them.
    rejections = ("reason=BlockSizeMismatch", "KV event must be a tagged map")
    deadline = time.monotonic() + 10
    while not any(r in plain_text(log) for r in rejections):
        assert time.monotonic() < deadline, plain_text(log)[-3000:]
        time.sleep(0.2)


def plain_text(log: Path) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))
