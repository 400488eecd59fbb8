"""``vllm-kvp2p``: the operator's command, with subcommands.

    vllm-kvp2p check [--kv-transfer-config JSON] [--tensor-parallel-size N] [--pipeline-parallel-size N]
                     [--data-parallel-size N] [--json]
    vllm-kvp2p config-reference [--write docs/configuration.md]

``check`` reads the environment and the ``--kv-transfer-config`` an engine would be given, prints every
resolved setting with its source and one line per finding, and exits 1 when any is a problem
(vllm_kvp2p/cli/check.py). ``config-reference`` prints the settings table of docs/configuration.md, generated
from vllm_kvp2p/contract/config.py (or rewrites it in that file). The proxy and the demo keep their own console scripts.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-kvp2p", description="MooncakeP2PConnector operator tools")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="check a configuration before starting an engine with it")
    check.add_argument("--kv-transfer-config", default=None,
                       help="the JSON given to `vllm serve --kv-transfer-config` (or @file); default: kv_both, "
                            "no extra config")
    check.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    check.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    check.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    check.add_argument("--no-engine", action="store_true", help="do not start a Mooncake engine")
    check.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    ref = sub.add_parser("config-reference", help="print the settings table of docs/configuration.md")
    ref.add_argument("--write", type=Path, default=None, help="replace the generated table in this file")
    args = parser.parse_args(argv)
    if args.command == "config-reference":
        from vllm_kvp2p.contract.config_reference import reference_table, with_reference_table

        if args.write is None:
            sys.stdout.write(reference_table())
        else:
            args.write.write_text(with_reference_table(args.write.read_text()))
        return 0
    from vllm_kvp2p.cli.check import parse_kv_transfer_config, run

    try:
        kv_config = parse_kv_transfer_config(args.kv_transfer_config)
    except (OSError, ValueError) as exc:
        print(f"PROBLEM  --kv-transfer-config: {exc}", file=sys.stderr)
        return 2
    report = run(kv_config, os.environ, args.tensor_parallel_size, args.data_parallel_size,
                 engine=not args.no_engine, pp_size=args.pipeline_parallel_size)
    print(report.to_json() if args.json else report.to_text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
