"""P's incarnation and the model fingerprint (vllm_kvp2p/contract/identity.py), from config objects shaped as vLLM's."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_kvp2p.contract.identity import incarnation, model_fingerprint


def vllm_config(instance_id: str = "1764600000000000000", **text: object) -> SimpleNamespace:
    hf = SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         rope_theta=10000.0, _name_or_path="/models/a", torch_dtype="float32", **text)
    return SimpleNamespace(instance_id=instance_id, model_config=SimpleNamespace(hf_config=hf, hf_text_config=hf))


def test_every_process_of_an_instance_agrees_and_each_start_differs() -> None:
    assert incarnation(vllm_config(), "P") == incarnation(vllm_config(), "P")
    assert incarnation(vllm_config(), "P") != incarnation(vllm_config("1764600000000000001"), "P")  # a restart
    assert incarnation(vllm_config(), "P") != incarnation(vllm_config(), "Q")
    assert len(incarnation(vllm_config(), "P")) == 16


def test_the_fingerprint_tells_models_with_the_same_kv_geometry_apart() -> None:
    base = model_fingerprint(vllm_config())
    assert model_fingerprint(vllm_config()) == base
    # Same KV geometry (layers, heads, head size), another model: K holds other values.
    assert model_fingerprint(vllm_config(rope_scaling={"type": "yarn", "factor": 4.0})) != base
    hf = vllm_config().model_config.hf_config
    hf.rope_theta = 500000.0
    assert model_fingerprint(SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, hf_text_config=hf))) != base
    # What may differ between a P and a D serving the same model does not count.
    other = vllm_config()
    other.model_config.hf_config._name_or_path = "/mnt/other/copy"
    other.model_config.hf_config.torch_dtype = "bfloat16"
    assert model_fingerprint(other) == base
