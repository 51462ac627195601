"""A TCP port for a rendezvous, chosen where no outgoing connection can take it. Stdlib only;
`python del_megatron/cpu/ports.py` prints one (shell scripts use it without importing the package).

Port 0 hands out a port from the kernel's ephemeral range, the range it also takes the local port
of every outgoing connection from. Between choosing a port and torchrun binding it (seconds later
when a container starts), a gloo connection elsewhere on the machine can take it: `EADDRINUSE`,
seen in CI while the image test ran beside gloo tests. Ports below that range are only ever taken
by a bind.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# Linux's default ephemeral range; used where the file above does not exist.
DEFAULT_EPHEMERAL = (32768, 60999)
LOWEST_PORT = 15000  # above the registered services that machines commonly run
TRIES = 200


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """(low, high) of the ports the kernel hands out for port 0 and outgoing connections."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def candidate_ports(ephemeral: tuple[int, int]) -> range:
    """Ports outside the ephemeral range: below it, or above it where below is too narrow."""
    low, high = ephemeral
    if low - LOWEST_PORT >= 1000:
        return range(LOWEST_PORT, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    return range(0, 0)


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, outside the kernel's ephemeral range (see the module doc).

    Falls back to a port of the kernel's choosing where no such range is wide enough.
    """
    ports = candidate_ports(ephemeral_range())
    # Its own generator: callers seed the global one (the same sequence in every process).
    rng = random.Random()
    for _ in range(TRIES if ports else 0):
        port = rng.choice(ports)
        if _bindable(port, host):
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    print(free_port())
