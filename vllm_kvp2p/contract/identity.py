"""Who a P instance is, beyond the address a client names: its incarnation and its model's fingerprint.

Both halves of an instance (the scheduler that issues ``kv_transfer_params`` and the workers that serve the
registration) run in different processes; they derive the same values from the same ``VllmConfig``, so they
need no channel between them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Fields of the model's (text) config that decide what its KV cache holds: two models that agree on the KV
# geometry but not on these would pair silently. A whitelist, so that settings vLLM or an operator may set
# differently on P and D (paths, dtype of the weights, context length) never make a deployment refuse itself.
_KV_DEFINING_FIELDS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "sliding_window", "layer_types", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval", "num_experts",
)


def incarnation(vllm_config: Any, engine_id: str) -> str:
    """Differs at every start of an instance, the same in all its processes: vLLM stamps each ``VllmConfig`` it
    creates with ``instance_id`` (the time it was made) and hands that object to every process of the engine."""
    instance = getattr(vllm_config, "instance_id", "") or ""
    return hashlib.sha256(f"{engine_id}/{instance}".encode()).hexdigest()[:16]


def model_fingerprint(vllm_config: Any) -> str:
    model = vllm_config.model_config
    text_config = getattr(model, "hf_text_config", None) or model.hf_config
    described = {name: getattr(text_config, name, None) for name in _KV_DEFINING_FIELDS}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]
