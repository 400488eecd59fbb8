"""A tiny random Qwen3-Next model directory (hybrid: Gated DeltaNet linear attention + full attention, MoE), made
locally (no model hub), for tests of models whose KV cache includes linear-attention state.

Built by transformers' own ``Qwen3NextForCausalLM`` (every weight name is the one vLLM's loader expects): three
linear-attention layers then one full-attention layer, 4 experts. vLLM's CPU GDN kernels need bfloat16 and a
linear head size of 128. vLLM 0.23 cannot run it on CPU, with or without a connector: its CPU fused-MoE fails at
the first forward pass ("Current vLLM config is not set"), and its Qwen3-Next needs at least one MoE layer.
Rescaled as make_tiny_deepseek_v3 does, so the state and the attention matter. The tokenizer is make_tiny_llama's.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_kvp2p.testing.tiny_model import BOS_ID, EOS_ID, PAD_ID, _spec, build_model_dir, save_transformers_model

LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention")


def make_tiny_qwen3_next(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    hidden: int = 256,
    vocab: int = 512,
    max_pos: int = 2048,
    dtype: str = "bfloat16",
) -> Path:
    """Write (or reuse, when built with the same arguments) the model at ``path``; returns it. Same directory
    rules as make_tiny_llama (:func:`~vllm_kvp2p.testing.tiny_model.build_model_dir`)."""
    spec = _spec(architecture="Qwen3NextForCausalLM", seed=seed, hidden=hidden, vocab=vocab, max_pos=max_pos,
                 dtype=dtype, layer_types=list(LAYER_TYPES))

    def write(tmp: Path) -> None:
        import torch
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(LAYER_TYPES),
            layer_types=list(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
            shared_expert_intermediate_size=hidden // 2, max_position_embeddings=max_pos, bos_token_id=BOS_ID,
            eos_token_id=EOS_ID, pad_token_id=PAD_ID, initializer_range=hidden**-0.5, tie_word_embeddings=False,
        )
        torch.manual_seed(seed)
        model = Qwen3NextForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "embed_tokens" in name:
                    p.normal_(0.0, 1.0)
                elif "lm_head" in name:
                    p.mul_(3.0)
                elif any(k in name for k in ("q_proj", "k_proj", "in_proj_qkvz")):
                    p.mul_(2.0)  # sharper attention: the answer depends on what is in the cache and the state
        save_transformers_model(model, tmp, dtype, vocab, max_pos)

    return build_model_dir(Path(path), spec, write)
