"""Ports for a rendezvous on one machine, and the one a SLURM job derives from its id."""

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it). Another process may take it before
    it is bound again; for launches on one machine, where that race is rare, it is enough."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
