"""What the running vLLM version changes, seen on the real P/D engines of this package's cluster.

Runs under every vLLM the suite runs on (scripts/test.sh runs it on 0.32 and on 0.23; scripts/check_vllm_releases.sh
on the others). Nothing here asks vllm_kvp2p.connector.compat (not even to parse the version),
so a wrong seam or a wrong
verdict there fails the test: the allocation route each release series has is written here from that release's
source, and the label the start-up line must give is a literal for CI's two releases and, for any other, what the
release record says (docs/vllm_releases.json, written by scripts/check_vllm_releases.sh).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import vllm

from vllm_kvp2p.testing.cluster import PDCluster

# Which route gives the KV cache the connector's arena, per release series (read in each release's source):
#   0.31, 0.32: gpu_worker.py allocates inside get_kv_transfer_group().get_mem_pool_context()
#   0.29, 0.30: no such call; GPUModelRunner.initialize_kv_cache_tensors calls the module function
#               allocate_kv_cache (imported by name into gpu_model_runner), which we wrap
#   0.23 - 0.28: no such call; the CPU runner inherits GPUModelRunner._allocate_kv_cache_tensors, which we wrap
EXPECTED_ROUTE = {
    **{(0, minor): "get_mem_pool_context" for minor in (31, 32)},
    **{(0, minor): "wrapped gpu_model_runner.allocate_kv_cache" for minor in (29, 30)},
    **{(0, minor): "wrapped GPUModelRunner._allocate_kv_cache_tensors" for minor in range(23, 29)},
}


#: The start-up line's label on the two releases CI runs the whole suite on at every commit (docs/compatibility.md,
#: "Policy": tested = CI's 0.23.0 and 0.32.0).
CI_RELEASES = {(0, 23, 0): "tested", (0, 32, 0): "tested"}


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of ``0.32.0``, ``0.32.0+cpu``, ``0.23.1rc1.dev2``: this test's own reading."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    assert match, text
    return int(match[1]), int(match[2]), int(match[3] or 0)


def _route_lines(log: str) -> list[str]:
    return re.findall(r"KV cache allocation route to the connector's arena: (.*)", log)


def test_kv_cache_comes_from_one_arena_by_the_route_this_vllm_has(cluster: PDCluster) -> None:
    series = parse_version(vllm.__version__)[:2]
    assert series in EXPECTED_ROUTE, f"the suite has no expectation for vLLM {vllm.__version__}"
    for server in (cluster.prefill, cluster.decode):
        log = server.log_path.read_text(errors="replace")
        routes = _route_lines(log)
        assert routes and all(r.strip() == EXPECTED_ROUTE[series] for r in routes), (server.log_path, routes)
        # ... and the route worked: the whole KV cache is one registered region, from the arena.
        registrations = re.findall(r"registered as (\d+) region\(s\) \(([^)]*)\)", log)
        assert registrations == [("1", "one arena")], (server.log_path, registrations)


def test_the_log_says_which_vllm_runs_and_warns_only_when_untested(cluster: PDCluster) -> None:
    log = cluster.decode.log_path.read_text(errors="replace")
    # Quiet on a tested release (CI's two) or a release-checked one (a passing record of
    # scripts/check_vllm_releases.sh), one warning on a release being checked for the first time; the start-up line
    # says which. Written from the record, not from compat.
    version = parse_version(vllm.__version__)
    records = json.loads((Path(__file__).resolve().parents[2] / "docs" / "vllm_releases.json").read_text())
    checked = {parse_version(v) for v, r in records.items() if r["exit"] == 0 and r["failed"] == 0}
    label = CI_RELEASES.get(version) or ("release-checked at a recorded commit" if version in checked else "untested")
    assert ("untested with MooncakeP2PConnector" in log) == (label == "untested")
    assert f"MooncakeP2PConnector on vLLM {vllm.__version__} ({label}" in log
    assert "Traceback" not in log
