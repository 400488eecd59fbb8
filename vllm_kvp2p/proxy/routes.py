"""The routes the proxy serves, and its answer to any other path (pure).

A path the proxy does not serve gets an OpenAI-shaped error rather than a bare 404, so a client learns why: 501 for
a route of vLLM's own API that the proxy does not disaggregate (its message says to send it to an engine directly),
404 for anything else (its message lists the routes served). docs/api.md describes each route.
"""

from __future__ import annotations

from vllm_kvp2p.proxy.endpoints import ENDPOINTS
from vllm_kvp2p.proxy.upstream import ProxyError

#: Every route the proxy serves and its method (HEAD is also taken wherever GET is): the disaggregated ones
#: (endpoints.py), then the forwarded ones and its own.
SERVED: dict[str, str] = {
    **{path: "POST" for path in ENDPOINTS},
    "/v1/models": "GET",
    "/tokenize": "POST",
    "/detokenize": "POST",
    "/health": "GET",
}

#: vLLM 0.32's routes (vllm/entrypoints/**/api_router.py) the proxy does not serve: inference it does not split
#: into prefill and decode, and each engine's own administration (``/v1/responses/{id}``, a stored response
#: retrieved or cancelled on the one engine that stored it, among them).
VLLM_ROUTES: frozenset[str] = frozenset({
    "/v1/embeddings", "/v1/messages", "/v1/score", "/v1/rerank", "/v1/realtime",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/pooling", "/score", "/rerank", "/classify",
    "/generative_scoring", "/invocations", "/metrics", "/load", "/ping", "/version", "/server_info",
    "/tokenizer_info", "/ready", "/readyz", "/is_sleeping", "/is_paused", "/sleep", "/wake_up", "/pause", "/resume",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/release_kv_cache_memory",
    "/start_profile", "/stop_profile", "/collective_rpc", "/abort_requests", "/scale_elastic_ep",
    "/is_scaling_elastic_ep", "/get_world_size", "/kv_event_sources", "/update_weights", "/weight_info",
})
#: ... and the route families vLLM serves under these prefixes (``/v1/audio/transcriptions``,
#: ``/v1/completions/render``, ``/v1/chat/completions/batch``, ``/v2/embed``, ...).
VLLM_PREFIXES: tuple[str, ...] = (
    "/v1/audio/", "/v1/responses/", "/v1/messages/", "/v1/completions/", "/v1/chat/completions/", "/v2/",
    "/cohere/", "/inference/", "/fault_tolerance/",
)


def allowed(path: str) -> tuple[str, ...]:
    """The methods ``path`` is served for (none: the proxy does not serve it)."""
    method = SERVED.get(path)
    if method is None:
        return ()
    return (method, "HEAD") if method == "GET" else (method,)


def is_vllm_route(path: str) -> bool:
    return path in VLLM_ROUTES or path.startswith(VLLM_PREFIXES) or path.endswith(("_weight_update",
                                                                                   "_weight_transfer_engine"))


def not_served(method: str, path: str) -> ProxyError:
    """The error for a request the proxy does not serve: 405 (a served path, another method), 501 (vLLM's), 404."""
    methods = allowed(path)
    if methods:
        return ProxyError(405, f"{method} {path}: only {methods[0]}", "invalid_request_error")
    if is_vllm_route(path):
        return ProxyError(
            501,
            f"{path}: the P/D proxy does not disaggregate this route; send it to an engine (a vLLM instance) "
            "directly",
            "not_implemented_error",
        )
    served = ", ".join(f"{m} {p}" for p, m in SERVED.items())
    return ProxyError(404, f"{method} {path}: no such route; the proxy serves {served}", "not_found_error")
