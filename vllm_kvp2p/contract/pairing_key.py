"""What an instance tells a router about whether it can exchange KV with another: :class:`PairingKey`, exported
once per engine as the info metric ``vllm:kvp2p_pairing_info`` (vllm_kvp2p/connector/metrics.py) and read back by the
proxy
(vllm_kvp2p/proxy/pairing.py, which decides). Pure; shared by the engine and the proxy, so the label names exist
once.

The values are those D's own checks compare when it accepts P's params and P's registration
(lifecycle/admission.py, lifecycle/compatibility.py), as far as an engine's configuration fixes them before any
request: the protocol version, the model (identity.model_fingerprint: layers, heads, head size, attention kinds),
the KV cache's dtype, MLA, a speculative-decoding draft's KV layers, the block size, and for models with a
linear-attention state the TP size. What is only known per rank once the KV cache exists (the block interior a
platform's attention kernel uses, the exact KV-cache groups of a model with sliding windows) stays D's check.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

#: The info metric's name on an engine's /metrics (a gauge that is always 1; the values are its labels).
METRIC = "vllm:kvp2p_pairing_info"
ROLES = ("producer", "consumer", "both")
#: Speculative methods whose drafter has no attention layer, so no KV of its own to pair (vLLM's names).
_DRAFTS_WITHOUT_KV = frozenset({"ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator"})
#: Characters of a label value kept: every value here is far shorter (a dtype is at most ~16).
MAX_VALUE = 64


@dataclass(frozen=True)
class PairingKey:
    """One engine's values that decide whether it can exchange KV with another (and which side it can be)."""

    role: str  # "producer", "consumer" or "both" (kv_role without its prefix)
    protocol_version: int  # vllm_kvp2p.contract.protocol.PROTOCOL_VERSION of the release it runs
    model_fingerprint: str  # identity.model_fingerprint: a digest of the KV-defining model config
    kv_cache_dtype: str  # the KV cache's element type: --kv-cache-dtype, or the model's dtype for "auto"
    use_mla: bool  # MLA's latent cache (vLLM may turn it off for the same model: VLLM_MLA_DISABLE)
    draft: str  # "none", or a drafter with KV layers: "<method>:<its model's fingerprint>"
    block_size: int  # tokens per block, as the engine finally runs (after vLLM's start-up adjustments)
    linear_state: bool  # a Mamba / linear-attention state group: then block size and TP size must be equal
    tp_size: int  # informational but for linear_state: the TP mapping pairs any two valid layouts
    pp_size: int  # informational: pipeline stages pair by layer name (lifecycle/stages.py)

    def labels(self) -> dict[str, str]:
        """The metric's labels, in field order."""
        return {f.name: _text(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_labels(cls, labels: Mapping[str, str]) -> PairingKey | str:
        """The key these labels give, or why they give none (a missing label, a value of the wrong type)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            text = labels.get(f.name)
            if text is None:
                return f"label {f.name} is missing"
            if len(text) > MAX_VALUE:
                return f"label {f.name} is longer than {MAX_VALUE} characters"
            if f.type == "int":
                if not text.isascii() or not text.isdigit() or len(text) > 9:
                    return f"label {f.name}={text!r} is not a count"
                values[f.name] = int(text)
            elif f.type == "bool":
                if text not in ("true", "false"):
                    return f"label {f.name}={text!r} is not true or false"
                values[f.name] = text == "true"
            else:
                values[f.name] = text
        if values["role"] not in ROLES:
            return f"label role={values['role']!r} is not one of {', '.join(ROLES)}"
        return cls(**values)


LABELS: tuple[str, ...] = tuple(f.name for f in fields(PairingKey))


def _text(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def of_engine(vllm_config: Any) -> PairingKey:
    """The key of the engine ``vllm_config`` configures (as the API server holds it once the engine is up: vLLM
    copies back the block size the engine settled on before it builds its metrics). Reads attributes both vLLM
    0.23 and 0.32 have; raises on a config without them."""
    from vllm_kvp2p.contract.identity import model_fingerprint
    from vllm_kvp2p.contract.protocol import PROTOCOL_VERSION

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    role = str(vllm_config.kv_transfer_config.kv_role).removeprefix("kv_")
    return PairingKey(
        role=role,
        protocol_version=PROTOCOL_VERSION,
        model_fingerprint=model_fingerprint(vllm_config),
        kv_cache_dtype=kv_cache_dtype(str(cache.cache_dtype), str(model.dtype)),
        use_mla=bool(model.use_mla),
        draft=_draft(vllm_config.speculative_config),
        block_size=int(cache.block_size),
        linear_state=bool(model.is_hybrid or model.is_attention_free),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
    )


def kv_cache_dtype(cache_dtype: str, model_dtype: str) -> str:
    """The KV cache's element type as a name: the model's dtype for ``auto``; vLLM's ``fp8`` is ``fp8_e4m3``."""
    if cache_dtype == "auto":
        return model_dtype.removeprefix("torch.")[:MAX_VALUE]
    return ("fp8_e4m3" if cache_dtype == "fp8" else cache_dtype)[:MAX_VALUE]


def _draft(speculative_config: Any) -> str:
    """A speculative-decoding drafter with attention layers adds them to the KV cache: P fills them, D needs
    them (lifecycle/compatibility.py ``_layers_problem``). One without (n-gram, suffix, ...) pairs with none."""
    method = getattr(speculative_config, "method", None) if speculative_config is not None else None
    if not method or method in _DRAFTS_WITHOUT_KV:
        return "none"
    from vllm_kvp2p.contract.identity import model_fingerprint

    draft_model = getattr(speculative_config, "draft_model_config", None)
    digest = model_fingerprint(types.SimpleNamespace(model_config=draft_model)) if draft_model is not None else "-"
    return f"{str(method)[:32]}:{digest}"
