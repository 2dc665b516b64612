"""The load generator's connections (phoenixrun/sim/swarm.py `Lane`) behave as the real agent's client does: the
first request goes out as the connection opens (never an idle connection the master would drop as a stranger), and
a connection the master closed is dialled again for the next request (issue 32: the generator's pools were opened
ahead of use, dropped by the master's read timeout, and never reopened)."""
import asyncio

from phoenixrun.sim.swarm import Lane

REPLY = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def test_a_lane_sends_on_connect_and_redials_after_the_server_closes_it():
    async def main() -> None:
        accepted: list[bytes] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(await reader.readuntil(b"\r\n\r\n"))   # the request is there as soon as it connects
            writer.write(REPLY)
            await writer.drain()
            writer.close()                                        # then the server drops the connection

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        lane = Lane("127.0.0.1", srv.sockets[0].getsockname()[1])
        try:
            assert lane.conn is None                               # nothing opened ahead of use
            assert await lane.request(b"GET /a HTTP/1.1\r\n\r\n") == (200, b"ok")
            for _ in range(100):                                   # until the client has seen the close
                if lane.conn.lost:
                    break
                await asyncio.sleep(0.01)
            assert lane.conn.lost
            assert await lane.request(b"GET /b HTTP/1.1\r\n\r\n") == (200, b"ok")
            assert lane.dials == 2 and [r.split(b" ")[1] for r in accepted] == [b"/a", b"/b"]
        finally:
            lane.close()
            srv.close()

    asyncio.run(main())


def test_a_refused_dial_fails_its_request_and_the_next_one_dials_again():
    async def main() -> None:
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        lane = Lane("127.0.0.1", port)
        for _ in range(2):
            try:
                await lane.request(b"GET / HTTP/1.1\r\n\r\n")
                raise AssertionError("a closed port answered")
            except ConnectionError as e:
                assert "cannot connect" in str(e)
        assert lane.dials == 2

    asyncio.run(main())
