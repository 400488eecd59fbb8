"""The connector's threads carry kernel names (what top -H and /proc show), and a thread started inside
``named`` inherits the name: how Mooncake's own threads get theirs."""

from __future__ import annotations

import threading
from pathlib import Path

from vllm_kvp2p import os_threads


def _kernel_name(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_run_named_names_the_thread_for_the_kernel_and_cuts_to_15_bytes() -> None:
    seen: list[str] = []

    def body() -> None:
        seen.append(_kernel_name(threading.get_native_id()))

    for name, expected in ((os_threads.PULL, "kvp2p-pull"), ("a-name-longer-than-fifteen", "a-name-longer-t")):
        t = threading.Thread(target=os_threads.run_named(name, body))
        t.start()
        t.join(5)
        assert seen.pop() == expected
    # The control: a thread Python starts without it has its process's name, as every vLLM thread has.
    plain = threading.Thread(target=body)
    plain.start()
    plain.join(5)
    assert seen.pop() == _kernel_name(threading.main_thread().native_id)


def test_threads_started_inside_named_inherit_it_and_the_caller_gets_its_name_back() -> None:
    before = os_threads.current_name()
    seen: list[str] = []
    with os_threads.named(os_threads.MOONCAKE):
        assert os_threads.current_name() == "kvp2p-mooncake"
        child = threading.Thread(target=lambda: seen.append(_kernel_name(threading.get_native_id())))
        child.start()
        child.join(5)
    assert seen == ["kvp2p-mooncake"]
    assert os_threads.current_name() == before
