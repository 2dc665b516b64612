"""Agent-to-agent transport for snapshot replication and restore (TCP, framed, authenticated).

Each frame: 4-byte big-endian length + JSON header, then `nbytes` raw payload bytes.
Every request carries the job secret. Sockets have connect and I/O deadlines plus TCP
keepalive / TCP_USER_TIMEOUT so a dead or hung peer becomes an error in seconds, never a hang
(a killed peer fails fast; a crashed host sends no reset: docs/api.md, "Replication transport").

The server checks the secret in a frame's header before it reads (or allocates) the payload the header
announces: measured on main at 73f19fc, three unauthenticated connections announcing 1 GiB took an agent
from 41 MB to 3.2 GB. Before a connection has authenticated it may send at most MAX_HEADER bytes, must
send them within AUTH_TIMEOUT_S of the accept (in all, however slowly they trickle in), and at most
MAX_UNAUTHENTICATED such connections are served at once. When that room is full a new connection takes the place
of the oldest idle one (protocol/admission.py): 64 idle strangers used to close the spare's restore connection at
accept and fail the job (issue 31 item 3); the job's own peers send their frame at once and always get in.
Refusals and evictions are logged at most once per interval, with a count (76,115 lines in 45 s before).
Payload sizes are capped per operation (`max_payload`): only `put` carries one.
"""
from __future__ import annotations

import hmac
import json
import logging
import select
import socket
import struct
import threading
import time
from typing import Any, Callable

from phoenixrun.protocol.admission import Throttle, pick_eviction
from phoenixrun.protocol.peer_requests import PeerRequest
from phoenixrun.protocol.relay import BEAT_OP, MAX_RELAYED_REPORT, REPORT_OP
from phoenixrun.slot_format import checksum
from phoenixrun.testing import pause_point

log = logging.getLogger("phoenixrun.agent.peer")
_LEN = struct.Struct("!I")
Payload = bytes | bytearray | memoryview   # what a frame carries after its header
Address = Any   # a connected peer's address as socket.accept returns it (typeshed: Any; only logged)
CHUNK = 4 << 20
MAX_HEADER = 64 * 1024          # a frame's JSON header: an op, a rank, a step, a checksum - a few hundred bytes
MAX_UNAUTHENTICATED = 64        # connections served at once that have not sent an authenticated frame yet
AUTH_TIMEOUT_S = 3.0            # to send the first frame's header, from the accept (or the I/O timeout, if shorter)


class PeerError(Exception):
    pass


class PeerBusy(PeerError):
    """The peer refused the request for a passing reason (its handler raised an exception marked `retry_later`,
    e.g. its replicas are frozen while a recovery reads them): the same request may succeed shortly."""


def _tune(sock: socket.socket, io_timeout: float) -> None:
    sock.settimeout(io_timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(io_timeout * 1000))


def _recv_exact(sock: socket.socket, n: int, buf: bytearray | None = None) -> bytearray:
    """n bytes from the socket, into `buf` (exactly n long) if given, else into a new buffer."""
    buf = bytearray(n) if buf is None else buf
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(CHUNK, n - got))
        if k == 0:
            raise PeerError("peer closed the connection")
        got += k
    return buf


def send_frame(sock: socket.socket, header: dict[str, Any], payload: Payload = b"") -> None:
    h = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(h)) + h)
    mv = memoryview(payload)
    for off in range(0, len(mv), CHUNK):
        sock.sendall(mv[off:off + CHUNK])


def recv_header(sock: socket.socket, io_timeout: float | None = None) -> dict[str, Any]:
    """A frame's header (its payload not read). io_timeout: the deadline once the frame's first bytes
    are in (the wait for them is the socket's own timeout)."""
    first = _recv_exact(sock, _LEN.size)
    if io_timeout is not None:
        sock.settimeout(io_timeout)
    (n,) = _LEN.unpack(first)
    if n > MAX_HEADER:
        raise PeerError(f"frame header too large ({n} bytes, at most {MAX_HEADER})")
    header = json.loads(_recv_exact(sock, n))
    if not isinstance(header, dict):
        raise PeerError("malformed frame header")
    return header


