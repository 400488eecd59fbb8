"""Disaggregated prefill/decode proxy (``vllm-kvp2p-proxy``).

Deliberately free of vllm and torch imports: it only needs fastapi, httpx and uvicorn.
"""

from __future__ import annotations

from vllm_kvp2p.proxy.app import PREFILL_KV_TRANSFER_PARAMS, PDProxy, create_app, normalize_url
from vllm_kvp2p.proxy.balancer import LeastOutstandingBalancer

__all__ = [
    "PREFILL_KV_TRANSFER_PARAMS",
    "LeastOutstandingBalancer",
    "PDProxy",
    "create_app",
    "normalize_url",
]
