"""The proxy's per-request placement run for real (vllm_kvp2p/proxy/placement.py): ``--kv-both``, ``--disaggregate
always|never|auto``, ``--slo`` and ``X-KVP2P-SLO``, against stub engines that answer as P when asked to hold
(``do_remote_decode``) and as D otherwise, as a ``kv_both`` engine does. The real-engine proof (answers equal one
instance's on every path) is tests/e2e_routing/test_kv_both_end_to_end.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tests.unit.proxy_harness import CLIENT_TIMEOUT, ServerThread, closed_port_url
from vllm_kvp2p.contract.pairing_key import METRIC, PairingKey
from vllm_kvp2p.proxy.cli import build_parser, resolve_instances, resolve_placing
from vllm_kvp2p.proxy.disaggregation import Mode, Objectives
from vllm_kvp2p.proxy.server import create_app

pytestmark = pytest.mark.timeout(60)

SHORT = list(range(4))  # below the tests' 8-token threshold
LONG = list(range(100, 140))


@dataclass
class BothStub:
    """A kv_both engine: holds and answers with params when asked to (P), decodes otherwise (D)."""

    name: str
    received: list[dict[str, Any]] = field(default_factory=list)
    fail_decode: bool = False
    server: ServerThread | None = None
    #: The pairing values its /metrics reports (None: no such metric, as an engine without it).
    pairing: PairingKey | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def roles(self) -> list[str]:
        return ["P" if (r.get("kv_transfer_params") or {}).get("do_remote_decode") else
                "D+params" if r.get("kv_transfer_params") else "D" for r in self.received]


def both_app(stub: BothStub) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        stub.received.append(body)
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            await asyncio.sleep(0.01)
            return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": {
                "do_remote_prefill": True, "remote_engine_id": stub.name, "remote_block_ids": [[1]],
                "remote_host": "127.0.0.1", "remote_port": 9}})
        if stub.fail_decode:
            return JSONResponse({"error": {"message": "engine dead", "type": "InternalServerError"}}, 500)
        pulled = {"kvp2p_pull": {"ok": True}} if kv else None
        if body.get("stream"):
            async def events() -> AsyncIterator[bytes]:
                for i in range(5):
                    await asyncio.sleep(0.03)  # apart: each its own read (a step the proxy can time)
                    yield f"data: {json.dumps({'choices': [{'text': f'{stub.name}{i}'}]})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"choices": [{"text": f"{stub.name} answer"}], "kv_transfer_params": pulled})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        if stub.pairing is None:
            return Response("# no pairing metric\n", media_type="text/plain")
        labels = ",".join(f'{k}="{v}"' for k, v in stub.pairing.labels().items())
        return Response(f"{METRIC}{{{labels}}} 1.0\n", media_type="text/plain")

    return app


@pytest.fixture(scope="module")
def engines() -> Iterator[list[BothStub]]:
    out = [BothStub(f"B{i}") for i in range(3)]
    for s in out:
        s.server = ServerThread(both_app(s)).start()
    yield out
    for s in out:
        assert s.server is not None
        s.server.stop()


@pytest.fixture
def proxy(engines: list[BothStub]) -> Iterator[Callable[..., str]]:
    started: list[ServerThread] = []

    def start(**kwargs: Any) -> str:
        for s in engines:
            s.received.clear()
            s.fail_decode = False
        kwargs.setdefault("timeout_s", 5.0)
        kwargs.setdefault("connect_timeout_s", 2.0)
        prefill = kwargs.pop("prefill", [])
        decode = kwargs.pop("decode", [s.url for s in engines[:2]])
        srv = ServerThread(create_app(prefill, decode, **kwargs)).start()
        started.append(srv)
        return srv.url

    yield start
    for srv in started:
        srv.stop()


def post(url: str, prompt: list[int], *, stream: bool = False, headers: dict[str, str] | None = None
         ) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 5, "stream": stream}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=CLIENT_TIMEOUT)


def health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()


def settled(url: str) -> None:
    """Nothing the proxy counted stays counted once every request ended."""
    h = health(url)
    for inst in h["prefill"] + h["decode"]:
        assert (inst["outstanding"], inst["pending_tokens"], inst["queued_prefills"], inst["queued_prefill_tokens"],
                inst["decodes"]) == (0, 0, 0, 0, 0), inst


def test_kv_both_auto_by_threshold(engines: list[BothStub], proxy: Callable[..., str]) -> None:
    """Without --slo: a prompt D lacks fewer than the threshold's tokens of is computed where it decodes (no P, no
    params); a longer one is prefilled on the other instance and pulled."""
    url = proxy(kv_both=True, threshold=8)
    r = post(url, SHORT)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvp2p-path"] == "local; reason=threshold"
    assert sorted(sum((s.roles() for s in engines), [])) == ["D"]
    for s in engines:
        s.received.clear()
    r = post(url, LONG)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvp2p-path"] == "pd; reason=threshold"
    p = next(s for s in engines if s.roles() == ["P"])
    d = next(s for s in engines if s.roles() == ["D+params"])
    assert p is not d
    assert r.headers["x-kvp2p-prefill-instance"] == p.url and r.headers["x-kvp2p-decode-instance"] == d.url
    placement = health(url)["placement"]
    assert placement["decisions"] == {"local/threshold": 1, "pd/threshold": 1}
    assert (placement["mode"], placement["kv_both"]) == ("auto", True)
    settled(url)


def test_kv_both_always_never_pairs_an_instance_with_itself(engines: list[BothStub], proxy: Callable[..., str]
                                                             ) -> None:
    url = proxy(kv_both=True, disaggregate=Mode.ALWAYS)
    for _ in range(6):
        r = post(url, SHORT)
        assert r.status_code == 200
        assert r.headers["x-kvp2p-prefill-instance"] != r.headers["x-kvp2p-decode-instance"]
    assert sorted(engines[0].roles() + engines[1].roles()) == ["D+params"] * 6 + ["P"] * 6
    assert health(url)["placement"]["decisions"] == {"pd/mode_always": 6}
    settled(url)


def test_never_sends_nothing_to_hold(engines: list[BothStub], proxy: Callable[..., str]) -> None:
    url = proxy(kv_both=True, disaggregate=Mode.NEVER)
    for prompt in (SHORT, LONG):
        assert post(url, prompt).status_code == 200
        assert post(url, prompt, stream=True).status_code == 200
    assert set(engines[0].roles() + engines[1].roles()) == {"D"}
    assert health(url)["placement"]["decisions"] == {"local/mode_never": 4}
    assert health(url)["hold_abandons"].get("sent", 0) == 0
    settled(url)


def test_dedicated_auto_computes_short_prompts_on_d(engines: list[BothStub], proxy: Callable[..., str]) -> None:
    """Dedicated roles with --disaggregate auto: a short prompt never reaches P; a long one does, and D never
    prefills for another instance (it has no P role)."""
    url = proxy(prefill=[engines[0].url], decode=[engines[1].url], disaggregate=Mode.AUTO, threshold=8)
    assert post(url, SHORT).status_code == 200
    assert post(url, LONG).status_code == 200
    assert (engines[0].roles(), engines[1].roles()) == (["P"], ["D", "D+params"])
    settled(url)


def test_the_default_with_dedicated_roles_is_always(engines: list[BothStub], proxy: Callable[..., str]) -> None:
    url = proxy(prefill=[engines[0].url], decode=[engines[1].url])
    assert post(url, SHORT).status_code == 200
    assert (engines[0].roles(), engines[1].roles()) == (["P"], ["D+params"])
    assert health(url)["placement"]["mode"] == "always"


def test_failures_and_streams_leave_nothing_counted(engines: list[BothStub], proxy: Callable[..., str]) -> None:
    url = proxy(kv_both=True, threshold=8)
    for prompt in (SHORT, LONG):
        assert post(url, prompt, stream=True).status_code == 200
    for s in engines:
        s.fail_decode = True
    for prompt in (SHORT, LONG):
        assert post(url, prompt).status_code == 502
    settled(url)
    assert sum(health(url)["placement"]["decisions"].values()) == 4


def test_streams_calibrate_the_cost_model(engines: list[BothStub], proxy: Callable[..., str]) -> None:
    """With --slo the threshold decides until the proxy has timed enough prefills and decode steps; then the
    objectives do (every decision counted by path and reason)."""
    url = proxy(kv_both=True, threshold=8, objectives=Objectives(ttft_ms=5000.0, tpot_ms=500.0))
    for i in range(12):
        assert post(url, LONG if i % 2 else SHORT, stream=True).status_code == 200
    placement = health(url)["placement"]
    model = placement["cost_model"]
    decisions = placement["decisions"]
    pd = sum(n for k, n in decisions.items() if k.startswith("pd/"))
    # Every request measured its prefill once (P's answer, or a local stream's first token) and its decode steps
    # once; every P/D stream its hop.
    assert model["calibrated"] and (model["prefill_observations"], model["decode_observations"]) == (12, 12), model
    assert model["hop_observations"] == pd >= 1, (model, decisions)
    assert decisions.get("local/slo_met", 0) >= 1, decisions  # generous objectives on idle stubs: all local
    assert sum(decisions.values()) == 12
    settled(url)


def test_a_request_states_its_own_objectives(engines: list[BothStub], proxy: Callable[..., str]) -> None:
    url = proxy(kv_both=True, threshold=8)
    r = post(url, SHORT, headers={"X-KVP2P-SLO": "ttft=300ms,tpot=15ms"})
    assert r.status_code == 200
    r = post(url, SHORT, headers={"X-KVP2P-SLO": "ttft=soon"})
    assert r.status_code == 400
    assert "X-KVP2P-SLO" in r.json()["error"]["message"]
    r = post(url, SHORT, headers={"X-KVP2P-SLO": "ttft=1ms," * 10_000})  # bounded: read up to 200 characters
    assert r.status_code == 400
    settled(url)


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-both", "http://a", "--prefill", "http://p", "--decode", "http://d"], "--kv-both excludes"),
    (["--instances", "http://a", "--disaggregate", "auto"], "cannot prefill for each other"),
    (["--prefill", "http://p", "--decode", "http://d", "--slo", "ttft=1s,tpot=1ms"], "--slo is what"),
    (["--kv-both", "http://a", "http://b", "--slo", "ttft=1s"], "--slo='ttft=1s': tpot missing"),
    (["--kv-both", "http://a", "--disaggregate-threshold", "-1"], "--disaggregate-threshold"),
])
def test_cli_refuses_naming_the_setting(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    with pytest.raises(SystemExit):
        resolve_instances(args, parser)
        resolve_placing(args, parser)
    assert message in capsys.readouterr().err


def test_cli_defaults_by_shape() -> None:
    parser = build_parser()
    for argv, mode in ((["--kv-both", "http://a", "http://b"], Mode.AUTO),
                       (["--prefill", "http://p", "--decode", "http://d"], Mode.ALWAYS),
                       (["--instances", "http://a"], Mode.NEVER)):
        assert resolve_placing(parser.parse_args(argv), parser)[0] is mode
    args = parser.parse_args(["--kv-both", "http://a", "http://b", "--slo", "ttft=300ms,tpot=15ms"])
    assert resolve_placing(args, parser) == (Mode.AUTO, Objectives(300.0, 15.0), 1024)


KEY = PairingKey(role="both", protocol_version=1, model_fingerprint="aaaa", kv_cache_dtype="float32", use_mla=False,
                 draft="none", block_size=32, linear_state=False, tp_size=1, pp_size=1)


def learned(url: str, count: int) -> None:
    """Wait (bounded) until the proxy read ``count`` instances' pairing values."""
    deadline = time.monotonic() + 10.0
    while sum(i["pairing"] is not None for i in health(url)["decode"]) < count:
        assert time.monotonic() < deadline, health(url)
        time.sleep(0.05)


