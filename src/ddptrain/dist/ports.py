"""A free port for a rendezvous on one machine (--multiprocessing-distributed, the tests)."""

import random
import socket
from pathlib import Path

# The kernel hands the ports of this range to outgoing connections (gloo's between ranks, a
# store client's) and to a bind to port 0: a port found free there and let go can become
# another process's connection before the rendezvous binds it, which two jobs starting on one
# machine made happen. Below the range, only a process that asks for that very port takes it.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_START = 32768  # where there is no such file (macOS starts higher, at 49152)
SPAN = 10_000  # ports drawn from, just below the range
TRIES = 64


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, drawn at random just below the ephemeral range (the
    kernel's pick within it if none of TRIES draws is free). Another process may still bind
    it first; drawn at random, two launches rarely draw the same one."""
    start = _ephemeral_start()
    # Not the `random` module's generator: --seed seeds it, and two runs seeded alike would
    # draw the same ports.
    draw = random.SystemRandom()
    for _ in range(TRIES):
        port = draw.randrange(max(1024, start - SPAN), start)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or not ours to bind
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_EPHEMERAL_START
