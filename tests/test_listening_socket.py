"""The API server's listening socket: its connections send small writes at once, and a port
in use or a host that is no address is said naming the flags, before anything starts."""

from __future__ import annotations

import asyncio
import socket

import pytest

from engine.entrypoints.serve import bound_socket


async def nodelay_of_accepted_connection(sock: socket.socket) -> int:
    """TCP_NODELAY on the server side of one connection accepted the way uvicorn accepts
    (loop.create_server on the given socket)."""
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("socket")
        accepted.set_result(peer.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connection, sock=sock)
    async with server:
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        value = await asyncio.wait_for(accepted, timeout=10)
        writer.close()
    return value


def test_connections_have_nagles_algorithm_off():
    """With Nagle on, a streamed response's first event waited for the client's delayed ACK
    of the headers (~40 ms more time to first token under load)."""
    sock = bound_socket("127.0.0.1", 0)
    sock.listen(8)
    assert sock.proto == socket.IPPROTO_TCP
    assert asyncio.run(nodelay_of_accepted_connection(sock)) == 1


def test_a_port_in_use_and_a_bad_host_name_the_address_and_the_flags():
    taken = bound_socket("127.0.0.1", 0)
    taken.listen(8)
    port = taken.getsockname()[1]
    with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port} \(--host, --port\): "):
        bound_socket("127.0.0.1", port)
    with pytest.raises(OSError, match=r"cannot listen on 999.1.1.1:0 \(--host, --port\): \w"):
        bound_socket("999.1.1.1", 0)
    taken.close()
