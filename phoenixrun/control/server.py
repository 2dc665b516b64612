"""The master's HTTP transport: one asyncio loop in its own thread, HTTP/1.1 with keep-alive.

Why not http.server: a thread per connection and a blocking long-poll per agent do not hold
16K agents heartbeating at 1 Hz. Here a directive long-poll is a parked request, answered when
the master sets that agent's directive (`wake`) or when the poll's timeout passes; every other
call is a short synchronous handler run on the loop thread (it holds the master's lock only
briefly); the status reads, O(nodes), run in a worker thread so they never stall heartbeats.

Wire protocol: JSON bodies, bearer secret on every request, checked as soon as the request head
is in (401 and the connection closed otherwise: an unauthenticated peer never gets a body read), 400
for malformed bodies and 4xx for invalid messages (protocol/messages.py; nothing of them is applied),
404 for unknown paths: one status per outcome, protocol/status.py. Refusals are counted (control/rejections.py), not logged one event each.

What a peer can make the master hold (measured on main at 73f19fc: 60 unauthenticated connections
sending 16 MiB bodies took it from 233 MB to 1.3 GB): before authentication, at most MAX_HEAD bytes
per connection and at most MAX_UNAUTHENTICATED such connections; when that room is full, a new connection
takes the place of the oldest idle one (protocol/admission.py: 4,097 idle connections locked `phoenixrun
status` and `drain` out, issue 31 item 4), and is closed at once only if none is idle; a request
head or body that does not complete within READ_TIMEOUT_S is dropped (slow senders); authenticated
bodies are at most MAX_BODY (the largest real message, a rejoin or a quiesce ack of a node with many
ranks, is a few KiB). These limits are the protocol's: protocol/constants.py.
"""
from __future__ import annotations

import asyncio
import logging
import random
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, cast

from phoenixrun import auth, netaddr
from phoenixrun.control import metrics, wire
from phoenixrun.control.directives import Ask
from phoenixrun.protocol.admission import Throttle, pick_eviction
from phoenixrun.protocol.constants import (MAX_BODY, MAX_HEAD, MAX_PARKED_POLL_S,
                                           MAX_UNAUTHENTICATED, READ_TIMEOUT_S)
from phoenixrun.protocol.messages import MessageError
from phoenixrun.protocol.names import Command, Endpoint
from phoenixrun.protocol.relay import parse_relay_state
from phoenixrun.protocol.status import REASON_PHRASES, Status

if TYPE_CHECKING:
    from phoenixrun.control.master import Master

log = logging.getLogger("phoenixrun.master")

BACKLOG = 4096                    # thousands of agents connect at once when a job starts
READ_TICK_S = 0.05                # how often the loop notes that it has read what reached it (read_horizon)
WAKE_BATCH = 32768                # directive polls answered per loop iteration (~16 us each, mostly the send)
JSON = "application/json"


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]       # lower-case names
    body: bytes
    keep_alive: bool


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (`pip install 'phoenixrun[fast]'`): about half the CPU per request of the
    stdlib loop, which matters at 16K heartbeats a second; the stdlib loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class RequestError(Exception):
    """The bytes on the wire are not a request we can parse: answer `code` and close."""

    def __init__(self, code: int, msg: str):
        super().__init__(msg)
        self.code = code


@dataclass
class Head:
    method: str
    path: str
    headers: dict[str, str]       # lower-case names
    length: int                   # of the body
    keep_alive: bool