def payload_size(header: dict[str, Any], limit: int | None) -> int:
    """The payload length a header announces, checked against limit (None: no limit)."""
    n = header.get("nbytes", 0) or 0
    if type(n) is not int or n < 0:
        raise PeerError(f"bad payload length {n!r}")
    if limit is not None and n > limit:
        raise PeerError(f"payload of {n} bytes for {header.get('op')!r} is over its limit of {limit} bytes")
    return n


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    header = recv_header(sock)
    n = payload_size(header, None)
    return header, _recv_exact(sock, n) if n else bytearray()


Handler = Callable[[dict[str, Any], bytearray], tuple[dict[str, Any], bytes]]
# where an authenticated request's payload of n bytes is received: a buffer of exactly n bytes, or None for a new
# one (replicas go straight into the buffer the store keeps them in: ReplicaStore.receive_buffer)
Sink = Callable[[dict[str, Any], int], "bytearray | None"]


class _Waiting:
    """A connection that has not authenticated yet: when it was accepted, and whether its server thread holds
    bytes of it that it has not finished checking (then it is not idle, whatever the socket shows)."""
    __slots__ = ("opened_at", "busy")

    def __init__(self, opened_at: float):
        self.opened_at = opened_at
        self.busy = False


def _unread(sock: socket.socket) -> bool:
    """Bytes (or the peer's close) wait in the kernel for this socket. Never blocks."""
    try:
        p = select.poll()
        p.register(sock, select.POLLIN)
        return bool(p.poll(0))
    except (OSError, ValueError):   # closed meanwhile: nothing to keep it for
        return False


