"""In a real engine process the kernel can tell the connector's threads apart: Mooncake's transport threads are
``kvp2p-mooncake``, P's side channel ``kvp2p-side`` (vllm_kvp2p/os_threads.py), not the process's name."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

from vllm_kvp2p import os_threads
from vllm_kvp2p.protocol import ErrorReply
from vllm_kvp2p.side_channel import SideChannelServer
from vllm_kvp2p.testing.server import free_port
from vllm_kvp2p.transfer.engine import MooncakeEngine


def _names() -> Counter[str]:
    return Counter(p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm"))


def test_mooncake_and_the_side_channel_threads_carry_their_names() -> None:
    before = _names()
    engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=5)
    server = SideChannelServer("127.0.0.1", free_port(), lambda request: ErrorReply("no"))
    try:
        deadline = time.monotonic() + 5  # the side channel's thread names itself as it starts
        while (added := _names() - before)[os_threads.SIDE_CHANNEL] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert added[os_threads.MOONCAKE] >= 1, added  # Mooncake started its transport's threads under the name
        assert added[os_threads.SIDE_CHANNEL] == 1, added
        mine = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        assert os_threads.current_name() == mine not in (os_threads.MOONCAKE, ""), "the caller got its name back"
        # The control: without os_threads the new threads would all carry the caller's name (Linux's inheritance).
        assert added[mine] == 0, added
    finally:
        server.close()
        engine.close()
