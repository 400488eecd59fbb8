"""Disaggregated prefill/decode proxy (``vllm-kvp2p-proxy``).

Deliberately free of vllm and torch imports: it only needs fastapi, aiohttp and uvicorn (and pyzmq and msgspec to
read the engines' KV events).
"""

from __future__ import annotations

from vllm_kvp2p.proxy.app import PREFILL_KV_TRANSFER_PARAMS, PDProxy
from vllm_kvp2p.proxy.instances import InstancePool
from vllm_kvp2p.proxy.server import create_app
from vllm_kvp2p.proxy.upstream import normalize_url

__all__ = [
    "PREFILL_KV_TRANSFER_PARAMS",
    "InstancePool",
    "PDProxy",
    "create_app",
    "normalize_url",
]
