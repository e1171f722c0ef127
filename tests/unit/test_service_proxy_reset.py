"""The process kubelet's Service proxy (tests/support/service_proxy.py) passes a reset on: through kube-proxy's NAT a
client sees its server's reset, so a client whose gateway resets the connection (a controller stopping for an upgrade
with a request just sent) must not wait on the proxy's other half for an answer that cannot come."""

import asyncio
import socket
import struct

from tests.support.service_proxy import _pipe


async def _through_proxy_to_a_resetting_server() -> bytes | BaseException:
    async def resetting_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(5)  # a request arrived, then the server goes away without answering
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        writer.transport.abort()

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            for end in (writer, upstream_writer):
                end.close()

    upstream = await asyncio.start_server(resetting_server, "127.0.0.1", 0)
    upstream_port = upstream.sockets[0].getsockname()[1]
    front = await asyncio.start_server(proxy, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", front.sockets[0].getsockname()[1])
    writer.write(b"POST /")
    await writer.drain()
    try:
        # the bound only keeps a broken proxy from hanging the suite: a reset on loopback arrives in milliseconds
        return await asyncio.wait_for(reader.read(), 20)
    except (ConnectionError, TimeoutError) as exc:
        return exc
    finally:
        writer.close()
        for server in (front, upstream):
            server.close()


def test_a_reset_from_the_server_ends_the_clients_connection() -> None:
    outcome = asyncio.run(_through_proxy_to_a_resetting_server())
    assert not isinstance(outcome, TimeoutError), "the client was left waiting after its server reset"
    assert outcome == b"" or isinstance(outcome, ConnectionResetError)