@pytest.mark.parametrize("mode", [Mode.ALWAYS, Mode.AUTO])
def test_a_pair_that_cannot_exchange_kv_is_never_formed(
    engines: list[BothStub], proxy: Callable[..., str], mode: Mode, caplog: pytest.LogCaptureFixture
) -> None:
    """B2 runs another model (its fingerprint differs): it never prefills for B0/B1 nor decodes their prompts,
    and each refused pair is logged once naming both instances and the value; B0 and B1 keep pairing. The
    control: with B2's values unknown (no metric), the same proxy does pair it."""
    caplog.set_level(logging.WARNING, logger="vllm_kvp2p.proxy")
    engines[0].pairing = engines[1].pairing = KEY
    engines[2].pairing = dataclasses.replace(KEY, model_fingerprint="bbbb")
    try:
        url = proxy(kv_both=True, disaggregate=mode, threshold=8, decode=[s.url for s in engines])
        learned(url, 3)
        for _ in range(12):
            r = post(url, LONG)
            assert r.status_code == 200, r.text
            pair = {r.headers.get("x-kvp2p-prefill-instance"), r.headers["x-kvp2p-decode-instance"]}
            assert engines[2].url not in pair or len(pair - {None}) == 1, pair
        assert set(engines[2].roles()) <= {"D"}  # at most a prompt of its own, never P nor a pull
        warnings = [m for m in caplog.messages if m.startswith("never pairing")]
        assert len(warnings) == len(set(warnings)) >= 1, warnings
        assert all("model fingerprint: P " in m and engines[2].url in m for m in warnings), warnings
        unpaired = health(url)["placement"]["unpaired"]
        assert {(u["prefill"], u["decode"]) for u in unpaired} <= {
            (a.url, b.url) for a in engines for b in engines if engines[2] in (a, b) and a is not b}
        assert any(r == "P" for s in engines[:2] for r in s.roles())  # the others still pair

        engines[2].pairing = None  # the control: unknown values do not stop a pair (D's own check would)
        url = proxy(kv_both=True, disaggregate=Mode.ALWAYS, decode=[s.url for s in engines])
        learned(url, 2)
        for _ in range(9):
            assert post(url, LONG).status_code == 200
        assert "P" in engines[2].roles() or "D+params" in engines[2].roles()
    finally:
        for s in engines:
            s.pairing = None


