"""What ordinary OpenAI clients send, through the proxy with real engines (the shared ``cluster``): parallel sampling
(``n > 1``), a batch of prompts, streaming and not, each answer equal to one instance's (P itself, serving the same
request as an ordinary vLLM); and clients that leave, mid-generation and mid-prefill.

For each: D computed at most one block per prompt and child (the rest pulled, or for vLLM's n > 1 children read from
D's prefix cache after the one pull: vllm_kvp2p/lifecycle/shared_holds.py), and both engines end with no KV block in
use, every hold P made released by its decoder (never left to expire).

Before issue 36: ``n = 3`` failed (the proxy answered 502; D's children each claimed the one hold, P refused all
but the first), P kept n - 1 unclaimed holds until its hold timeout, a batch failed on D's prompt binding, and a
non-streaming client that left kept D decoding for nobody.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    LOGPROB_TOL,
    post,
    prompt_ids,
    tokens_by_source,
    wait_kv_idle,
)
from vllm_kvp2p.proxy.app import PREFILL_KV_TRANSFER_PARAMS
from vllm_kvp2p.testing.cluster import PDCluster as Cluster
from vllm_kvp2p.testing.server import VllmServer
from vllm_kvp2p.testing.sse import sse_lines

HOLD_COUNTERS = ("vllm:kvp2p_holds_created_total", "vllm:kvp2p_holds_released_total",
                 "vllm:kvp2p_holds_expired_total")
#: How soon a client that left must have freed D's decode slot (issue 36), and a loaded 2-core machine's margin.
GONE_WITHIN_S = 2.0


def present(server: VllmServer, name: str) -> float:
    """A metric that must exist (VllmServer.metric: absent is never zero)."""
    return server.metric(name)


def holds(server: VllmServer) -> dict[str, float]:
    return {name.split("_")[-2]: present(server, name) for name in HOLD_COUNTERS}


@contextmanager
def every_hold_released(cluster: Cluster, expected: int | None = None) -> Iterator[None]:
    """P's holds made inside the block are all released by D (none expired, none left) and both engines end with
    no KV block in use; ``expected``: how many holds."""
    before = holds(cluster.prefill)
    yield
    assert wait_kv_idle(cluster.prefill, timeout=10) == 0.0, "P still holds KV blocks"
    assert wait_kv_idle(cluster.decode, timeout=10) == 0.0, "D still holds KV blocks"
    deadline = time.monotonic() + 10
    while True:
        moved = {k: v - before[k] for k, v in holds(cluster.prefill).items()}
        if moved["created"] == moved["released"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert moved["expired"] == 0 and moved["created"] == moved["released"], moved
    if expected is not None:
        assert moved["created"] == expected, moved


def body(prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 10, "logprobs": 1, **extra}


def one_instance(cluster: Cluster, request: dict[str, Any]) -> dict[str, Any]:
    """The same request served by one ordinary vLLM (P, with its own cache salt: none of the P/D prefill's cache)."""
    return post(cluster.prefill.url + "/v1/completions", {**request, "cache_salt": "one-instance"})


def streamed(url: str, request: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A streamed completion reassembled per choice index: its text, token logprobs and finish reason."""
    choices: dict[int, dict[str, Any]] = {}
    with httpx.stream("POST", url, json={**request, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in sse_lines(r):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                mine = choices.setdefault(c["index"], {"text": "", "logprobs": [], "finish_reason": None})
                mine["text"] += c["text"]
                mine["logprobs"] += (c.get("logprobs") or {}).get("token_logprobs") or []
                mine["finish_reason"] = c.get("finish_reason") or mine["finish_reason"]
    return choices


def whole(answer: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {c["index"]: {"text": c["text"], "logprobs": c["logprobs"]["token_logprobs"],
                         "finish_reason": c["finish_reason"]} for c in answer["choices"]}


def assert_same(pd: dict[int, dict[str, Any]], single: dict[int, dict[str, Any]]) -> None:
    assert sorted(pd) == sorted(single) == list(range(len(single)))
    for i in single:
        assert pd[i]["text"] == single[i]["text"], (i, pd[i], single[i])
        assert pd[i]["finish_reason"] == single[i]["finish_reason"], i
        gaps = [abs(a - b) for a, b in zip(pd[i]["logprobs"], single[i]["logprobs"])]
        assert len(pd[i]["logprobs"]) == len(single[i]["logprobs"]) and max(gaps, default=0) <= LOGPROB_TOL, i


def computed_on_d(cluster: Cluster, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in tokens_by_source(cluster).items()}


# ------------------------------------------------------------------------------------------------ n > 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_n3_seeded_sampling_equals_one_instance(cluster: Cluster, stream: bool) -> None:
    prompt = prompt_ids(150, seed=3601 + stream)
    request = body(prompt, n=3, temperature=0.8, seed=1234)
    before = tokens_by_source(cluster)
    with every_hold_released(cluster, expected=1):  # P prefilled once (the proxy sends it n = 1)
        if stream:
            pd = streamed(cluster.proxy_url + "/v1/completions", request)
        else:
            # (Its kv_transfer_params are the last child's to finish: a follower's carry no pull report.)
            answer = post(cluster.proxy_url + "/v1/completions", request)
            assert answer["usage"]["prompt_tokens"] == len(prompt)
            pd = whole(answer)
    moved = computed_on_d(cluster, before)
    assert_same(pd, whole(one_instance(cluster, request)))
    assert len({c["text"] for c in pd.values()}) > 1  # three samples, not one answer thrice
    # One pull for the three children; each follower computes only the prompt's partial last block.
    assert moved["external_kv_transfer"] >= len(prompt) - BLOCK_SIZE, moved
    assert moved["local_compute"] <= 3 * BLOCK_SIZE, moved


def test_n_above_one_with_greedy_sampling_is_the_same_400_and_holds_nothing(cluster: Cluster) -> None:
    request = body(prompt_ids(60, seed=3603), n=3, temperature=0)
    with every_hold_released(cluster):
        pd = httpx.post(cluster.proxy_url + "/v1/completions", json=request, timeout=60)
        single = httpx.post(cluster.prefill.url + "/v1/completions", json=request, timeout=60)
    assert single.status_code == pd.status_code == 400, (single.text, pd.text)
    assert "n must be 1 when using greedy sampling" in single.text
    assert "n must be 1 when using greedy sampling" in pd.text


def test_p_asked_for_n3_by_another_router_makes_one_hold(cluster: Cluster) -> None:
    """A router that forwards the client's n to P (vllm-router does): vLLM fans P's request out too and answers
    with one child's params; every child must name one hold, so none is left pinned."""
    prompt = prompt_ids(150, seed=3604)
    request = body(prompt, n=3, temperature=0.8, seed=99)
    with every_hold_released(cluster, expected=1):
        p_answer = post(cluster.prefill.url + "/v1/completions",
                        {**request, "max_tokens": 1, "kv_transfer_params": dict(PREFILL_KV_TRANSFER_PARAMS)})
        d_answer = post(cluster.decode.url + "/v1/completions",
                        {**request, "kv_transfer_params": p_answer["kv_transfer_params"]})
    assert_same(whole(d_answer), whole(one_instance(cluster, request)))


# ------------------------------------------------------------------------------------------------ batches


@pytest.mark.parametrize(("size", "stream"), [(2, False), (2, True), (8, False), (8, True)],
                         ids=["2-json", "2-stream", "8-json", "8-stream"])
def test_a_batch_of_prompts_equals_one_instance(cluster: Cluster, size: int, stream: bool) -> None:
    prompts = [prompt_ids(40 + 13 * i, seed=3610 + 20 * size + 10 * stream + i) for i in range(size)]
    request = body(prompts, temperature=0)
    before = tokens_by_source(cluster)
    with every_hold_released(cluster, expected=size):
        if stream:
            pd = streamed(cluster.proxy_url + "/v1/completions", request)
        else:
            answer = post(cluster.proxy_url + "/v1/completions", request)
            single_usage = one_instance(cluster, request)["usage"]
            for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                assert answer["usage"][key] == single_usage[key], (key, answer["usage"], single_usage)
            pd = whole(answer)
    moved = computed_on_d(cluster, before)
    assert_same(pd, whole(one_instance(cluster, request)))
    assert moved["local_compute"] <= size * BLOCK_SIZE, moved  # at most one block per prompt computed on D


def test_a_batch_of_n2_samples_is_indexed_like_one_instance(cluster: Cluster) -> None:
    prompts = [prompt_ids(50, seed=3650), prompt_ids(70, seed=3651)]
    request = body(prompts, n=2, temperature=0.7, seed=7)
    with every_hold_released(cluster, expected=2):
        pd = whole(post(cluster.proxy_url + "/v1/completions", request))
    assert_same(pd, whole(one_instance(cluster, request)))  # indices 0, 1 for the first prompt, 2, 3 for the second


# ------------------------------------------------------------------------------------------------ clients that leave


def send_and_leave(url: str, request: dict[str, Any]) -> socket.socket:
    """Send a request on a raw socket (the client reads nothing); the caller closes it to leave."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    payload = json.dumps(request).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def wait_for(read: Any, want: Any, timeout: float) -> float:
    """Seconds until ``read()`` equals ``want`` (fails after ``timeout``)."""
    t0 = time.monotonic()
    while (value := read()) != want:
        assert time.monotonic() - t0 < timeout, f"still {value}, want {want}, after {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_non_streaming_client_that_leaves_mid_generation_frees_the_decode_slot(cluster: Cluster) -> None:
    running = lambda: present(cluster.decode, "vllm:num_requests_running")  # noqa: E731
    with every_hold_released(cluster, expected=1):
        sock = send_and_leave(cluster.proxy_url,
                              body(prompt_ids(100, seed=3660), max_tokens=1900, ignore_eos=True, logprobs=None))
        wait_for(running, 1.0, timeout=30)  # D is generating
        time.sleep(0.3)
        sock.close()
        took = wait_for(running, 0.0, timeout=10)
    assert took <= GONE_WITHIN_S, f"D's request ran {took:.2f} s after its client left"


def engine_core(server: VllmServer) -> psutil.Process:
    assert server.pid is not None
    cores = [p for p in psutil.Process(server.pid).children(recursive=True)
             if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()]
    assert len(cores) == 1, [(p.pid, p.cmdline()) for p in psutil.Process(server.pid).children(recursive=True)]
    return cores[0]


# A client that leaves while P prefills: P's request runs to its answer and the hold is abandoned
# (tests/e2e/test_holds_reach_d_or_are_abandoned.py, with every other stage a client can leave at).


# ------------------------------------------------------------------------------------------------ bad input

BAD_REQUESTS = {
    "n=0": ({"n": 0}, "n"),
    "n=-1": ({"n": -1}, "n"),
    "n=10^6": ({"n": 10**6, "temperature": 1.0}, "n"),
    "n='3'": ({"n": "three"}, "n"),
    "n=1.5": ({"n": 1.5}, "n"),
    "empty batch": ({"prompt": []}, "prompt"),
    "10^5 prompts": ({"prompt": ["a"] * 10**5}, "prompt"),
    "nested lists": ({"prompt": [[[5, 6, 7]]]}, "prompt"),
    "mixed batch": ({"prompt": ["text", [5, 6, 7]]}, "prompt"),
    "bool tokens": ({"prompt": [True, False]}, "prompt"),
    "min_tokens string": ({"min_tokens": "many"}, "min_tokens"),
    "stream_options list": ({"stream": True, "stream_options": [1]}, "stream_options"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_input_is_a_400_naming_the_field_and_holds_nothing(cluster: Cluster, case: str) -> None:
    change, field = BAD_REQUESTS[case]
    before = holds(cluster.prefill)
    r = httpx.post(cluster.proxy_url + "/v1/completions", json={**body(prompt_ids(40, seed=3680)), **change},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field or field in error["message"], error
    assert holds(cluster.prefill) == before  # refused before P was asked


def test_after_bad_input_both_engines_serve_and_hold_nothing(cluster: Cluster) -> None:
    single = body(["one prompt in a list"], temperature=0)  # a batch of one: one instance's answer
    absurd_best_of = body(prompt_ids(40, seed=3681), temperature=0, best_of=10**9)  # vLLM ignores best_of
    with every_hold_released(cluster, expected=2):
        for request in (single, absurd_best_of):
            pd = httpx.post(cluster.proxy_url + "/v1/completions", json=request, timeout=60)
            one = httpx.post(cluster.prefill.url + "/v1/completions", json=request, timeout=60)
            assert pd.status_code == one.status_code == 200, (pd.text, one.text)
            assert_same(whole(pd.json()), whole(one.json()))


def test_n16_equals_one_instance(cluster: Cluster) -> None:
    """As many children as D runs at once (--max-num-seqs 16): one pull, fifteen followers."""
    prompt = prompt_ids(100, seed=3682)
    request = body(prompt, n=16, temperature=1.0, seed=5, max_tokens=4)
    before = tokens_by_source(cluster)
    with every_hold_released(cluster, expected=1):
        pd = whole(post(cluster.proxy_url + "/v1/completions", request))
    moved = computed_on_d(cluster, before)
    assert_same(pd, whole(one_instance(cluster, request)))
    assert moved["local_compute"] <= 16 * BLOCK_SIZE, moved


def test_a_batch_with_a_prompt_p_refuses_is_one_error_and_leaves_no_hold(cluster: Cluster) -> None:
    """Prompt 2 of 4 is longer than the model (P answers 400): the client gets that one error naming the prompt,
    the other parts are cancelled or end, and every hold P made for them is released, none left to expire."""
    prompts = [prompt_ids(60, seed=3690 + i) for i in range(4)]
    prompts[2] = prompt_ids(2100, seed=3694)  # --max-model-len 2048
    with every_hold_released(cluster):
        r = httpx.post(cluster.proxy_url + "/v1/completions", json=body(prompts, max_tokens=50), timeout=60)
    assert r.status_code == 400, r.text
    assert "prompt 2" in r.json()["error"]["message"], r.text
