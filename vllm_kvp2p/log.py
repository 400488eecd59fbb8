"""Loggers of this package live under vLLM's ``vllm`` logger, so ``vllm serve`` shows them with its own format,
level (``VLLM_LOGGING_LEVEL``) and handlers, without this package importing vLLM."""

from __future__ import annotations

import logging


def get_logger(module: str) -> logging.Logger:
    return logging.getLogger("vllm.kvp2p." + module.removeprefix("vllm_kvp2p."))
