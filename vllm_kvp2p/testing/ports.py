"""TCP ports for the servers tests and demos start: free a moment ago, and never handed out twice by one process.

Only the standard library.
"""

from __future__ import annotations

import random
import socket

# Ports handed to tests are drawn from below the kernel's ephemeral range (where outgoing connections, Mooncake's
# and ZMQ's included, take their source ports) and above Mooncake's own RPC range [15000, 17000]: a port picked
# from the ephemeral range (bind to 0) could be taken by some connection's source port before the server binds it.
_LOWEST_PORT = 20000
# Every port handed out by this process, never handed out again: a port is only probed free, not held, so two
# picks made before either server binds could otherwise name the same port (CI once gave P's HTTP port to its
# side channel too, and P never answered /health).
_handed_out: set[int] = set()


def _port_range() -> tuple[int, int]:
    high = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
        if ephemeral_low > _LOWEST_PORT + 1000:
            high = ephemeral_low
    except (OSError, ValueError, IndexError):
        pass
    return _LOWEST_PORT, high


def free_port_run(n: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port ``base`` such that ``base .. base + n - 1`` were all free a moment ago (a P instance's side-channel
    ports: rank r listens on base + r)."""
    low, high = _port_range()
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(low, high - n)
        if _handed_out.intersection(range(base, base + n)):
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, port))
            _handed_out.update(range(base, base + n))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found in [{low}, {high}) after {attempts} attempts")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, outside the ephemeral range."""
    return free_port_run(1, host)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago."""
    ports: set[int] = set()
    for _ in range(100 * n):
        ports.add(free_port_run(1, host))
        if len(ports) == n:
            return sorted(ports)
    raise RuntimeError(f"could not find {n} distinct free ports")
