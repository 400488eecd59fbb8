"""Which P and D the proxy may pair (issue 46 item 5): the key each engine exports as ``vllm:kvp2p_pairing_info``,
read back from /metrics text as prometheus_client renders it, and the one decision on it
(vllm_kvp2p/proxy/pairing.py). Every value D's own check compares is a mismatch, naming the value and both
sides'; what the connector handles by design (block sizes that divide, other TP and PP sizes) is not. Hostile
/metrics text gets a bounded answer. The asking (pairing_probe.py) against a real HTTP server and a closed port.
Pure: no vLLM, torch or Mooncake (the engines' own rendering is tests/e2e/test_pairing_info.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from vllm_kvp2p.contract.pairing_key import LABELS, METRIC, PairingKey, kv_cache_dtype
from vllm_kvp2p.proxy.pairing import MAX_METRICS_CHARS, MAX_SAMPLES, mismatch, parse_metrics, read_metrics
from vllm_kvp2p.proxy.pairing_probe import learn_pairing, probe_pairing
from vllm_kvp2p.proxy.upstream import Upstream

P = PairingKey(role="producer", protocol_version=6, model_fingerprint="0123456789abcdef", kv_cache_dtype="bfloat16",
               use_mla=False, draft="none", block_size=32, linear_state=False, tp_size=1, pp_size=1)
D = dataclasses.replace(P, role="consumer")


def exposition(*keys: PairingKey, model_name: str = "tiny") -> str:
    """/metrics as vLLM renders it: prometheus_client, vLLM's model_name and engine labels first, one sample per
    engine, among other metrics."""
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "Requests running.", ["model_name", "engine"], registry=registry
          ).labels(model_name, "0").set(3)
    info = Gauge(METRIC, "What decides pairing.", ["model_name", "engine", *LABELS], registry=registry)
    for engine, key in enumerate(keys):
        info.labels(model_name, str(engine), *key.labels().values()).set(1)
    return generate_latest(registry).decode()


# --------------------------------------------------------------------------- reading /metrics


def test_the_key_reads_back_from_prometheus_clients_rendering_with_every_field() -> None:
    text = exposition(P)
    (sample,) = [line for line in text.splitlines() if line.startswith(METRIC + "{")]
    assert 'role="producer"' in sample and 'protocol_version="6"' in sample and sample.endswith("} 1.0")
    assert parse_metrics(text) == P
    other = dataclasses.replace(D, use_mla=True, draft="mtp:fedcba9876543210", linear_state=True, tp_size=4,
                                pp_size=2, block_size=288, kv_cache_dtype="fp8_e4m3")
    assert parse_metrics(exposition(other)) == other


def test_escaped_label_values_and_engines_of_one_server_read_as_one_key() -> None:
    text = exposition(P, P, P, model_name='a "quoted"\\name\nwith a newline')
    assert '\\"quoted\\"\\\\name\\n' in text  # prometheus_client's escapes, which the parser undoes
    assert parse_metrics(text) == P


def test_an_absent_metric_is_no_key_and_says_so() -> None:
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "x", ["engine"], registry=registry).labels("0").set(0)
    text = generate_latest(registry).decode()
    assert parse_metrics(text) is None
    assert "no vllm:kvp2p_pairing_info" in str(read_metrics(text))
    # Its name elsewhere than at a line's start (a comment, another metric's label) is not the metric.
    hidden = exposition(P).replace(f"\n{METRIC}{{", f"\nvllm:other{{x=\"{METRIC}{{\"}} 1\n# {METRIC}{{")
    assert parse_metrics(hidden) is None


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda t: t.replace('block_size="32"', 'block_size="3x"'), "block_size='3x' is not a count"),
    (lambda t: t.replace('block_size="32"', 'block_size="99999999999999"'), "is not a count"),
    (lambda t: t.replace('use_mla="false"', 'use_mla="no"'), "use_mla='no' is not true or false"),
    (lambda t: t.replace('role="producer"', 'role="prefill"'), "role='prefill' is not one of"),
    (lambda t: t.replace(',draft="none"', ""), "label draft is missing"),
    (lambda t: t.replace('draft="none"', 'draft="' + "x" * 65 + '"'), "longer than 64"),
    (lambda t: t.replace('draft="none"', 'draft="none",draft="none"'), "repeated"),
    (lambda t: t.replace('draft="none"', 'draft="none'), "no ',' or '}'"),
    (lambda t: t.replace('draft="none"', "draft=none"), 'no name="value" label'),
    (lambda t: t.replace("} 1.0", "} 0.0"), "its value is 0.0, not 1"),
    (lambda t: t.replace("} 1.0", "}"), "its value is missing"),
])
def test_a_malformed_sample_is_no_key_naming_what_is_wrong(edit, reason: str) -> None:
    text = edit(exposition(P))
    assert text != exposition(P)  # the edit applied
    assert parse_metrics(text) is None
    got = read_metrics(text)
    assert isinstance(got, str) and got.startswith("malformed") and reason in got, got


def test_engines_that_disagree_are_no_key() -> None:
    got = read_metrics(exposition(P, dataclasses.replace(P, block_size=64)))
    assert got == f"its engines export 2 different {METRIC} samples"


def test_hostile_text_is_read_in_bounded_pieces() -> None:
    line = exposition(P).split("\n")
    sample = next(s for s in line if s.startswith(METRIC + "{"))
    # Past the cap: a metric after MAX_METRICS_CHARS characters of padding is not read at all.
    padded = "# " + "x" * MAX_METRICS_CHARS + "\n" + sample + "\n"
    assert "no vllm:kvp2p_pairing_info" in str(read_metrics(padded))
    assert parse_metrics("# x\n" + sample + "\n") == P  # control: the same sample, early, reads
    # One unterminated sample line of megabytes: parsed up to MAX_LINE characters, then refused.
    assert "is not closed" in str(read_metrics(METRIC + '{role="' + "a" * (3 << 20)))
    # Labels past MAX_LABELS, and samples past MAX_SAMPLES.
    many = METRIC + "{" + ",".join(f'l{i}="v"' for i in range(40)) + "} 1\n"
    assert "more than 32 labels" in str(read_metrics(many))
    assert f"more than {MAX_SAMPLES}" in str(read_metrics((sample + "\n") * (MAX_SAMPLES + 1)))
    assert parse_metrics((sample + "\n") * MAX_SAMPLES) == P  # control: at the bound, it reads
    # The metric's prefix repeated on one line without end: one sample, refused, not one per repeat.
    assert str(read_metrics((METRIC + "{") * 200_000)).startswith("malformed")


# --------------------------------------------------------------------------- the decision


def test_a_p_and_d_of_equal_keys_pair() -> None:
    assert mismatch(P, D) is None
    assert mismatch(dataclasses.replace(P, role="both"), dataclasses.replace(D, role="both")) is None


@pytest.mark.parametrize(("field", "p_value", "d_value", "words"), [
    ("protocol_version", 6, 5, "protocol version: P 6, D 5"),
    ("model_fingerprint", "0123456789abcdef", "fedcba9876543210",
     "model fingerprint: P 0123456789abcdef, D fedcba9876543210"),
    ("kv_cache_dtype", "bfloat16", "float16", "KV cache dtype: P bfloat16, D float16"),
    ("kv_cache_dtype", "bfloat16", "fp8_e4m3", "KV cache dtype: P bfloat16, D fp8_e4m3"),
    ("use_mla", True, False, "MLA: P true, D false"),
    ("draft", "none", "mtp:0011223344556677", "draft with KV layers: P none, D mtp:0011223344556677"),
    ("draft", "eagle:0011223344556677", "eagle:8899aabbccddeeff",
     "P eagle:0011223344556677, D eagle:8899aabbccddeeff"),
    ("block_size", 32, 48, "block size: P 32, D 48 (one must divide the other)"),
    ("block_size", 48, 32, "block size: P 48, D 32"),
])
def test_every_compared_value_mismatched_names_itself_and_both_values(field: str, p_value: object,
                                                                      d_value: object, words: str) -> None:
    p, d = dataclasses.replace(P, **{field: p_value}), dataclasses.replace(D, **{field: d_value})
    reason = mismatch(p, d)
    assert reason is not None and words in reason and "\n" not in reason, reason
    assert mismatch(p, dataclasses.replace(d, **{field: p_value})) is None  # control: only that value differed


def test_roles_that_cannot_prefill_or_decode_are_a_mismatch() -> None:
    assert mismatch(D, D) == "role: P is a kv_consumer (it never holds KV for a decoder), D is kv_consumer"
    assert mismatch(P, P) == "role: D is a kv_producer (it never pulls KV), P is kv_producer"
    assert mismatch(dataclasses.replace(P, role="both"), D) is None


@pytest.mark.parametrize("change", [
    {"block_size": 64}, {"block_size": 16}, {"block_size": 128},  # one divides the other: tests/e2e/test_block_sizes
    {"tp_size": 2}, {"tp_size": 8}, {"pp_size": 2},  # tp_mapping.py, lifecycle/stages.py
])
def test_differences_the_connector_handles_by_design_are_not_a_mismatch(change: dict[str, int]) -> None:
    assert mismatch(P, dataclasses.replace(D, **change)) is None
    assert mismatch(dataclasses.replace(P, **change), D) is None


def test_a_model_with_a_linear_attention_state_needs_one_block_size_and_one_tp_size() -> None:
    p, d = dataclasses.replace(P, linear_state=True), dataclasses.replace(D, linear_state=True)
    assert mismatch(p, d) is None
    assert mismatch(p, dataclasses.replace(d, block_size=64)) == (
        "block size: P 32, D 64 (a model with a linear-attention state needs the same on both)")
    assert mismatch(dataclasses.replace(p, tp_size=2), d) == (
        "tensor parallel size: P 2, D 1 (a model with a linear-attention state needs the same on both)")
    assert mismatch(p, dataclasses.replace(d, pp_size=2)) is None  # stages pair by layer name


def test_the_kv_cache_dtype_is_the_models_for_auto_and_fp8_is_its_e4m3_name() -> None:
    assert kv_cache_dtype("auto", "torch.bfloat16") == "bfloat16"
    assert kv_cache_dtype("fp8", "torch.bfloat16") == kv_cache_dtype("fp8_e4m3", "torch.float16") == "fp8_e4m3"
    assert kv_cache_dtype("fp8_e5m2", "torch.bfloat16") == "fp8_e5m2"


# --------------------------------------------------------------------------- asking an instance


def test_learning_an_instances_key_over_http_never_raises() -> None:
    async def main() -> list[object]:
        app = web.Application()
        def answer(status: int, text: str, delay_s: float = 0.0):  # noqa: ANN202
            async def handler(_: web.Request) -> web.Response:
                await asyncio.sleep(delay_s)
                return web.Response(status=status, text=text)
            return handler

        app.router.add_get("/good/metrics", answer(200, exposition(P)))
        app.router.add_get("/none/metrics", answer(200, "# nothing\n"))
        app.router.add_get("/error/metrics", answer(500, "boom"))
        app.router.add_get("/slow/metrics", answer(200, exposition(P), delay_s=0.5))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            closed = f"http://127.0.0.1:{s.getsockname()[1]}"
        client = Upstream(read_timeout_s=5, connect_timeout_s=2, max_connections=None)
        base = f"http://127.0.0.1:{port}"
        try:
            return [await learn_pairing(client, base + "/good", 5), await learn_pairing(client, base + "/none", 5),
                    await probe_pairing(client, base + "/error", 5), await probe_pairing(client, base + "/slow", 0.1),
                    await probe_pairing(client, closed, 2)]
        finally:
            await client.close()
            await runner.cleanup()

    good, none, error, slow, closed = asyncio.run(main())
    assert good == P
    assert none is None
    assert isinstance(error, str) and error.endswith("/error/metrics: HTTP 500")
    assert isinstance(slow, str) and "TimeoutError" in slow
    assert isinstance(closed, str) and "Connect" in closed, closed
