"""In a real engine process the kernel can tell the connector's threads apart: Mooncake's threads are
``kvp2p-mooncake``, P's side channel ``kvp2p-side`` (vllm_kvp2p/os_threads.py), not the process's name.

It runs in a fresh interpreter, as an engine process starts: Mooncake starts its threads when its module is
imported and at its first engine's initialize (later engines of a process reuse them, and on Mooncake 0.3.11 start
none), and this suite's other tests have imported it and made engines long before."""

from __future__ import annotations

import json
import subprocess
import sys

from vllm_kvp2p import os_threads

PROBE = """
import json, threading, time
from collections import Counter
from pathlib import Path

def names():
    return Counter(p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm"))

before = names()
from vllm_kvp2p import os_threads
from vllm_kvp2p.contract.protocol import ErrorReply
from vllm_kvp2p.contract.side_channel import SideChannelServer
from vllm_kvp2p.testing.server import free_port
from vllm_kvp2p.transfer.engine import MooncakeEngine

engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=5)
server = SideChannelServer("127.0.0.1", free_port(), lambda request: ErrorReply("no"))
# Threads that name themselves as they start, after Linux gave them ours: the side channel's, and libzmq's reaper
# and I/O threads (a snapshot taken before ZMQbg/Reaper had named itself once counted it under ours, on vLLM 0.23's
# CI run of e1bd2de).
SELF_NAMED = ("kvp2p-side", "ZMQbg/Reaper", "ZMQbg/IO/0")
deadline = time.monotonic() + 5
while any((names() - before)[name] < 1 for name in SELF_NAMED) and time.monotonic() < deadline:
    time.sleep(0.01)
mine = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
print(json.dumps({"added": names() - before, "mine": mine, "current": os_threads.current_name()}))
server.close()
engine.close()
"""


def test_mooncake_and_the_side_channel_threads_carry_their_names() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    added, mine = seen["added"], seen["mine"]
    assert added.get(os_threads.MOONCAKE, 0) >= 1, added  # Mooncake's threads started under the name
    assert added.get(os_threads.SIDE_CHANNEL, 0) == 1, added
    assert seen["current"] == mine not in (os_threads.MOONCAKE, ""), seen  # the caller got its own name back
    # The control: without os_threads every thread Mooncake starts would carry the caller's name (Linux's
    # inheritance); none does.
    assert added.get(mine, 0) == 0, added