def parse_head(buf: bytearray) -> tuple[Head, int] | None:
    """The request head at the front of buf and its length in bytes, or None if incomplete."""
    end = buf.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
    if end < 0:
        if len(buf) > MAX_HEAD:
            raise RequestError(Status.HEAD_TOO_LARGE, "request head too large")
        return None
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise RequestError(Status.BAD_REQUEST, f"bad request line {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise RequestError(Status.BAD_REQUEST, f"bad header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", ""):
        raise RequestError(Status.BAD_REQUEST, "chunked bodies are not supported: send Content-Length")
    try:
        n = int(headers.get("content-length", "0"))
    except ValueError:
        raise RequestError(Status.BAD_REQUEST, "bad Content-Length") from None
    if n < 0:
        raise RequestError(Status.BAD_REQUEST, "bad Content-Length")
    conn_hdr = headers.get("connection", "").lower()
    keep = "close" not in conn_hdr if parts[2] == "HTTP/1.1" else "keep-alive" in conn_hdr
    return Head(parts[0], parts[1], headers, n, keep), end + 4


def readable(sock: socket.socket) -> bool:
    """Something waits in the kernel for `sock` (bytes, a close, or on a listening socket a connection). Never
    blocks."""
    try:
        p = select.poll()
        p.register(sock.fileno(), select.POLLIN)
        return bool(p.poll(0))
    except (OSError, ValueError):
        return False


def render_response(code: int, body: bytes, ctype: str = JSON, close: bool = False) -> bytes:
    head = (f"HTTP/1.1 {int(code)} {REASON_PHRASES.get(code, 'Error')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n")
    return head.encode("latin-1") + body


class Connection(asyncio.Protocol):
    """One client connection: requests are handled one at a time, in order (no pipelining overlap).
    A request's head is authenticated as soon as it is in; its body is read only after that."""

    def __init__(self, server: ControlServer):
        self.server = server
        self.buf = bytearray()
        self.busy = False              # a request is being handled (or parked): read no further
        self.closed = False
        self.keep_alive = True
        self.authenticated = False     # has sent a request head with the job's secret
        self.head: Head | None = None  # the current request's head, authenticated, its body still coming
        self.head_len = 0
        self.waiting_since: float | None = None   # an incomplete request (or no request yet) since then
        self.opened_at = 0.0
        self.sock: socket.socket | None = None   # the transport's socket (to ask whether bytes of it wait unread)
        self.transport: asyncio.Transport   # set by connection_made, the first call the loop makes
        self.peer = "?"
        self.poll: _Poll | None = None   # its parked directive long-poll
        self.node_id: str | None = None  # the node whose directive polls it carries (authenticated by its token)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)   # a TCP server's: readable, writable
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if peer else "?"
        now = time.monotonic()
        if len(self.server.unauthenticated) >= MAX_UNAUTHENTICATED and not self.server.make_room(self.peer, now):
            self.closed = True
            transport.abort()
            return
        self.sock = sock = transport.get_extra_info("socket")
        if sock is not None:   # a crashed host sends no FIN: let the kernel find dead peers
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.server.connections.add(self)
        self.server.unauthenticated[self] = None
        self.opened_at = self.waiting_since = now

    def unread(self) -> bool:
        """Bytes of this connection (or its close) wait in the kernel, not yet read by the loop. Never blocks."""
        return self.sock is not None and readable(self.sock)

    def evict(self) -> None:
        """Close this unauthenticated connection to make room for a new one."""
        self.closed = True
        self.server.unauthenticated.pop(self, None)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed and self.node_id is not None:   # closed by the agent's side: evidence (detection.py)
            self.server.link_closed(self.node_id)
        self.closed = True
        self.server.connections.discard(self)
        self.server.unauthenticated.pop(self, None)
        self.server.forget(self)
        self.buf = bytearray()         # released now, not when the last reference to the protocol goes
        self.head = None

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.buf += data
        if len(self.buf) > MAX_HEAD + MAX_BODY + 4:
            # a client sending while its request is handled (pipelining) gets no more than one request's room
            self.fail(Status.TOO_LARGE, "too much data sent ahead of the replies", "too_large")
            return
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
        if not self.busy:
            self.next_request()

    def fail(self, code: int, msg: str, reason: str = "malformed") -> None:
        self.server.refuse(self.peer, self.head.path if self.head else "", reason, msg)
        self.transport.write(render_response(code, wire.dumps({"error": msg}), close=True))
        self.closed = True
        self.transport.close()

    def next_request(self) -> None:
        if self.closed:
            return
        try:
            if self.head is None:
                parsed = parse_head(self.buf)
                if parsed is None:
                    return
                head, self.head_len = parsed
                if not auth.check(self.server.master.secret, head.headers.get("authorization")):
                    log.debug("rejected unauthenticated %s %s from %s", head.method, head.path, self.peer)
                    self.head = head
                    self.fail(Status.UNAUTHORIZED, "unauthorized: missing or wrong job secret", "unauthorized")
                    return
                if head.length > MAX_BODY:
                    self.head = head
                    self.fail(Status.TOO_LARGE, f"body too large ({head.length} bytes, at most {MAX_BODY})", "too_large")
                    return
                self.head = head
                if not self.authenticated:
                    self.authenticated = True
                    self.server.unauthenticated.pop(self, None)
        except RequestError as e:
            self.fail(e.code, str(e))
            return
        head, start = self.head, self.head_len
        if len(self.buf) < start + head.length:
            return
        req = Request(head.method, head.path, head.headers, bytes(self.buf[start:start + head.length]),
                      head.keep_alive)
        del self.buf[:start + head.length]
        self.head = None
        self.waiting_since = time.monotonic() if self.buf else None
        self.busy = True
        self.keep_alive = req.keep_alive
        self.server.dispatch(self, req)

    def respond(self, code: int, body: bytes, ctype: str = JSON) -> None:
        self.send_response(render_response(code, body, ctype, close=not self.keep_alive))

    def send_response(self, response: bytes) -> None:
        """Send a rendered response: its Connection header must match self.keep_alive."""
        if self.closed:
            return
        self.transport.write(response)
        self.busy = False
        self.poll = None
        if not self.keep_alive:
            self.transport.close()
        elif self.buf:
            self.next_request()


@dataclass
class _Poll:
    """A parked directive long-poll."""
    conn: Connection
    ask: Ask
    timeout: float
    timer: asyncio.TimerHandle | None = None


class ControlServer:
    """Serves a Master's API. start() binds at once (so errors surface in the caller), then the
    loop runs in a daemon thread; wake() and shutdown() may be called from any thread."""

    def __init__(self, master: Master, host: str, port: int):
        self.master = master
        self.sock = socket.create_server((host, port), backlog=BACKLOG, reuse_port=False)
        self.server_address = self.sock.getsockname()
        self.loop = new_event_loop()
        self.connections: set[Connection] = set()
        self.unauthenticated: dict[Connection, None] = {}   # in the order they were accepted
        self.refused = Throttle()     # connections closed at accept: the room was full and none of it idle
        self.evicted = Throttle()     # idle unauthenticated connections closed to make room
        self._polls: dict[str, list[_Poll]] = {}
        self._to_wake: set[str] = set()
        self._wake_lock = threading.Lock()
        self._wake_scheduled = False
        self._ticks: deque[float] = deque(maxlen=3)   # the loop's latest turns, oldest first (read_horizon)
        self.stopping = False
        self._closed_links: deque[tuple[str, float]] = deque()   # (node id, when): its poll link closed by its side
        self._polled_at: dict[str, float] = {}     # node id -> when its latest directive poll came in
        self._thread = threading.Thread(target=self._run, daemon=True, name="control-server")
        self._started = threading.Event()
        # keyed by the path string (an Endpoint is one): a request's path looks its handler up as it arrived
        self._routes: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            Endpoint.REGISTER: master.register, Endpoint.HEARTBEAT: master.heartbeat, Endpoint.REPORT: master.report,
            Endpoint.REPORTS: master.relayed_reports, Endpoint.HEARTBEATS: master.relayed_heartbeats,
            Endpoint.INJECT: master.inject, Endpoint.DRAIN: master.drain}

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            self.loop.create_server(lambda: Connection(self), sock=self.sock, backlog=BACKLOG))
        self._started.set()
        self.loop.call_later(READ_TIMEOUT_S / 4, self._sweep)
        self._tick()
        self.loop.run_forever()

    def _tick(self) -> None:
        if not self._accept_pending():
            self._ticks.append(time.time())
        self.loop.call_later(READ_TICK_S, self._tick)

    def _accept_pending(self) -> bool:
        """Connections wait in the listen queue, not yet accepted: their first requests (an agent's first heartbeat
        goes out on a new connection) have reached the master but not been read. Never blocks."""
        return readable(self.sock)

    def read_horizon(self) -> float | None:
        """A time before which every request that reached the master has been read and handled (None: not known
        yet). A timer runs only after the loop has polled its sockets at least once since the previous timer, so
        what had arrived by the tick before last has been read by the latest tick (the oldest of three: a poll
        may not take every ready socket in one go); a tick that finds connections waiting to be accepted does not
        count. Behind the clock while the loop is behind: heartbeats waiting in the kernel are the master's delay,
        not the nodes' silence (issue 32: at 4K simulated nodes on a loaded machine ~500 connections waited in
        the listen queue for seconds, and the 190 nodes whose first heartbeats they carried were declared lost at
        once). Any thread may call it; control/detection.py's judged_at bounds how far behind it is believed."""
        ticks = list(self._ticks)
        return ticks[0] if len(ticks) == self._ticks.maxlen else None

    def _sweep(self) -> None:
        """Drop connections that have not completed a request within READ_TIMEOUT_S (slow or idle senders
        holding a half-sent request, or connected without ever authenticating). Only those waiting are
        looked at: a parked long-poll is not waiting, and an idle keep-alive connection holds nothing."""
        now = time.monotonic()
        for c in [c for c in self.connections if c.waiting_since is not None and not c.busy
                  and (c.buf or not c.authenticated) and now - c.waiting_since > READ_TIMEOUT_S]:
            c.fail(Status.READ_TIMEOUT, f"request not completed within {READ_TIMEOUT_S:g}s", "read_timeout")
        self.loop.call_later(READ_TIMEOUT_S / 4, self._sweep)

    def make_room(self, peer: str, now: float) -> bool:
        """The room for unauthenticated connections is full: close its oldest idle one for a connection from `peer`
        (False: none is idle; refuse the new one). Counted as refusals (rejections.py); logged once per interval
        with a count, whatever the number of sources (a per-source limit lets a spread of addresses flood it)."""
        victim = pick_eviction(((c, c.opened_at, False) for c in self.unauthenticated), now,
                               unread=lambda c: c.unread())
        wall = time.time()
        if victim is None:
            self.master.rejections.note(wall, peer, "too_many_connections", "",
                                        f"{MAX_UNAUTHENTICATED} connections already waiting to authenticate")
            held = self.refused.note(now)
            if held is not None:
                log.warning("refused a connection from %s: %d connections already waiting to authenticate, none "
                            "of them idle (%d more refused since the last such line; one line per %gs)",
                            peer, MAX_UNAUTHENTICATED, held, self.refused.interval)
            return False
        victim.evict()
        self.master.rejections.note(wall, victim.peer, "evicted_idle", "",
                                    "an idle unauthenticated connection closed to make room")
        held = self.evicted.note(now)
        if held is not None:
            log.warning("closed an idle unauthenticated connection from %s to make room for one from %s: %d were "
                        "waiting to authenticate (%d more closed since the last such line; one line per %gs)",
                        victim.peer, peer, MAX_UNAUTHENTICATED, held, self.evicted.interval)
        return True

    def refuse(self, peer: str, path: str, reason: str, detail: str) -> None:
        """Count a refused request (one event per peer and reason per interval: control/rejections.py)."""
        if self.master.rejections.note(time.time(), peer, reason, path, detail):
            log.warning("refused %s from %s: %s (%s; counted, one event per peer and reason per %gs)",
                        path or "a connection", peer, detail, reason, self.master.rejections.interval)

    def shutdown(self) -> None:
        self.stopping = True           # the connections closed from here on are the master's doing
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            self.server.close()
            for c in list(self.connections):
                c.transport.close()
            self.loop.stop()
        asyncio.run_coroutine_threadsafe(stop(), self.loop)
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ agents' links (control/detection.py)
    def link_closed(self, node_id: str) -> None:
        if not self.stopping:
            self._closed_links.append((node_id, time.time()))

    def closed_links(self) -> list[tuple[str, float]]:
        """(node id, when) of every agent poll link its side closed since the last call. Any thread."""
        out = []
        while self._closed_links:
            out.append(self._closed_links.popleft())
        return out

    def last_poll(self, node_id: str) -> float:
        """When the node's latest directive poll came in (0: never). Any thread."""
        return self._polled_at.get(node_id, 0.0)

    # ------------------------------------------------------------------ directive long-polls
    def parked_polls(self) -> int:
        """How many directive long-polls are parked now (a read from any thread: a snapshot, not a lock)."""
        return sum(len(v) for v in list(self._polls.values()))

    def wake(self, node_ids: list[str]) -> None:
        """The master set new directives for node_ids: answer their parked polls. Batched: one loop
        callback however many directives a broadcast sets."""
        with self._wake_lock:
            self._to_wake.update(node_ids)
            if self._wake_scheduled:
                return
            self._wake_scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain_wakes)
        except RuntimeError:   # loop closed: the server is shutting down
            pass

    def _drain_wakes(self) -> None:
        # In batches, yielding to the loop in between. A batch holds up the heartbeats queued behind it:
        # 0.25-0.3 s for a broadcast to 16K nodes (measured), far inside the heartbeat timeout.
        with self._wake_lock:
            ids = [self._to_wake.pop() for _ in range(min(WAKE_BATCH, len(self._to_wake)))]
            more = bool(self._to_wake)
            if not ids:    # drained early, from dispatch()
                return
            self._wake_scheduled = more
        polls = [poll for nid in ids for poll in self._polls.pop(nid, ())]
        for poll in polls:
            if poll.timer:
                poll.timer.cancel()
        self._answer_or_park(polls)
        if more:
            self.loop.call_soon(self._drain_wakes)

    def _answer_or_park(self, polls: list[_Poll]) -> None:
        rendered: tuple[bytes, bytes] | None = None   # a broadcast's nodes share one body: render it once
        sent = []
        for poll, d in zip(polls, self.master.answer_polls([poll.ask for poll in polls])):
            if d is not None:
                if not poll.conn.keep_alive:
                    poll.conn.respond(Status.OK, d.body)
                else:
                    if rendered is None or rendered[0] is not d.body:
                        rendered = d.body, render_response(Status.OK, d.body)
                    poll.conn.send_response(rendered[1])
                sent.append(d)
                continue
            if poll.timer is None or poll.timer.cancelled():
                # Answered early by a random part, so that polls parked together (after a broadcast every agent
                # polls again at once) do not all expire together: 16K agents re-polling in one burst every poll
                # period were, each time, 16K requests in the loop's backlog (and a broadcast then in flight
                # missed their parked polls).
                timeout = min(poll.timeout, MAX_PARKED_POLL_S) \
                    * random.uniform(0.5, 1.0)
                poll.timer = self.loop.call_later(max(0.0, timeout), self._expire, poll)
            self._polls.setdefault(poll.ask.node_id, []).append(poll)
            poll.conn.poll = poll
        if sent:
            self.master.directives_sent(sent)

    def _expire(self, poll: _Poll) -> None:
        waiting = self._polls.get(poll.ask.node_id, [])
        if poll in waiting:
            waiting.remove(poll)
            poll.conn.respond(Status.OK, wire.dumps({"version": poll.ask.version, "command": Command.NOOP}))

    def forget(self, conn: Connection) -> None:
        """A connection closed: drop its parked poll, if any."""
        poll = conn.poll
        if poll is None:
            return
        if poll.timer:
            poll.timer.cancel()
        waiting = self._polls.get(poll.ask.node_id, [])
        if poll in waiting:
            waiting.remove(poll)

    # ------------------------------------------------------------------ requests
    def dispatch(self, conn: Connection, req: Request) -> None:
        if self._to_wake:
            # Directives first: a loaded loop reads a whole batch of sockets (thousands of requests)
            # before it gets to a scheduled callback; a broadcast must not wait behind heartbeats.
            self._drain_wakes()
        if req.method == "GET":
            self._get(conn, req.path)
        elif req.method == "POST":
            self._post(conn, req)
        else:
            conn.respond(Status.METHOD_NOT_ALLOWED, b'{"error": "use GET or POST"}')

    def _get(self, conn: Connection, path: str) -> None:
        if path == Endpoint.STATE:
            render, ctype = (lambda: wire.dumps(self.master.state())), JSON
        elif path == Endpoint.METRICS:
            render, ctype = (lambda: metrics.render(self.master.state()).encode()), "text/plain; version=0.0.4"
        else:
            conn.respond(Status.NO_SUCH_ENDPOINT, b'{"error": "no such endpoint"}')
            return
        fut = self.loop.run_in_executor(None, render)
        fut.add_done_callback(lambda f: conn.respond(Status.OK, f.result(), ctype) if not f.exception()
                              else conn.respond(Status.MASTER_ERROR, wire.dumps({"error": str(f.exception())})))

    def _post(self, conn: Connection, req: Request) -> None:
        fn = self._routes.get(req.path)
        if fn is None and req.path != Endpoint.DIRECTIVE:
            conn.respond(Status.NO_SUCH_ENDPOINT, b'{"error": "no such endpoint"}')
            return
        try:
            payload = wire.loads(req.body or b"{}")
            if not isinstance(payload, dict):
                raise ValueError("body must be a JSON object")
            if req.path == Endpoint.REGISTER:
                why = netaddr.loopback_refusal([payload.get("host", ""), netaddr.split_host_port(
                    str(payload.get("peer_addr", "")))[0]], conn.peer)
                if why:
                    log.warning("refused registration of %s: %s", payload.get("node_id"), why)
                    conn.respond(Status.BAD_REQUEST, wire.dumps({"error": why}))
                    return
            if fn is None:
                poll = self.master.poll_intake(payload)
                if poll.node_id in self.master.job.members.nodes:   # a registered node's link (its token checked)
                    conn.node_id, self._polled_at[poll.node_id] = poll.node_id, time.time()
                relay = parse_relay_state(payload["relay"]) if "relay" in payload else None  # relay_tree.py
                timeout = self.master.relays.poll_timeout(poll.node_id, poll.timeout)
                self._answer_or_park([_Poll(conn, Ask(poll.node_id, poll.version, relay), timeout)])
                return
            conn.respond(Status.OK, wire.dumps(fn(payload)))
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            code, reason = (e.code, e.reason) if isinstance(e, MessageError) else (Status.BAD_REQUEST, "malformed")
            log.debug("refused %s from %s: %s", req.path, conn.peer, e)
            if getattr(e, "counted", True):
                self.refuse(conn.peer, req.path, reason, str(e))
            conn.respond(code, wire.dumps({"error": f"refused: {e}", "reason": reason}))
        except Exception as e:   # a bug in a handler: answer, keep serving everyone else
            log.exception("handler for %s failed", req.path)
            conn.respond(Status.MASTER_ERROR, wire.dumps({"error": f"master error: {e}"}))