def test_no_pair_at_all_computes_where_it_decodes(engines: list[BothStub], proxy: Callable[..., str]) -> None:
    engines[0].pairing = KEY
    engines[1].pairing = dataclasses.replace(KEY, kv_cache_dtype="bfloat16")
    try:
        url = proxy(kv_both=True, disaggregate=Mode.ALWAYS)
        learned(url, 2)
        for _ in range(4):
            r = post(url, LONG)
            assert r.status_code == 200 and r.headers["x-kvp2p-path"] == "local; reason=no_prefill_instance"
        assert set(engines[0].roles() + engines[1].roles()) == {"D"}
        settled(url)
    finally:
        for s in engines:
            s.pairing = None


def test_a_prefill_retried_after_p_went_away_is_never_on_d(engines: list[BothStub], proxy: Callable[..., str]
                                                           ) -> None:
    """kv_both: P went away before answering (the first instance, the first P routing picks); the one retry goes
    to another instance, and D is never the instance that prefilled (a kv_both instance does not pull from itself;
    Placer.retry_prefill, which auto's retries share)."""
    url = proxy(kv_both=True, disaggregate=Mode.ALWAYS, decode=[closed_port_url(), engines[0].url, engines[1].url])
    for _ in range(8):
        r = post(url, LONG)
        if r.status_code == 502:  # the dead instance chosen as D: not retried (D may have begun), then skipped
            assert "decode instance" in r.json()["error"]["message"], r.text
            continue
        assert r.status_code == 200, r.text
        assert r.headers["x-kvp2p-prefill-instance"] != r.headers["x-kvp2p-decode-instance"]
    assert health(url)["prefill_retries"] >= 1
    settled(url)
