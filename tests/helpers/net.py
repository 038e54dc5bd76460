"""Ports for the servers a test starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A 127.0.0.1 TCP port that was free a moment ago (a caller that starts a server on it
    retries, or lets the server pick with port 0, where another process may take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
