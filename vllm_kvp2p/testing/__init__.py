"""Helpers for end-to-end tests against real vLLM engines (CPU).

* :mod:`vllm_kvp2p.testing.tiny_model` -- ``make_tiny_llama(path)`` writes a tiny, deterministic Llama model
  directory (config, locally trained tokenizer with chat template, seeded random weights) that vLLM loads like any
  checkpoint.
* :mod:`vllm_kvp2p.testing.server` -- ``VllmServer`` launches/stops ``vllm`` OpenAI servers in their own process
  group; ``free_port()``.

Nothing heavy is imported here or at module import time of the submodules (torch, safetensors and tokenizers are
imported inside ``make_tiny_llama``).
"""
