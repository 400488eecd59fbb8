"""One real P/D pair serving a tiny DeepSeek-V3 (MLA) model, plus a single-instance tiny Llama as a control, on
127.0.0.1; started once for this package, stopped when it is done.

The engines run vLLM's reference CPU MLA backend (``--attention-backend CPU_MLA``): on a host with AMX vLLM would
pick its AMX MLA backend instead, which refuses float32 weights ("expect weight to be bfloat16, float16, ...") and
lays the latent cache out its own way. A vLLM with no CPU MLA backend at all (0.23 raises "MLA is not supported on
CPU." at start-up) is recognised by that capability, before any engine starts, and the package is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_kvp2p.testing.cluster import PDCluster, kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, VllmServerError, free_port, free_port_run
from vllm_kvp2p.testing.tiny_deepseek import MLA_BLOCK_SIZE, make_tiny_deepseek_v3

# --max-model-len: the model's YaRN context is DeepSeek-V3's 163,840 tokens; the tests need far less KV cache.
MLA_ARGS = ("--dtype", "float32", "--block-size", str(MLA_BLOCK_SIZE), "--attention-backend", "CPU_MLA",
            "--max-model-len", "4096")


def _has_cpu_mla() -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return hasattr(AttentionBackendEnum, "CPU_MLA")


class MlaPair:
    def __init__(self, model: Path, log_dir: Path) -> None:
        side_channel = free_port()
        self.prefill = VllmServer(
            model, free_port(), cpus="0", log_path=log_dir / "prefill.log",
            extra_args=(*MLA_ARGS, "--kv-transfer-config", kv_transfer_config("kv_producer")),
            env={"VLLM_KVP2P_SIDE_CHANNEL_PORT": str(side_channel)},
        )
        self.decode = VllmServer(
            model, free_port(), cpus="1", log_path=log_dir / "decode.log",
            extra_args=(*MLA_ARGS, "--kv-transfer-config",
                        kv_transfer_config("kv_consumer", "recompute", test_hooks=True, integrity="full")),
        )

    def __enter__(self) -> MlaPair:
        try:
            self.prefill.start()
            self.decode.start()
            self.prefill.wait_ready()
            self.decode.wait_ready()
        except VllmServerError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.decode.stop()
        self.prefill.stop()


@pytest.fixture(scope="package")
def mla_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlaPair]:
    if not _has_cpu_mla():
        pytest.skip("this vLLM has no CPU MLA backend (AttentionBackendEnum.CPU_MLA)")
    model = make_tiny_deepseek_v3(tmp_path_factory.mktemp("models") / "tiny-deepseek-v3")
    with MlaPair(model, tmp_path_factory.mktemp("mla-logs")) as pair:
        yield pair


@pytest.fixture(scope="package")
def llama_single(mla_pair: MlaPair, cluster: PDCluster) -> VllmServer:
    """The control for the position-consistency check: the same check on the tiny Llama (float32), served by the
    shared deployment's P (a plain request: one instance computes it all)."""
    return cluster.prefill


@pytest.fixture(scope="package")
def mla_prefill_tp2(mla_pair: MlaPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A second P at --tensor-parallel-size 2 (ranks pinned to cores 0 and 1; see tests/e2e_tp/conftest.py) for the
    same D: the latent cache is replicated on every P rank and D reads it from one."""
    side_channel = free_port_run(2)
    server = VllmServer(
        mla_pair.prefill.model_path, free_port(), cpus="0|1",
        log_path=tmp_path_factory.mktemp("mla-tp2-logs") / "prefill-tp2.log",
        extra_args=(*MLA_ARGS, "--kv-transfer-config", kv_transfer_config("kv_producer"),
                    "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
        env={"VLLM_KVP2P_SIDE_CHANNEL_PORT": str(side_channel)},
        ready_timeout=400,
    )
    with server:
        yield server
