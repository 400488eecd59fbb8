"""The proxy's prefill retry, run for real against the stub engines (tests/unit/proxy_harness.py): once, on another P,
only when P went away before answering (refused, closed, reset), within the request's one deadline; never after
an HTTP answer or a timeout (docs/reliability.md's fault matrix)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.unit import proxy_harness as harness
from tests.unit.proxy_harness import (
    CLIENT_TIMEOUT,
    COMPLETION,
    DroppingServer,
    Stub,
    assert_openai_error,
    closed_port_url,
    proxy_health,
    retry_warnings,
    sse_events,
)

# Generous per-test caps: the bounds that matter are asserted inside the tests; these only stop a hang.
pytestmark = pytest.mark.timeout(30)

# proxy_harness's fixtures: its stub engines (this module's own, reset before each test) and proxies.
stubs = harness.stubs
_reset_stubs = harness._reset_stubs
make_proxy = harness.make_proxy
dropping = harness.dropping


@pytest.mark.parametrize(
    ("failure", "error_name"),
    [("refused", "ConnectionRefusedError"), ("close", "ServerDisconnectedError"), ("reset", "Connection reset")],
)
def test_prefill_retried_on_other_instance_when_p_gone(
    stubs: dict[str, Stub],
    make_proxy: Callable[..., str],
    dropping: Callable[..., DroppingServer],
    caplog: pytest.LogCaptureFixture,
    failure: str,
    error_name: str,
) -> None:
    dead_srv = None if failure == "refused" else dropping(failure)
    dead = closed_port_url() if dead_srv is None else dead_srv.url
    # The dead P is first: a fresh balancer picks it first, so every request below needs the retry.
    url = make_proxy([dead, stubs["P1"].url], [stubs["D0"].url])
    caplog.set_level(logging.WARNING, logger="vllm_kvp2p.proxy")
    for i, stream in enumerate((False, True)):
        rid = f"retry-{failure}-{i}"
        r = httpx.post(
            url + "/v1/completions",
            json={**COMPLETION, "stream": stream},
            headers={"X-Request-Id": rid},
            timeout=CLIENT_TIMEOUT,
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-kvp2p-prefill-instance"] == stubs["P1"].url
        if stream:
            assert r.content == b"".join(sse_events("D0"))
        else:
            assert r.json()["choices"][0]["text"] == "D0 answer"
        warnings = [w for w in retry_warnings(caplog) if rid in w]
        if i == 0:
            (warning,) = warnings
            assert dead in warning and error_name in warning
            assert warning.endswith(f"retrying once on {stubs['P1'].url}")
        else:
            assert warnings == []  # the dead P is skipped after its one failed request: no retry needed
    assert len(stubs["P1"].received) == 2
    assert [d["body"]["kv_transfer_params"]["remote_engine_id"] for d in stubs["D0"].received] == ["engine-P1"] * 2
    if dead_srv is not None:
        assert dead_srv.attempts == 1  # only the first request tried it
    health = proxy_health(url)
    assert health["prefill_retries"] == 1
    assert [e["outstanding"] for e in health["prefill"] + health["decode"]] == [0, 0, 0]
    assert [e["served"] for e in health["prefill"]] == [1, 2]
    assert health["prefill"][0]["state"] == "skipped" and error_name in health["prefill"][0]["last_error"]
    assert health["prefill"][1]["state"] == "up"


def test_prefill_retry_single_dead_p_is_502(
    stubs: dict[str, Stub],
    make_proxy: Callable[..., str],
    dropping: Callable[..., DroppingServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = dropping("close")
    url = make_proxy([dead.url], [stubs["D0"].url])
    caplog.set_level(logging.WARNING, logger="vllm_kvp2p.proxy")
    r = httpx.post(url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "lone"}, timeout=CLIENT_TIMEOUT)
    message = assert_openai_error(r, 502, "prefill", dead.url, "ServerDisconnectedError", "after a retry; first:")
    assert message.count(dead.url) == 2  # the retry's failure, then the first one
    assert dead.attempts == 2  # tried exactly twice: once, then the one retry on the same (only) P
    (warning,) = retry_warnings(caplog)
    assert "lone" in warning and warning.endswith(f"retrying once on {dead.url}")
    assert stubs["D0"].received == []
    health = proxy_health(url)
    assert health["prefill_retries"] == 1
    (only,) = health["prefill"]
    assert (only["url"], only["outstanding"], only["served"], only["state"]) == (dead.url, 0, 2, "skipped")


@pytest.mark.parametrize("mode", ["500", "400"])
def test_prefill_http_error_not_retried(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """An HTTP answer comes from a live P: no retry, although a healthy P1 would have answered."""
    url = make_proxy([stubs["P0"].url, stubs["P1"].url], [stubs["D0"].url])
    caplog.set_level(logging.WARNING, logger="vllm_kvp2p.proxy")
    stubs["P0"].mode = mode
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    if mode == "500":
        message = assert_openai_error(r, 502, "prefill", stubs["P0"].url, "500")
        assert "retry" not in message
    else:
        assert r.status_code == 400 and r.json()["error"]["message"] == "prompt too long"
    assert len(stubs["P0"].received) == 1 and stubs["P1"].received == [] and stubs["D0"].received == []
    assert retry_warnings(caplog) == []
    health = proxy_health(url)
    assert health["prefill_retries"] == 0
    assert [e["outstanding"] for e in health["prefill"]] == [0, 0]


def test_prefill_timeout_not_retried(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    """A slow P is not given up on for another: that would double the load exactly when P is overloaded."""
    url = make_proxy([stubs["P0"].url, stubs["P1"].url], [stubs["D0"].url], timeout_s=0.5)
    caplog.set_level(logging.WARNING, logger="vllm_kvp2p.proxy")
    stubs["P0"].mode = "hang"
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert time.monotonic() - t0 < 3.0
    message = assert_openai_error(r, 504, "prefill", stubs["P0"].url, "timed out")
    assert "retry" not in message
    assert len(stubs["P0"].received) == 1 and stubs["P1"].received == []
    assert retry_warnings(caplog) == []
    health = proxy_health(url)
    assert health["prefill_retries"] == 0
    assert [e["outstanding"] for e in health["prefill"]] == [0, 0]


def test_prefill_retry_shares_the_deadline(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], dropping: Callable[..., DroppingServer]
) -> None:
    """The retry gets what is left of the request's deadline: P0 uses half of it, P1 needs more than the rest."""
    dead = dropping("close", delay_s=0.5)
    url = make_proxy([dead.url, stubs["P1"].url], [stubs["D0"].url], timeout_s=1.0)
    stubs["P1"].delay_s = 0.8  # within a fresh 1 s deadline, not within the ~0.5 s left of the first one
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    elapsed = time.monotonic() - t0
    assert_openai_error(r, 504, "prefill", stubs["P1"].url, "timed out", "after a retry; first:", dead.url)
    assert elapsed < 1.3 + 0.5, elapsed  # ~1 s, the one deadline (a fresh one would answer 200 after ~1.3 s)
    assert dead.attempts == 1 and len(stubs["P1"].received) == 1 and stubs["D0"].received == []
    health = proxy_health(url)
    assert health["prefill_retries"] == 1
    assert [e["outstanding"] for e in health["prefill"]] == [0, 0]


def test_prefill_retry_skips_failed_p_even_when_least_loaded(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], dropping: Callable[..., DroppingServer]
) -> None:
    """While P1 is busy, the dead P0 is the least loaded: the retry must still go to P1, not back to P0."""
    dead = dropping("close")
    url = make_proxy([dead.url, stubs["P1"].url], [stubs["D0"].url])
    stubs["P1"].delay_s = 1.0
    results: list[httpx.Response] = []
    first = threading.Thread(
        target=lambda: results.append(httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT))
    )
    first.start()
    deadline = time.monotonic() + 5.0
    while not stubs["P1"].received:  # the first request, retried onto P1, is now outstanding there
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert proxy_health(url)["prefill"][1]["outstanding"] == 1
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    first.join(timeout=10.0)
    assert [x.status_code for x in (*results, r)] == [200, 200], r.text
    assert r.headers["x-kvp2p-prefill-instance"] == stubs["P1"].url
    assert dead.attempts == 1 and len(stubs["P1"].received) == 2  # skipped after its one failure
    health = proxy_health(url)
    assert health["prefill_retries"] == 1
    assert [e["outstanding"] for e in health["prefill"] + health["decode"]] == [0, 0, 0]