class PeerServer:
    """Accepts other agents' requests; `handlers` maps op -> fn(header, payload) -> (reply, payload).
    max_payload(op) -> the most payload bytes an authenticated request of that op may carry (None: no limit);
    by default only `put` carries a payload, and a relayed ack or heartbeat (REPORT_OP, BEAT_OP) one of up to
    MAX_RELAYED_REPORT.
    sinks: op -> where its payload is received (default: a new buffer)."""

    def __init__(self, host: str, secret: str, handlers: dict[str, Handler], io_timeout: float = 10.0,
                 max_payload: Callable[[str], int | None] | None = None, sinks: dict[str, Sink] | None = None):
        self.secret = secret
        self.handlers = handlers
        self.sinks = sinks or {}
        self.io_timeout = io_timeout
        self.auth_timeout = min(io_timeout, AUTH_TIMEOUT_S)
        self.max_payload = max_payload or (lambda op: None if op == "put" else
                                           MAX_RELAYED_REPORT if op in (REPORT_OP, BEAT_OP) else 0)
        # unauthenticated connections, in the order they were accepted (guarded by _open_lock)
        self._waiting: dict[socket.socket, _Waiting] = {}
        self.refused = Throttle()      # new connections closed at accept: the room was full of busy ones
        self.evicted = Throttle()      # idle unauthenticated connections closed to make room
        self.rejected = Throttle()     # requests with a wrong or missing secret
        self.sock = socket.create_server((host, 0), backlog=128)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.addr = f"{host}:{self.port}"
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self._listen(self.sock)

    def _listen(self, sock: socket.socket) -> None:
        threading.Thread(target=self._accept, args=(sock,), daemon=True, name="peer-accept").start()

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, peer = sock.accept()
            except OSError:
                return
            if not self._admit(conn, peer):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _admit(self, conn: socket.socket, peer: Address) -> bool:
        """Make room for a new connection among the unauthenticated ones (closing the oldest idle one if the room
        is full); False: none could be closed, refuse it."""
        now = time.monotonic()
        with self._open_lock:
            if len(self._waiting) >= MAX_UNAUTHENTICATED:
                victim = pick_eviction(((c, w.opened_at, w.busy) for c, w in self._waiting.items()), now,
                                       unread=_unread)
                if victim is None:
                    held = self.refused.note(now)
                    if held is not None:
                        log.warning("refused a connection from %s: %d connections already waiting to authenticate, "
                                    "none of them idle (%d more refused since the last such line; one line per %gs)",
                                    peer[0], MAX_UNAUTHENTICATED, held, self.refused.interval)
                    return False
                del self._waiting[victim]
                try:    # its thread wakes, finds the connection gone and closes it
                    victim.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                held = self.evicted.note(now)
                if held is not None:
                    log.warning("closed an idle unauthenticated connection to make room for one from %s: %d were "
                                "waiting to authenticate (%d more closed since the last such line; one line per %gs)",
                                peer[0], MAX_UNAUTHENTICATED, held, self.evicted.interval)
            self._waiting[conn] = _Waiting(now)
        return True

    def suspend(self) -> None:
        """Partition drill: stop listening (connects fail) and drop every open connection."""
        try:   # close() alone leaves a blocked accept() holding the socket in LISTEN; shutdown wakes it
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._open_lock:
            for c in list(self._open):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def resume(self) -> None:
        """Listen again on the same address (peers and the master know it)."""
        self.sock = socket.create_server((self.host, self.port), backlog=128)
        self._listen(self.sock)

    def _serve(self, conn: socket.socket, peer: Address) -> None:
        _tune(conn, self.auth_timeout)
        with self._open_lock:
            self._open.add(conn)
            waiting = self._waiting.get(conn)
        try:
            if waiting is not None:   # (None: closed to make room before this thread started)
                self._serve_frames(conn, peer, waiting)
        finally:
            with self._open_lock:     # out of the room before the close: the accept thread polls its socket
                self._open.discard(conn)
                self._waiting.pop(conn, None)
            conn.close()

    def _first_header(self, conn: socket.socket, waiting: _Waiting) -> dict[str, Any]:
        """The first frame's header, all of it within the auth timeout of the accept. `waiting.busy` is set while
        this thread holds bytes it has read but not yet checked (then the connection is not idle)."""
        deadline = waiting.opened_at + self.auth_timeout
        buf, need, header_len = bytearray(), _LEN.size, None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"no authenticated frame within {self.auth_timeout:g}s")
            conn.settimeout(left)
            waiting.busy = False
            chunk = conn.recv(need - len(buf))
            waiting.busy = True
            if not chunk:
                raise PeerError("peer closed the connection")
            buf += chunk
            if len(buf) < need:
                continue
            if header_len is None:
                (header_len,) = _LEN.unpack(buf)
                if header_len > MAX_HEADER:
                    raise PeerError(f"frame header too large ({header_len} bytes, at most {MAX_HEADER})")
                buf, need = bytearray(), header_len
                if need:
                    continue
            header = json.loads(buf)
            if not isinstance(header, dict):
                raise PeerError("malformed frame header")
            return header

    def _serve_frames(self, conn: socket.socket, peer: Address, waiting: _Waiting) -> None:
        authenticated = False
        while True:
            try:
                header = recv_header(conn, self.io_timeout) if authenticated else self._first_header(conn, waiting)
                if not hmac.compare_digest(str(header.get("auth", "")).encode(), self.secret.encode()):
                    held = self.rejected.note(time.monotonic())
                    if held is not None:
                        log.warning("rejected unauthenticated peer request from %s (%d more since the last such "
                                    "line; one line per %gs)", peer[0], held, self.rejected.interval)
                    send_frame(conn, {"ok": False, "error": "unauthorized"})
                    return
                if not authenticated:
                    authenticated = True
                    conn.settimeout(self.io_timeout)
                    with self._open_lock:
                        if self._waiting.pop(conn, None) is None:
                            return    # closed to make room meanwhile (it was not idle: not expected)
                op = header.get("op", "")
                try:
                    n = payload_size(header, self.max_payload(op))
                except PeerError as e:
                    send_frame(conn, {"ok": False, "error": str(e)})
                    return
                payload = _recv_exact(conn, n, self._sink(op, header, n)) if n else bytearray()
                conn.settimeout(None)   # idle persistent connections of job members are fine
            except (PeerError, OSError, ValueError):
                return
            fn = self.handlers.get(op)
            try:
                if fn is None:
                    raise PeerError(f"unknown op {header.get('op')!r}")
                reply, out = fn(header, payload)
                reply = {"ok": True, **reply, "nbytes": len(out), "crc32c": checksum(out, "crc32c")}
            except Exception as e:  # report to the caller, keep serving
                reply, out = {"ok": False, "error": str(e), "busy": bool(getattr(e, "retry_later", False))}, b""
            try:
                send_frame(conn, reply, out)
            except OSError:
                return

    def _sink(self, op: str, header: dict[str, Any], n: int) -> bytearray | None:
        """The buffer the op's sink gives for this payload; None (a new one) if it has none, gives none, gives one
        of another size, or fails on a malformed header (the handler then refuses the request with the reason)."""
        sink = self.sinks.get(op)
        if sink is None:
            return None
        try:
            buf = sink(header, n)
        except Exception:   # noqa: BLE001 - the handler sees the same header and says what is wrong with it
            return None
        return buf if isinstance(buf, bytearray) and len(buf) == n else None

    def close(self) -> None:
        self.sock.close()


