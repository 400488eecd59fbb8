"""A tiny random DeepSeek-V3 (MLA) model directory, made locally (no model hub), for MLA tests.

vLLM's CPU MLA backend accepts only the latent head size 576 (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64) and
block size 16. The model is built by transformers' own ``DeepseekV3ForCausalLM`` (so every weight name is the one
vLLM's loader expects) with all layers dense (``first_k_dense_replace`` = layers) and ``q_lora_rank`` None, then
rescaled so attention matters: unit-variance embeddings and larger q / kv projections, as make_tiny_llama does,
so a wrong KV cache shows in the answers. The tokenizer is make_tiny_llama's.

RoPE is DeepSeek-V3's own: YaRN with its published values (:data:`DEEPSEEK_V3_YARN`; ``rope="default"`` gives plain
RoPE). That matters on CPU: vLLM's plain ``RotaryEmbedding`` runs its CPU custom op, which assumes a 2-D
``[tokens, heads x dim]`` layout and rotates the wrong rows of the 3-D strided views MLA passes it (see
``scripts/repro_vllm_cpu_rope_mla.py``), so a plain-RoPE MLA model is not even position-consistent on one
instance; YaRN's class has no CPU custom op and is correct.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_kvp2p.testing.tiny_model import BOS_ID, EOS_ID, PAD_ID, _spec, build_model_dir, save_transformers_model

#: What vLLM's CPU MLA backend needs.
MLA_BLOCK_SIZE = 16
#: DeepSeek-V3's RoPE (its config.json ``rope_scaling``): YaRN over an original 4,096-token context, factor 40.
DEEPSEEK_V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                    "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                    "mscale_all_dim": 1.0}


def make_tiny_deepseek_v3(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    num_layers: int = 3,
    hidden: int = 256,
    heads: int = 4,
    vocab: int = 512,
    max_pos: int = 2048,
    dtype: str = "bfloat16",
    rope: str = "yarn",
    mtp_layers: int = 0,
) -> Path:
    """Write (or reuse, when built with the same arguments) the model at ``path``; returns it. Same directory
    rules as make_tiny_llama (:func:`~vllm_kvp2p.testing.tiny_model.build_model_dir`).

    ``mtp_layers`` > 0 adds DeepSeek-V3's multi-token-prediction layers as its checkpoint holds them (config
    ``num_nextn_predict_layers``; weights ``model.layers.{num_layers + i}.*``: a whole decoder layer plus ``enorm``,
    ``hnorm``, ``eh_proj``, ``shared_head`` and its copy of ``embed_tokens``), what vLLM's ``deepseek_mtp``
    speculative method loads. They are dense like the others and change nothing for the main model.

    Each MTP layer is a copy of decoder layer 0 fed only the next token's embedding (``eh_proj`` = [I, 0]; the
    embeddings have unit RMS, so ``enorm`` keeps them): with ``num_layers=1`` it computes what the model computes
    one position later, from its own KV cache, so its drafts are mostly accepted, and an MTP KV cache that is not
    the prompt's (not pulled, or not filled on P) shows as fewer accepted drafts while the answers stay the same."""
    spec = _spec(architecture="DeepseekV3ForCausalLM", seed=seed, num_layers=num_layers, hidden=hidden,
                 heads=heads, vocab=vocab, max_pos=max_pos, dtype=dtype, rope=rope)
    if mtp_layers:
        spec["mtp_layers"] = mtp_layers
    if rope not in ("yarn", "default"):
        raise ValueError(f"rope={rope!r}: 'yarn' (DeepSeek-V3's) or 'default' (plain RoPE)")
    rope_parameters = dict(DEEPSEEK_V3_YARN) if rope == "yarn" else {"rope_type": "default", "rope_theta": 10000.0}
    # YaRN's context is its original one times its factor, as in DeepSeek-V3's config (engines pass
    # --max-model-len to keep their KV cache small).
    positions = DEEPSEEK_V3_YARN["original_max_position_embeddings"] * DEEPSEEK_V3_YARN["factor"] \
        if rope == "yarn" else max_pos

    def write(tmp: Path) -> None:
        import torch
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        # The MTP layers are built as extra decoder layers of the same model (same initialisation), then declared
        # as MTP layers in config.json.
        config = DeepseekV3Config(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
            num_hidden_layers=num_layers + mtp_layers, first_k_dense_replace=num_layers + mtp_layers,
            num_attention_heads=heads,
            num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
            v_head_dim=64, max_position_embeddings=int(positions), rope_parameters=rope_parameters,
            bos_token_id=BOS_ID, eos_token_id=EOS_ID,
            pad_token_id=PAD_ID, initializer_range=hidden**-0.5, tie_word_embeddings=False,
        )
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                elif "embed_tokens" in name:
                    p.normal_(0.0, 1.0)
                elif "lm_head" in name:
                    p.mul_(3.0)
                elif "kv_a_proj" in name or "q_proj" in name:
                    p.mul_(2.0)  # sharper attention: the answer depends on which tokens are attended
        if mtp_layers:
            with torch.no_grad():
                embed = model.model.embed_tokens.weight
                embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt())  # unit RMS: enorm leaves them as they are
                first = model.model.layers[0].state_dict()
                for layer in model.model.layers[num_layers:]:
                    layer.load_state_dict(first)
            model.config.num_hidden_layers = num_layers
            model.config.num_nextn_predict_layers = mtp_layers
        save_transformers_model(model, tmp, dtype, vocab, max_pos)
        if mtp_layers:
            _add_mtp_weights(tmp, model, num_layers, mtp_layers, hidden, dtype)

    return build_model_dir(Path(path), spec, write)


def _add_mtp_weights(directory: Path, model: object, num_layers: int, mtp_layers: int, hidden: int,
                     dtype: str) -> None:
    """The per-MTP-layer tensors a DeepSeek-V3 checkpoint holds besides the decoder layer: input and hidden norms,
    the projection of their concatenation, the shared head (norm + its own lm_head copy) and an embedding copy."""
    import torch
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    out = getattr(torch, dtype)
    embed = model.model.embed_tokens.weight.detach()
    head = model.lm_head.weight.detach()
    for layer in range(num_layers, num_layers + mtp_layers):
        prefix = f"model.layers.{layer}."
        eh_proj = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)  # the next token's embedding
        tensors.update({
            prefix + "enorm.weight": torch.ones(hidden),
            prefix + "hnorm.weight": torch.ones(hidden),
            prefix + "eh_proj.weight": eh_proj,
            prefix + "shared_head.norm.weight": torch.ones(hidden),
            prefix + "shared_head.head.weight": head.clone(),
            prefix + "embed_tokens.weight": embed.clone(),
        })
    save_file({name: t.to(out).contiguous() for name, t in tensors.items()}, str(path), metadata={"format": "pt"})
