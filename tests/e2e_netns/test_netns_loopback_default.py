"""The checks of test_netns_pd.py can fail: the same two-namespace layout with the connector's former default
forced (``VLLM_KVP2P_HOST=127.0.0.1`` on P) gets no pull. P names 127.0.0.1, which in D's namespace is D
itself; D's pull fails, D recomputes the prompt (``kv_load_failure_policy=recompute``), and P frees the hold
when it expires."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    LOGPROB_TOL,
    baseline,
    completion_body,
    max_logprob_gap,
    post,
    prompt_ids,
    tokens_and_logprobs,
    tokens_by_source,
    wait_kv_idle,
)
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY

if TYPE_CHECKING:
    from tests.e2e_netns.conftest import NetnsPair

pytestmark = pytest.mark.e2e


def test_former_loopback_default_gets_no_pull_across_namespaces(loopback_pair: NetnsPair) -> None:
    pair = loopback_pair
    log = pair.prefill.log_path.read_text(errors="replace")
    assert f"side channel binds 127.0.0.1:{pair.side_channel_port}, advertised as 127.0.0.1" in log

    length = 5 * BLOCK_SIZE + 7
    # A seed of its own: D is the package's, and a prompt D computed here would be a local prefix hit (no pull)
    # for test_netns_pd.py's tests, which use seed=length.
    prompt = prompt_ids(length, seed=9090)
    before = tokens_by_source(pair)
    pd = post(pair.proxy_url + "/v1/completions", completion_body(prompt))

    report = pd["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and report["blocks"] == 0, report
    after = tokens_by_source(pair)
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == 0
    assert after["local_compute"] - before["local_compute"] == length  # D recomputed the prompt
    single = baseline(pair, prompt)
    assert max_logprob_gap(pd, single) <= LOGPROB_TOL, (tokens_and_logprobs(pd), tokens_and_logprobs(single))


def test_engines_end_idle_once_p_hold_expires(loopback_pair: NetnsPair) -> None:
    assert wait_kv_idle(loopback_pair.prefill, timeout=40) == 0.0, loopback_pair.prefill.log_path
    assert wait_kv_idle(loopback_pair.decode) == 0.0, loopback_pair.decode.log_path