class PeerClient:
    """One persistent connection per peer address, re-established on error."""

    def __init__(self, secret: str, connect_timeout: float = 2.0, io_timeout: float = 10.0):
        self.secret = secret
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self._conns: dict[str, socket.socket] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def call(self, addr: str, request: PeerRequest, payload: Payload = b"") -> tuple[dict[str, Any], bytearray]:
        """Send `request` (protocol/peer_requests.py) and its payload; the peer's reply header and payload."""
        header = request.to_header()
        with self._guard:
            lock = self._locks.setdefault(addr, threading.Lock())
        with lock:
            try:
                sock = self._conns.get(addr) or self._connect(addr)
                if header.get("op") == "put":  # tests: die with the transfer half sent
                    half = len(payload) // 2
                    send_frame(sock, {**header, "auth": self.secret, "nbytes": len(payload)}, payload[:half])
                    pause_point("h2h", header.get("step"))
                    sock.sendall(payload[half:])
                else:
                    send_frame(sock, {**header, "auth": self.secret, "nbytes": len(payload)}, payload)
                reply, data = recv_frame(sock)
            except (OSError, PeerError, ValueError) as e:
                self._drop(addr)
                raise PeerError(f"peer {addr}: {e}") from None
        if not reply.get("ok"):
            raise (PeerBusy if reply.get("busy") else PeerError)(f"peer {addr} refused {header.get('op')}: "
                                                                 f"{reply.get('error')}")
        if checksum(data, "crc32c") != reply.get("crc32c"):   # (a peer that sent none is refused too)
            raise PeerError(f"peer {addr}: payload checksum mismatch")
        return reply, data

    def _connect(self, addr: str) -> socket.socket:
        host, port = addr.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=self.connect_timeout)
        _tune(sock, self.io_timeout)
        self._conns[addr] = sock
        return sock

    def drop_all(self) -> None:
        """Close every open connection (partition drill)."""
        for addr in list(self._conns):
            self._drop(addr)

    def interrupt(self, addr: str) -> None:
        """End a call to addr in flight on another thread now (it raises PeerError there): its peer is known to be
        gone or replaced. Any thread."""
        with self._guard:
            sock = self._conns.get(addr)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _drop(self, addr: str) -> None:
        sock = self._conns.pop(addr, None)
        if sock is not None:
            sock.close()
