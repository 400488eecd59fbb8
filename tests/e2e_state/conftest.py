"""One real P/D pair serving a tiny Qwen3-Next (three Gated DeltaNet linear-attention layers, one full-attention
layer, MoE), made locally: vLLM's hybrid allocator gives it a state group per linear-attention layer and a
full-attention group. Started once for this package, stopped when it is done.

vLLM's CPU GDN kernels need bfloat16. vLLM raises the attention block size to fit the state pages (288 tokens
here) whatever --block-size says. vLLM 0.23 cannot run the model on CPU at all (its CPU fused-MoE fails at the
first forward pass, no connector involved): there the package is skipped with vLLM's message.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_kvp2p.testing.cluster import kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, VllmServerError, free_port
from vllm_kvp2p.testing.tiny_qwen3_next import make_tiny_qwen3_next

STATE_ARGS = ("--dtype", "bfloat16")
VLLM_023_CPU_MOE_BUG = "Current vLLM config is not set"


class StatePair:
    def __init__(self, model: Path, log_dir: Path) -> None:
        self.prefill = VllmServer(
            model, free_port(), cpus="0", log_path=log_dir / "prefill.log",
            extra_args=(*STATE_ARGS, "--kv-transfer-config", kv_transfer_config("kv_producer")),
            env={"VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port())},
        )
        self.decode = VllmServer(
            model, free_port(), cpus="1", log_path=log_dir / "decode.log",
            extra_args=(*STATE_ARGS, "--kv-transfer-config", kv_transfer_config("kv_consumer", test_hooks=True)),
        )

    def __enter__(self) -> StatePair:
        try:
            self.prefill.start()
            self.decode.start()
            self.prefill.wait_ready()
            self.decode.wait_ready()
        except VllmServerError:
            log = self.prefill.log_path.read_text(errors="replace")
            self.__exit__()
            if VLLM_023_CPU_MOE_BUG in log and "fused_moe" in log:
                pytest.skip(f"this vLLM cannot run MoE models on CPU: {VLLM_023_CPU_MOE_BUG!r} in its fused MoE")
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.decode.stop()
        self.prefill.stop()


@pytest.fixture(scope="package")
def state_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StatePair]:
    model = make_tiny_qwen3_next(tmp_path_factory.mktemp("models") / "tiny-qwen3-next")
    with StatePair(model, tmp_path_factory.mktemp("state-logs")) as pair:
        yield pair
