"""``vllm-kvp2p-proxy``: run the P/D proxy with uvicorn.

Accepts both ``--prefill URL ...`` / ``--decode URL ...`` and vLLM toy-proxy style
``--prefiller-hosts/--prefiller-ports/--decoder-hosts/--decoder-ports`` so existing launch scripts keep working.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from vllm_kvp2p.proxy.app import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_TIMEOUT_S, create_app

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
    p.add_argument("--log-level", default="info", choices=_LOG_LEVELS, type=str.lower)
    return p


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
    """Prefill and decode urls from both flag styles; at least one of each is required."""
    prefill = list(args.prefill) + _host_port_urls(parser, "prefiller", args.prefiller_hosts, args.prefiller_ports)
    decode = list(args.decode) + _host_port_urls(parser, "decoder", args.decoder_hosts, args.decoder_ports)
    if not prefill:
        parser.error("no prefill instance: use --prefill URL or --prefiller-hosts/--prefiller-ports")
    if not decode:
        parser.error("no decode instance: use --decode URL or --decoder-hosts/--decoder-ports")
    return prefill, decode


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``vllm-kvp2p-proxy`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    prefill, decode = resolve_instances(args, parser)
    if args.timeout <= 0 or args.connect_timeout <= 0:
        parser.error("--timeout and --connect-timeout must be positive")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(
            prefill,
            decode,
            timeout_s=args.timeout,
            connect_timeout_s=args.connect_timeout,
            max_connections=args.max_connections,
        )
    except ValueError as exc:
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
