"""A free port for a rendezvous on one machine (--multiprocessing-distributed, the tests)."""

import random
import socket
from pathlib import Path

# The kernel hands the ports of this range to outgoing connections (gloo's between ranks, a
# store client's) and to a bind to port 0: a port found free there and let go can become
# another process's connection before the rendezvous binds it, a race that jobs starting side
# by side on one machine (the tests, two at a time) make likelier. Above the range (Linux's
# ends at 60999), only a process that asks for that very port takes it; below it lie the ports
# SLURM jobs derive from their ids (slurm.py).
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_END = 60999  # where there is no such file
TRIES = 64


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, drawn at random above the ephemeral range (the
    kernel's pick within it if the range reaches 65535 or none of TRIES draws is free).
    Another process may still bind it first; drawn at random, two launches rarely draw the
    same one."""
    above = range(_ephemeral_end() + 1, 65536)
    # Not the `random` module's generator: --seed seeds it, and two runs seeded alike would
    # draw the same ports.
    draw = random.SystemRandom()
    for _ in range(TRIES if above else 0):
        port = draw.choice(above)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or not ours to bind
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_end() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return LINUX_EPHEMERAL_END
