"""``vllm:kvp2p_pairing_info`` across two models on real engines (issue 46 item 5): the tiny DeepSeek-V3 (MLA)
pair and the shared tiny-Llama deployment export keys the proxy's decision refuses to pair across, naming the
model fingerprint and both values, while within each model it pairs them, a P at another TP size included (the
latent cache is replicated: tp_mapping.py)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.e2e.test_pairing_info import pairing_key
from tests.e2e_mla.conftest import MlaPair
from vllm_kvp2p.proxy.pairing import mismatch
from vllm_kvp2p.testing.cluster import PDCluster
from vllm_kvp2p.testing.server import VllmServer
from vllm_kvp2p.testing.tiny_deepseek import MLA_BLOCK_SIZE

pytestmark = pytest.mark.e2e


def test_engines_of_two_models_never_pair_and_those_of_one_do(mla_pair: MlaPair, cluster: PDCluster,
                                                              mla_prefill_tp2: VllmServer) -> None:
    mla_p, mla_d = pairing_key(mla_pair.prefill), pairing_key(mla_pair.decode)
    llama_p, llama_d = pairing_key(cluster.prefill), pairing_key(cluster.decode)
    assert (mla_p.use_mla, mla_p.block_size, mla_p.kv_cache_dtype) == (True, MLA_BLOCK_SIZE, "float32")
    assert mismatch(mla_p, mla_d) is None and mismatch(llama_p, llama_d) is None
    for p, d in ((llama_p, mla_d), (mla_p, llama_d)):
        reason = mismatch(p, d)
        assert reason == (f"model fingerprint: P {p.model_fingerprint}, D {d.model_fingerprint} (the same model on "
                          "both, vllm_kvp2p/contract/identity.py)"), reason
    tp2 = pairing_key(mla_prefill_tp2)
    assert tp2.tp_size == 2 and dataclasses.replace(tp2, tp_size=1) == mla_p
    assert mismatch(tp2, mla_d) is None  # another TP size is handled by design
