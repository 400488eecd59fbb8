"""``vllm-kvp2p-proxy``: run the P/D proxy with uvicorn.

Accepts both ``--prefill URL ...`` / ``--decode URL ...`` and vLLM toy-proxy style
``--prefiller-hosts/--prefiller-ports/--decoder-hosts/--decoder-ports`` so existing launch scripts keep working.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence

from vllm_kvp2p.proxy.app import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_MAX_BATCH_CONCURRENCY, DEFAULT_TIMEOUT_S
from vllm_kvp2p.proxy.block_hashes import ALGORITHMS, DEFAULT_ALGORITHM, HashSettingsError
from vllm_kvp2p.proxy.cache_index import DEFAULT_MAX_BLOCKS
from vllm_kvp2p.proxy.disaggregation import DEFAULT_THRESHOLD_TOKENS, Mode, Objectives, ObjectivesError
from vllm_kvp2p.proxy.prompt_tokens import DEFAULT_TOKENIZE_TIMEOUT_S
from vllm_kvp2p.proxy.routing import Policy
from vllm_kvp2p.proxy.server import create_app
from vllm_kvp2p.proxy.validation import DEFAULT_MAX_BATCH_PROMPTS, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_N

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def build_parser() -> argparse.ArgumentParser:
    """The command line; separate from :func:`main` so tests can parse without serving."""
    p = argparse.ArgumentParser(
        prog="vllm-kvp2p-proxy",
        description="Proxy for disaggregated prefill/decode with the vllm_kvp2p Mooncake connector.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="prefill (kv_producer) instance urls, e.g. http://10.0.0.1:8100",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="decode (kv_consumer) instance urls, e.g. http://10.0.0.2:8200",
    )
    p.add_argument(
        "--instances",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="ordinary vLLM instances instead of P and D: each request goes whole to one of them, by the same "
        "routing (what P/D is compared with, benchmarks/bench_goodput.py); KV events with --decode-kv-events",
    )
    p.add_argument(
        "--kv-both",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="instances started with kv_role kv_both instead of P and D: each may prefill for another and decode, "
        "and --disaggregate decides per request which does what (docs/routing.md); KV events with "
        "--decode-kv-events",
    )
    p.add_argument(
        "--prefiller-hosts",
        "--prefiller-host",
        nargs="+",
        default=None,
        metavar="HOST",
        help="toy-proxy style prefill hosts (paired with --prefiller-ports)",
    )
    p.add_argument(
        "--prefiller-ports",
        "--prefiller-port",
        nargs="+",
        type=int,
        default=None,
        metavar="PORT",
        help="toy-proxy style prefill ports",
    )
    p.add_argument(
        "--decoder-hosts",
        "--decoder-host",
        nargs="+",
        default=None,
        metavar="HOST",
        help="toy-proxy style decode hosts (paired with --decoder-ports)",
    )
    p.add_argument(
        "--decoder-ports",
        "--decoder-port",
        nargs="+",
        type=int,
        default=None,
        metavar="PORT",
        help="toy-proxy style decode ports",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="limit up to decode's first byte, and on silence within a stream (default: %(default)s)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        metavar="SECONDS",
        help="limit on each TCP connect to an instance (default: %(default)s)",
    )
    p.add_argument(
        "--max-connections", type=int, default=None, help="cap on pooled upstream connections (default: no cap)"
    )
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, wait at most this long for open streams (default: %(default)s)",
    )
    requests = p.add_argument_group("requests (docs/api.md)")
    requests.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        metavar="N",
        help="the most sequences one request may ask for: its n, times its prompts when it is a batch; past it a 400 "
        "before any P is asked (default: %(default)s, vLLM's own VLLM_MAX_N_SEQUENCES)",
    )
    requests.add_argument(
        "--max-batch-prompts",
        type=int,
        default=DEFAULT_MAX_BATCH_PROMPTS,
        metavar="N",
        help="the most prompts one /v1/completions request may list; past it a 400 (default: %(default)s)",
    )
    requests.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="the largest request body the proxy reads; past it a 413. The default holds a 1,000,000-token prompt as "
        "token ids; a body holds the proxy's event loop, every other client waiting, about 25-55 ms per MiB of "
        "token ids (docs/performance.md section 19) (default: %(default)s)",
    )
    requests.add_argument(
        "--max-batch-concurrency",
        type=int,
        default=DEFAULT_MAX_BATCH_CONCURRENCY,
        metavar="N",
        help="how many prompts of one batched request run their prefill/decode at once; the rest wait their turn "
        "(default: %(default)s)",
    )
    placing = p.add_argument_group("disaggregation (docs/routing.md)")
    placing.add_argument(
        "--disaggregate",
        choices=[mode.value for mode in Mode],
        default=None,
        help="per request: always P/D, never (each request computed where it decodes), or auto: decided per "
        "request from --slo and what the proxy measures, or by --disaggregate-threshold without --slo "
        "(default: auto with --kv-both; always with --prefill/--decode, whose roles were decided at deployment; "
        "never with --instances)",
    )
    placing.add_argument(
        "--slo",
        default=None,
        metavar="ttft=TIME,tpot=TIME",
        help="the latency objectives auto decides by, e.g. ttft=300ms,tpot=15ms (time to first token; time per "
        "output token after the first); a request may override them with an X-KVP2P-SLO header of the same form",
    )
    placing.add_argument(
        "--disaggregate-threshold",
        type=int,
        default=DEFAULT_THRESHOLD_TOKENS,
        metavar="TOKENS",
        help="auto without --slo (and until the proxy has measured enough requests to predict): P/D when the "
        "decode instance lacks at least this many of the prompt's tokens (default: %(default)s)",
    )
    routing = p.add_argument_group("routing (docs/routing.md)")
    routing.add_argument(
        "--routing",
        choices=[policy.value for policy in Policy],
        default=Policy.PREFIX_AWARE.value,
        help="prefix-aware: least work ahead, a cached prefix counting as work done (needs the engines' KV events "
        "to know the caches; without them it routes by load); least-outstanding: fewest requests in flight "
        "(default: %(default)s)",
    )
    routing.add_argument(
        "--prefix-weight",
        type=float,
        default=1.0,
        metavar="W",
        help="how much a cached prompt token counts against a queued one, 0..100 (default: %(default)s)",
    )
    for role, flag in (("prefill", "--prefill-kv-events"), ("decode", "--decode-kv-events")):
        routing.add_argument(
            flag,
            nargs="+",
            action="extend",
            default=[],
            metavar="ENDPOINT[,REPLAY]",
            help=f"the KV-event publisher of each --{role} instance, in the same order (its --kv-events-config "
            f"endpoint, e.g. tcp://10.0.0.1:5557, and optionally its replay_endpoint after a comma); 'none' for an "
            "instance without events",
        )
    routing.add_argument(
        "--hash-algo",
        choices=ALGORITHMS,
        default=DEFAULT_ALGORITHM,
        help="the engines' --prefix-caching-hash-algo (default: %(default)s)",
    )
    routing.add_argument(
        "--hash-seed",
        default=os.environ.get("PYTHONHASHSEED"),
        metavar="SEED",
        help="the engines' PYTHONHASHSEED (default: this process's PYTHONHASHSEED; unset: vLLM 0.32's fixed seed. "
        "vLLM 0.23 engines need PYTHONHASHSEED set for their hashes to be reproducible at all)",
    )
    routing.add_argument(
        "--kv-index-max-blocks",
        type=int,
        default=DEFAULT_MAX_BLOCKS,
        metavar="N",
        help="block hashes kept per instance; past it the oldest go first (default: %(default)s)",
    )
    routing.add_argument(
        "--tokenize-timeout",
        type=float,
        default=DEFAULT_TOKENIZE_TIMEOUT_S,
        metavar="SECONDS",
        help="limit on asking a P's /tokenize for a text prompt's tokens; past it the request is routed by load "
        "(default: %(default)s)",
    )
    routing.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH_OR_NAME",
        help="the engines' tokenizer (their model directory, or its name in the Hugging Face cache): text "
        "completion prompts are then tokenized in the proxy instead of by a P's /tokenize (needs transformers; "
        "chat requests still use /tokenize)",
    )
    routing.add_argument(
        "--cache-headers",
        action="store_true",
        help="add X-KVP2P-Prefill-Cached-Tokens and X-KVP2P-Decode-Cached-Tokens (the prompt tokens counted as "
        "cached on P and D) to every answer. Off by default: with them any client learns which prefixes other "
        "clients' prompts share (guess a prompt's start, read how much of it is cached), the side channel vLLM's "
        "cache_salt closes. Only where every client is trusted (tests, benchmarks); the log has the counts anyway",
    )
    p.add_argument("--log-level", default="info", choices=_LOG_LEVELS, type=str.lower)
    return p


def parse_events(
    parser: argparse.ArgumentParser, flag: str, values: list[str], count: int
) -> list[tuple[str, str | None] | None] | None:
    """``--prefill-kv-events`` / ``--decode-kv-events`` values -> one (endpoint, replay) or None per instance."""
    if not values:
        return None
    if len(values) != count:
        parser.error(f"{flag}: {len(values)} endpoints for {count} instances (give one per instance, 'none' to skip)")
    out: list[tuple[str, str | None] | None] = []
    for value in values:
        if value.lower() == "none":
            out.append(None)
            continue
        endpoint, _, replay = value.partition(",")
        for ep in (endpoint, replay):
            if ep and not ep.startswith(("tcp://", "ipc://")):
                parser.error(f"{flag}: {ep!r} is no ZMQ endpoint (tcp://HOST:PORT)")
        out.append((endpoint, replay or None))
    return out


def _host_port_urls(
    parser: argparse.ArgumentParser, role: str, hosts: list[str] | None, ports: list[int] | None
) -> list[str]:
    """Pair toy-proxy hosts with ports; one host with many ports (or the reverse) is broadcast."""
    if hosts is None and ports is None:
        return []
    hosts = hosts or ["localhost"]
    if not ports:
        parser.error(f"--{role}-hosts given without --{role}-ports")
    if len(hosts) == 1 and len(ports) > 1:
        hosts = hosts * len(ports)
    elif len(ports) == 1 and len(hosts) > 1:
        ports = ports * len(hosts)
    if len(hosts) != len(ports):
        parser.error(f"--{role}-hosts ({len(hosts)}) and --{role}-ports ({len(ports)}) differ in length")
    # Bracket bare IPv6 addresses so the url parses.
    return [
        f"http://[{h}]:{p}" if ":" in h and not h.startswith("[") else f"http://{h}:{p}"
        for h, p in zip(hosts, ports, strict=True)
    ]


def resolve_instances(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """Prefill and decode urls from both flag styles; at least one of each is required. ``--instances`` and
    ``--kv-both``: no prefill urls, the instances in decode's place."""
    prefill = list(args.prefill) + _host_port_urls(parser, "prefiller", args.prefiller_hosts, args.prefiller_ports)
    decode = list(args.decode) + _host_port_urls(parser, "decoder", args.decoder_hosts, args.decoder_ports)
    for flag, urls in (("--instances", args.instances), ("--kv-both", args.kv_both)):
        if urls:
            if prefill or decode or args.prefill_kv_events or (args.instances and args.kv_both):
                parser.error(f"{flag} excludes the P and D flags, --prefill-kv-events and the other of --instances "
                             "and --kv-both")
            return [], list(urls)
    if not prefill:
        parser.error("no prefill instance: use --prefill URL or --prefiller-hosts/--prefiller-ports")
    if not decode:
        parser.error("no decode instance: use --decode URL or --decoder-hosts/--decoder-ports")
    return prefill, decode


