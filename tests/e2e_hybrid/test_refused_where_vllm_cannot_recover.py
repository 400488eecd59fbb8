"""On a vLLM that takes failed KV loads only as block ids (0.23), a decoder with the hybrid allocator's two groups
would die on its first failed pull (its scheduler cannot map block ids back to requests with several groups:
tests/scheduler/test_hybrid_groups.py shows the crash). The real engine refuses to start instead, naming the way
out, and does so quickly; the package's second cluster runs that way out (test_without_hybrid_allocator.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from vllm_kvp2p.connector.compat import REPORTS_FAILED_REQUESTS
from vllm_kvp2p.testing.cluster import kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, VllmServerError

pytestmark = pytest.mark.skipif(REPORTS_FAILED_REQUESTS, reason=(
    "this vLLM takes failed loads as request ids: D runs with several groups (test_sliding_window_end_to_end.py)"))

#: s: the refusal comes when vLLM builds its scheduler, after loading the model: measured 20 s here, about what this
#: package's engines take to serve, so 90 s leaves a loaded 2-core host more than 4x. It must stay well inside the
#: server's ready timeout: a bound equal to it (as before, 240 s) holds by the set-up alone, however late the refusal.
START_BOUND = 90.0
READY_TIMEOUT = 240.0  # the server's own (VllmServer's default): an engine that neither refuses nor serves


def test_d_with_the_hybrid_allocator_refuses_to_start_naming_the_flag(sliding_model: Path, tmp_path: Path) -> None:
    decode = VllmServer(sliding_model, cpus="1", log_path=tmp_path / "decode.log", ready_timeout=READY_TIMEOUT,
                        extra_args=("--kv-transfer-config", kv_transfer_config("kv_consumer")))
    started = time.monotonic()
    try:
        with pytest.raises(VllmServerError, match="exited with code"):
            decode.start().wait_ready()
    finally:
        decode.stop()
    took = time.monotonic() - started
    print(f"refused after {took:.1f} s (bound {START_BOUND:g} s)")
    assert took < START_BOUND, f"the refusal took {took:.1f} s"
    log = decode.log_path.read_text()
    assert "cannot run as a decoder on this vLLM with 2 KV-cache groups" in log, decode.log_tail()
    assert "--disable-hybrid-kv-cache-manager" in log
