"""P and D at different block sizes, on real engines: the cluster's P and D run ``--block-size 32``; this module
adds a P and a D at ``--block-size 64``, so both directions run (P 32 -> D 64, P 64 -> D 32). D's greedy tokens and
logprobs must equal those of the P that prefilled (its own answer, computed in one instance), for prompts shorter
than one block, of several blocks and of a few hundred tokens, and also when D already caches the start of the
prompt (its local hit ends inside one of P's bigger blocks). A corrupted transfer must change the answer, and every
engine ends holding no blocks.

vLLM's CPU attention keeps each head's K element-major inside a block, so a P block is not a contiguous piece of a
D block; before the connector read that layout off the kernel, every prompt here gave another answer (logprobs
1.1 - 2.0 apart) with the transfer reported successful.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    DTYPE_BYTES,
    HEAD_SIZE,
    KV_HEADS,
    LOGPROB_TOL,
    NUM_LAYERS,
    completion_body,
    max_logprob_gap,
    post,
    prompt_ids,
    tokens_and_logprobs,
    tokens_by_source,
    wait_kv_idle,
)
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.cluster import PDCluster, kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, free_port

pytestmark = pytest.mark.e2e

BIG = 64  # the other engines' block size (the cluster's is 32)
BYTES_PER_TOKEN = NUM_LAYERS * KV_HEADS * 2 * HEAD_SIZE * DTYPE_BYTES
LENGTHS = [10, 100, 300]  # shorter than a block of either size, several blocks, a few hundred tokens


@pytest.fixture(scope="module")
def big_engines(cluster: PDCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer,
                                                                                                 VllmServer]]:
    """(P, D) at block size 64, started together beside the cluster."""
    logs = tmp_path_factory.mktemp("block-64")
    producer = VllmServer(
        cluster.model_path, free_port(), cpus="0", log_path=logs / "prefill-64.log",
        extra_args=("--block-size", str(BIG), "--kv-transfer-config", kv_transfer_config("kv_producer")),
        env={"VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_KVP2P_HOLD_TIMEOUT": "60"},
    )
    decoder = VllmServer(
        cluster.model_path, free_port(), cpus="1", log_path=logs / "decode-64.log",
        extra_args=("--block-size", str(BIG), "--kv-transfer-config",
                    kv_transfer_config("kv_consumer", "recompute", test_hooks=True)),
        env={"VLLM_KVP2P_CLAIM_WAIT": "5"},
    )
    servers = [producer, decoder]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield producer, decoder
    finally:
        for server in reversed(servers):
            server.stop()


def prefill(producer: VllmServer, prompt: list[int]) -> dict:
    out = post(producer.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                  "kv_transfer_params": {"do_remote_decode": True}})
    return out["kv_transfer_params"]


def own_answer(producer: VllmServer, prompt: list[int]) -> dict:
    return post(producer.url + "/v1/completions", completion_body(prompt, cache_salt="single-instance"))


def pulled(producer: VllmServer, decoder: VllmServer, prompt: list[int], **extra: object) -> dict:
    params = {**prefill(producer, prompt), **extra}
    return post(decoder.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))


def check(producer: VllmServer, decoder: VllmServer, prompt: list[int], d_block: int, first_loaded: int = 0) -> None:
    """``d_block``: D's block size; ``first_loaded``: D's local hit (whole blocks of D's)."""
    out = pulled(producer, decoder, prompt)
    single = own_answer(producer, prompt)
    assert max_logprob_gap(out, single) <= LOGPROB_TOL, (tokens_and_logprobs(out), tokens_and_logprobs(single))
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert report["ok"], report
    # D read at least every token it loads and at most what its own blocks hold from there: its blocks from the
    # first loaded token to the end of the prompt's last block (D's block size, not P's: a bigger P block's tail
    # past the prompt, or a block read twice, is more than D's blocks hold)
    assert first_loaded % d_block == 0, (first_loaded, d_block)
    d_blocks = -(-len(prompt) // d_block) - first_loaded // d_block
    assert (len(prompt) - first_loaded) * BYTES_PER_TOKEN <= report["bytes"] <= d_blocks * d_block * BYTES_PER_TOKEN, \
        (report, d_blocks, d_block)


@pytest.mark.parametrize("length", LENGTHS)
def test_p32_to_d64_answers_equal_p(cluster: PDCluster, big_engines, length: int) -> None:
    _, d64 = big_engines
    check(cluster.prefill, d64, prompt_ids(length, seed=6400 + length), BIG)


@pytest.mark.parametrize("length", LENGTHS)
def test_p64_to_d32_answers_equal_p(cluster: PDCluster, big_engines, length: int) -> None:
    p64, _ = big_engines
    check(p64, cluster.decode, prompt_ids(length, seed=3200 + length), BLOCK_SIZE)


def test_d_local_hit_ending_inside_a_bigger_p_block(cluster: PDCluster, big_engines) -> None:
    """D (32) already caches the prompt's first 32 tokens: it loads from token 32, the middle of P's (64) first
    block."""
    p64, _ = big_engines
    prompt = prompt_ids(230, seed=777)
    post(cluster.decode.url + "/v1/completions", {"model": "tiny", "prompt": prompt[:40], "max_tokens": 1})
    before = tokens_by_source(cluster)
    check(p64, cluster.decode, prompt, BLOCK_SIZE, first_loaded=32)
    after = tokens_by_source(cluster)
    assert after["local_cache_hit"] - before["local_cache_hit"] == 32
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == len(prompt) - 32


def test_a_cut_block_list_on_the_sliced_path_is_refused(cluster: PDCluster, big_engines) -> None:
    """P (32) -> D (64), the block list cut to one of P's blocks while the params still claim the whole prompt,
    after D's cache was filled by other prompts: refused, D recomputes (before: 4 KiB of 128 KB read, reported
    pulled, the rest an earlier request's KV)."""
    _, d64 = big_engines
    for seed in range(6):
        post(d64.url + "/v1/completions", {"model": "tiny", "prompt": prompt_ids(200, seed=7000 + seed),
                                           "max_tokens": 1})
    prompt = prompt_ids(200, seed=6464 + 1)
    params = prefill(cluster.prefill, prompt)
    params["remote_block_ids"] = [params["remote_block_ids"][0][:1]]
    out = post(d64.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and "need exactly 7" in report["reason"] and report["bytes"] == 0, report
    assert max_logprob_gap(out, own_answer(cluster.prefill, prompt)) <= LOGPROB_TOL
    check(cluster.prefill, d64, prompt_ids(200, seed=6464 + 2), BIG)  # a normal P/D request afterwards


def test_corrupted_transfer_between_block_sizes_changes_the_answer(cluster: PDCluster, big_engines) -> None:
    _, d64 = big_engines
    prompt = prompt_ids(150, seed=6464)
    corrupted = pulled(cluster.prefill, d64, prompt, kvp2p_test_corrupt=True)
    assert corrupted["kv_transfer_params"][PULL_REPORT_KEY]["ok"]
    assert max_logprob_gap(corrupted, own_answer(cluster.prefill, prompt)) > 100 * LOGPROB_TOL


def test_every_engine_ends_idle(cluster: PDCluster, big_engines) -> None:
    for server in (cluster.prefill, cluster.decode, *big_engines):
        assert wait_kv_idle(server) == 0.0, server.log_path
    for server in big_engines:
        assert "Traceback" not in Path(server.log_path).read_text(), server.log_path
