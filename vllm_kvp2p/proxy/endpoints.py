"""The routes the proxy disaggregates (P then D) and each one's body rules, in one table (pure).

For each route: what P gets of the client's body (:meth:`Endpoint.prefill_body`: fields set, fields dropped, the
proxy's ``kv_transfer_params``), what is checked before any P is asked (:mod:`validation`), whether a list of prompts
is a batch the proxy splits (:mod:`batch_flow`), and where routing by cached prefix finds the prompt
(:mod:`prompt_tokens`). D always gets the client's body as it is, ``kv_transfer_params`` set to P's answer, and P's
answer is always read the same way: its JSON's top-level ``kv_transfer_params`` (completions, chat and vLLM's
``ResponsesResponse`` alike). docs/api.md describes each route.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from vllm_kvp2p.proxy.json_body import parse_body
from vllm_kvp2p.proxy.validation import Limits, check_request, check_responses

#: ``kv_transfer_params`` sent to the prefill instance: "compute the KV and keep it for a remote decoder".
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Completion and chat fields that make no sense in (or break) a 1-token, non-streaming prefill of one sequence: D
# samples the n sequences (best_of is ignored by vLLM 0.32; beam search would take P off the plain prefill path).
# Each value P does not see is checked by validation.py before P is asked, so D cannot refuse what P already holds.
# ``seed`` too: P's one sampled token is not used (D samples every token it sends), and vLLM's CPU model runner
# dies on a seeded request whose prefill is split over steps (gpu_model_runner.py rewinds the request's generator
# with set_offset, which a CPU torch.Generator refuses: "CPU Generator does not use offset", the engine is gone),
# which a few concurrent long seeded prompts make happen on P.
_SAMPLING_ONLY: tuple[str, ...] = (
    "stream_options", "min_tokens", "min_completion_tokens", "best_of", "use_beam_search", "seed",
)


def _frozen(values: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(values))


@dataclass(frozen=True)
class Endpoint:
    """One disaggregated route's body rules."""

    #: What the route serves: a ``/v1/completions``, ``/v1/chat/completions`` or ``/v1/responses`` request.
    kind: Literal["completion", "chat", "responses"]
    #: Fields P gets set to these values, whatever the client sent.
    prefill_set: Mapping[str, Any]
    #: Fields P gets set to these values only when the client sent them.
    prefill_set_if_present: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))
    #: Fields P does not get at all.
    prefill_drop: tuple[str, ...] = ()
    #: A list of prompts is a batch: one P/D flow per prompt (:mod:`batch_flow`).
    batched: bool = False
    #: The body field routing reads the prompt from (:mod:`prompt_tokens`); None: routed by load only.
    prompt: Literal["prompt", "messages"] | None = None
    #: Raises a 400 :class:`~vllm_kvp2p.proxy.upstream.ProxyError` naming the first field the proxy refuses.
    check: Callable[[dict[str, Any], Limits], None] = lambda body, limits: None

    def parse(self, raw: bytes, limits: Limits) -> dict[str, Any]:
        """The client's body, parsed within the proxy's bounds (:mod:`json_body`) and checked (:attr:`check`);
        a 400 :class:`~vllm_kvp2p.proxy.upstream.ProxyError` saying what is wrong otherwise."""
        body = parse_body(raw)
        self.check(body, limits)
        return body

    def prefill_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The copy of the client's ``body`` sent to P (``body`` itself, D's, is left as it is)."""
        p_body = dict(body)
        p_body.update({k: v for k, v in self.prefill_set_if_present.items() if k in p_body})
        p_body.update(self.prefill_set)
        for key in self.prefill_drop:
            p_body.pop(key, None)
        p_body["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
        return p_body


#: Every route the proxy disaggregates, by path.
ENDPOINTS: Mapping[str, Endpoint] = _frozen({
    "/v1/completions": Endpoint(
        kind="completion",
        prefill_set=_frozen({"n": 1, "max_tokens": 1, "stream": False}),
        prefill_set_if_present=_frozen({"max_completion_tokens": 1}),
        prefill_drop=_SAMPLING_ONLY,
        batched=True,
        prompt="prompt",
        check=lambda body, limits: check_request(body, chat=False, limits=limits),
    ),
    "/v1/chat/completions": Endpoint(
        kind="chat",
        prefill_set=_frozen({"n": 1, "max_tokens": 1, "max_completion_tokens": 1, "stream": False}),
        prefill_drop=_SAMPLING_ONLY,
        prompt="messages",
        check=lambda body, limits: check_request(body, chat=True, limits=limits),
    ),
    # vLLM's ResponsesRequest (0.23 and 0.32) has no n, best_of, stream_options nor min_tokens: only seed to drop.
    # store: false so P keeps no response (nor its input messages) in its store; background: false (a background
    # request is refused before P anyway: validation.check_responses).
    "/v1/responses": Endpoint(
        kind="responses",
        prefill_set=_frozen({"max_output_tokens": 1, "stream": False, "store": False, "background": False}),
        prefill_drop=("seed",),
        check=lambda body, limits: check_responses(body),
    ),
})

