"""The proxy's pure parts: the instance pool (least outstanding, ties round robin, exclusion, releases), P's copy of
a request, and the command line (instances, KV-event endpoints, routing flags)."""

from __future__ import annotations

import pytest

from tests.unit.proxy_harness import COMPLETION
from vllm_kvp2p.proxy import PREFILL_KV_TRANSFER_PARAMS, InstancePool, PDProxy
from vllm_kvp2p.proxy.cli import build_parser, parse_events, resolve_instances
from vllm_kvp2p.proxy.instances import Lease

# Generous per-test caps: the bounds that matter are asserted inside the tests; these only stop a hang.
pytestmark = pytest.mark.timeout(30)



class LeastOutstanding:
    """The pool under ``least-outstanding`` routing, spoken to in urls (the tests below predate leases)."""

    def __init__(self, urls: list[str]) -> None:
        self.pool = InstancePool(urls)
        self.leases: dict[str, list] = {}

    def acquire(self, exclude: str | None = None) -> str:
        lease = self.pool.acquire(exclude=exclude)
        self.leases.setdefault(lease.url, []).append(lease)
        return lease.url

    def release(self, url: str) -> None:
        self.pool.release(self.leases[url].pop() if self.leases.get(url) else Lease(url, 0, 0))

    def outstanding(self, url: str) -> int:
        return self.pool.outstanding(url)

    def snapshot(self) -> list[dict]:
        return self.pool.snapshot()


def test_balancer_ties_round_robin() -> None:
    b = LeastOutstanding(["a", "b", "c"])
    picks = []
    for _ in range(6):
        u = b.acquire()
        picks.append(u)
        b.release(u)
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_balancer_least_outstanding() -> None:
    b = LeastOutstanding(["a", "b"])
    assert b.acquire() == "a"
    assert b.acquire() == "b"
    assert b.acquire() == "a"  # tie 1/1 -> round robin
    # a=2, b=1; make a idle: least outstanding beats the round-robin cursor.
    b.release("a")
    b.release("a")
    assert b.outstanding("a") == 0
    assert b.acquire() == "a"  # a=0 < b=1 wins although the round-robin cursor points at b
    assert [e["outstanding"] for e in b.snapshot()] == [1, 1]
    assert [e["served"] for e in b.snapshot()] == [3, 1]


def test_balancer_release_paths() -> None:
    b = LeastOutstanding(["a"])
    with pytest.raises(RuntimeError), b.pool.lease() as lease:
        assert b.outstanding(lease.url) == 1
        raise RuntimeError("boom")
    assert b.outstanding("a") == 0
    b.release("a")  # extra release cannot go negative
    assert b.outstanding("a") == 0
    with pytest.raises(ValueError):
        InstancePool([])
    with pytest.raises(ValueError):
        InstancePool(["a", "a"])


def test_balancer_exclude() -> None:
    b = LeastOutstanding(["a", "b", "c"])
    assert b.acquire(exclude="a") == "b"  # a would be next in round robin
    assert b.acquire(exclude="c") == "a"  # least outstanding among a and b (0 vs 1)
    # a=1, b=1, c=0: c is the least loaded, but excluded -> tie a/b broken round robin from the cursor (b).
    assert b.acquire(exclude="c") == "b"
    assert [e["outstanding"] for e in b.snapshot()] == [1, 2, 0]
    assert [e["served"] for e in b.snapshot()] == [1, 2, 0]
    for u in ("a", "b", "b"):
        b.release(u)
    # Idle again: the excluded url is skipped, the rest keeps the plain round-robin order.
    picks = []
    for _ in range(4):
        u = b.acquire(exclude="b")
        picks.append(u)
        b.release(u)
    assert picks == ["c", "a", "c", "a"]
    assert b.acquire() == "b"  # without exclude, b is back in the rotation
    b.release("b")
    # A single instance is returned even when excluded (a retry then goes to the same one).
    single = LeastOutstanding(["only"])
    assert single.acquire(exclude="only") == "only"
    assert single.outstanding("only") == 1
    with pytest.raises(KeyError):
        b.acquire(exclude="nope")
    assert [e["outstanding"] for e in b.snapshot()] == [0, 0, 0]


def test_prefill_body() -> None:
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}, "min_completion_tokens": 2}
    p = PDProxy.prefill_body(body, chat=False)
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert not {"stream_options", "min_tokens", "min_completion_tokens"} & set(p)
    assert "max_completion_tokens" not in p
    assert p["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert body["max_tokens"] == 17 and body["stream"] is True  # original untouched
    chat = PDProxy.prefill_body({"messages": [], "max_completion_tokens": 50}, chat=True)
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1


def test_cli_parsing() -> None:
    parser = build_parser()
    args = parser.parse_args(
        [
            "--prefill",
            "http://p0:1",
            "--prefill",
            "p1:2",
            "--decoder-hosts",
            "d",
            "--decoder-ports",
            "3",
            "4",
            "--timeout",
            "7",
            "--port",
            "9000",
        ]
    )
    prefill, decode = resolve_instances(args, parser)
    assert prefill == ["http://p0:1", "p1:2"]
    assert decode == ["http://d:3", "http://d:4"]
    assert args.timeout == 7.0 and args.port == 9000 and args.host == "127.0.0.1"
    toy = parser.parse_args(
        ["--prefiller-hosts", "a", "b", "--prefiller-ports", "1", "2", "--decoder-host", "::1", "--decoder-port", "5"]
    )
    assert resolve_instances(toy, parser) == (["http://a:1", "http://b:2"], ["http://[::1]:5"])
    for bad in (
        ["--decode", "d:1"],
        ["--prefill", "p:1"],
        ["--prefill", "p:1", "--decoder-hosts", "a", "b", "c", "--decoder-ports", "1", "2"],
    ):
        with pytest.raises(SystemExit):
            resolve_instances(parser.parse_args(bad), parser)


def test_cli_routing_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["--prefill", "p:1", "p:2", "--decode", "d:1",
                              "--prefill-kv-events", "tcp://p:5557,tcp://p:5558", "none",
                              "--decode-kv-events", "tcp://d:5557", "--hash-seed", "0"])
    assert args.routing == "prefix-aware" and args.hash_algo == "sha256" and args.hash_seed == "0"
    assert parse_events(parser, "--prefill-kv-events", args.prefill_kv_events, 2) == [
        ("tcp://p:5557", "tcp://p:5558"), None]
    assert parse_events(parser, "--decode-kv-events", args.decode_kv_events, 1) == [("tcp://d:5557", None)]
    assert parse_events(parser, "--decode-kv-events", [], 1) is None
    for values, count, needle in ((["tcp://p:1"], 2, "1 endpoints for 2 instances"),
                                  (["http://p:1"], 1, "no ZMQ endpoint")):
        with pytest.raises(SystemExit):
            parse_events(parser, "--prefill-kv-events", values, count)
        assert needle in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill", "p:1", "--decode", "d:1", "--routing", "random"])
