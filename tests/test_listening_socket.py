"""The API server's listening socket: its connections send small writes at once."""

from __future__ import annotations

import asyncio
import socket

from engine.entrypoints.serve import listening_socket


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
    sock = listening_socket("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    assert asyncio.run(nodelay_of_accepted_connection(sock)) == 1