def resolve_placing(args: argparse.Namespace, parser: argparse.ArgumentParser
                    ) -> tuple[Mode, Objectives | None, int]:
    """``--disaggregate`` (its default by the instances' shape), ``--slo``, ``--disaggregate-threshold``."""
    default = Mode.AUTO if args.kv_both else Mode.NEVER if args.instances else Mode.ALWAYS
    mode = default if args.disaggregate is None else Mode(args.disaggregate)
    if args.instances and mode is not Mode.NEVER:
        parser.error(f"--disaggregate {mode.value}: ordinary instances (--instances) cannot prefill for each other; "
                     "start them with kv_role kv_both and give them as --kv-both")
    try:
        objectives = None if args.slo is None else Objectives.parse(args.slo)
    except ObjectivesError as exc:
        parser.error(str(exc))
    if objectives is not None and mode is not Mode.AUTO:
        parser.error(f"--slo is what --disaggregate auto decides by; with --disaggregate {mode.value} it would "
                     "change nothing")
    if args.disaggregate_threshold < 0:
        parser.error("--disaggregate-threshold must be at least 0")
    return mode, objectives, args.disaggregate_threshold


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``vllm-kvp2p-proxy`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    prefill, decode = resolve_instances(args, parser)
    mode, objectives, threshold = resolve_placing(args, parser)
    if args.timeout <= 0 or args.connect_timeout <= 0:
        parser.error("--timeout and --connect-timeout must be positive")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tokenize_timeout <= 0:
        parser.error("--tokenize-timeout must be positive")
    for flag in ("max_n", "max_batch_prompts", "max_batch_concurrency", "max_body_bytes"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    try:
        app = create_app(
            prefill,
            decode,
            timeout_s=args.timeout,
            connect_timeout_s=args.connect_timeout,
            max_connections=args.max_connections,
            routing=Policy(args.routing),
            prefix_weight=args.prefix_weight,
            prefill_events=parse_events(parser, "--prefill-kv-events", args.prefill_kv_events, len(prefill)),
            decode_events=parse_events(parser, "--decode-kv-events", args.decode_kv_events, len(decode)),
            hash_algo=args.hash_algo,
            hash_seed=args.hash_seed,
            index_max_blocks=args.kv_index_max_blocks,
            tokenize_timeout_s=args.tokenize_timeout,
            tokenizer=args.tokenizer,
            max_n=args.max_n,
            max_batch_prompts=args.max_batch_prompts,
            max_body_bytes=args.max_body_bytes,
            max_batch_concurrency=args.max_batch_concurrency,
            cache_headers=args.cache_headers,
            kv_both=bool(args.kv_both),
            disaggregate=mode,
            objectives=objectives,
            threshold=threshold,
        )
    except (ValueError, HashSettingsError) as exc:
        parser.error(str(exc))

    import uvicorn  # only needed when actually serving

    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.graceful_shutdown_timeout,
    )


if __name__ == "__main__":
    main()
