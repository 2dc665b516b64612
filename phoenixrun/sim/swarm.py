"""Thousands of simulated node agents in one asyncio process, speaking the real agent's protocol
(phoenixrun/protocol: the same names, status codes and timeouts; it imports nothing of the agent).

Each simulated agent registers, heartbeats (`/v1/heartbeat`, with the same payload fields as
agents/agent.py: worker pids, snapshot and replica inventories, `api`), long-polls its directive
(`/v1/directive`, one dedicated keep-alive connection each, like the real agent's poll thread) and
answers the recovery protocol the way a node whose workers obey at once would: `quiesce` ->
`quiesced` report (inventory, next step), `restore` -> `resumed` report. It runs no workers: the
point is the master's load and latency, not training.

Heartbeats and reports go over shared pools of keep-alive connections, not one connection per agent:
this machine's hard limit of 20000 open files per process cannot hold three connections per agent
at 16K agents on both sides. Requests are pipelined on them (sent at once, answered in order), so an
agent's heartbeat or report is not held up behind another agent's, as with its own connection; the
master sees the same requests at the same times. (With one request in flight per connection, the
16K acks of a recovery phase queued behind each other's round trips: seconds that were the load
generator's, not the master's.)
"""
from __future__ import annotations

import asyncio
import gc
import json
import random
import secrets
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, cast

from phoenixrun.protocol.constants import CLIENT_TIMEOUT_S, DIRECTIVE_POLL_S
from phoenixrun.protocol.directives import Run, decode
from phoenixrun.protocol import reports
from phoenixrun.protocol.names import Command, Endpoint
from phoenixrun.protocol.status import Status
from phoenixrun.protocol.relay import Batch
from phoenixrun.sim.swarm_beats import SwarmBeats
from phoenixrun.sim.swarm_relay import SwarmAcks, SwarmRelays
from phoenixrun.sim.swarm_watch import SwarmWatch
from phoenixrun.topology import Layout, place_replicas


# a request's answer: (HTTP status, body), once its response has been read
Answer = asyncio.Future[tuple[int, bytes]]

FAULTS = ("kill", "silent")       # how Swarm.fail fails a node


@dataclass
class SwarmConfig:
    endpoint: str                 # master host:port
    secret: str
    nnodes: int                   # active nodes the master expects
    nproc_per_node: int
    spares: int = 1
    replicas: int = 1
    heartbeat_s: float = 1.0
    poll_timeout_s: float = DIRECTIVE_POLL_S   # the real agent's directive long-poll timeout
    hb_connections: int = 1024
    report_connections: int = 256
    peer_host: str = "127.0.0.1"
    relay_heartbeats: bool = True     # children heartbeat through their relays when the master says so


@dataclass
class SimAgent:
    index: int
    node_id: str
    peer_addr: str = ""
    role: str = ""
    slot: int | None = None
    version: int = -1
    generation: int = 0
    token: str | None = None      # the master's, from the registration: every later call carries it
    alive: bool = True
    last_heartbeat: float = 0.0   # local time of its last heartbeat the master answered
    # (command, generation) -> local time the directive arrived
    received: dict[tuple[str, int], float] = field(default_factory=dict)
    beat_cache: tuple[Any, bytes, bytes] | None = None   # (what it depends on, relayed prefix, direct request)


class HttpConnection(asyncio.Protocol):
    """A keep-alive HTTP/1.1 client connection; requests may be pipelined (answered in order, as the
    master's server does). Minimal response parsing. Requests sent before it is connected are written
    when it is: like the real agent's client (http.client), it sends its first request as soon as it
    connects, never holding an idle, unauthenticated connection open (the master drops those after
    READ_TIMEOUT_S: a pool opened ahead of use lost its connections that way, issue 32)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiters: deque[Answer] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.answered_at = 0.0     # when the last response was read off the socket (before any task runs)
        self._ahead: list[bytes] = []   # written once connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)   # a TCP connection's
        if self._ahead:
            transport.write(b"".join(self._ahead))
            self._ahead = []

    def connection_lost(self, exc: Exception | None, why: str = "master closed the connection") -> None:
        self.lost = True
        why = f"{why} ({exc!r})" if exc is not None else why
        while self.waiters:
            w = self.waiters.popleft()
            if not w.done():
                w.set_exception(ConnectionError(why))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.waiters:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            i = head.find(b"content-length:")
            n = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None]) if i >= 0 else 0
            if len(self.buf) < end + 4 + n:
                return
            status, body = int(self.buf[9:12]), bytes(self.buf[end + 4:end + 4 + n])
            del self.buf[:end + 4 + n]
            self.answered_at = time.time()
            w = self.waiters.popleft()
            if not w.done():
                w.set_result((status, body))

    def send(self, raw: bytes) -> Answer:
        """Write a request now (or once connected); the future gets (status, body) when its response arrives."""
        fut = asyncio.get_running_loop().create_future()
        if self.lost:
            fut.set_exception(ConnectionError("connection lost"))
            return fut
        self.waiters.append(fut)
        if self.transport is None:
            self._ahead.append(raw)
        else:
            self.transport.write(raw)
        return fut

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        return await self.send(raw)

    def close(self) -> None:
        """Closed on purpose: what waits on it is cancelled (nobody needs to hear of it)."""
        self.lost = True
        while self.waiters:
            self.waiters.popleft().cancel()
        if self.transport:
            self.transport.close()


class Lane:
    """A connection to the master that is dialled when a request needs it and dialled again when the master
    closed it, as the real agent's client redials (protocol/client.py). Requests in flight when it closes fail
    (their callers retry, like the agent's heartbeat and poll threads); later ones go out on a new connection."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.conn: HttpConnection | None = None
        self.dials = 0
        self._closed = False

    def send(self, raw: bytes) -> Answer:
        if self._closed:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(ConnectionError("connection closed"))
            return fut
        if self.conn is None or self.conn.lost:
            conn = self.conn = HttpConnection()
            self.dials += 1
            dial = asyncio.ensure_future(asyncio.get_running_loop().create_connection(lambda: conn, self.host,
                                                                                      self.port))

            def dialled(f: asyncio.Future[Any]) -> None:
                if f.cancelled() or f.exception() is not None:   # refused: fail what waits on it
                    conn.connection_lost(None, f"cannot connect: {'cancelled' if f.cancelled() else f.exception()}")
            dial.add_done_callback(dialled)
        return self.conn.send(raw)

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        return await self.send(raw)

    def send_within(self, raw: bytes, timeout: float = CLIENT_TIMEOUT_S) -> Answer:
        """send, with the agent's client timeout (protocol/client.py): no answer within it, the connection is given
        up - what waits on it fails, the next request dials anew - as the agent's http.client connection is. Without
        it a request on a connection that never completes (a connect the master's full listen queue dropped: the
        client's side looks established, the master's never got it) waited forever, and the agents sharing it never
        heartbeated again (issue 32: 3,758 of 4,097 agents never got the job's start)."""
        fut = self.send(raw)
        conn = self.conn
        if not fut.done():
            handle = asyncio.get_running_loop().call_later(timeout, self._expire, conn, fut)
            fut.add_done_callback(lambda _: handle.cancel())
        return fut

    def _expire(self, conn: HttpConnection | None, fut: Answer) -> None:
        if fut.done() or conn is None or conn.lost:
            return
        conn.lost = True
        if conn.transport is not None:
            conn.transport.abort()
        conn.connection_lost(None, f"no answer within {CLIENT_TIMEOUT_S:g}s")

    @property
    def answered_at(self) -> float:
        return self.conn.answered_at if self.conn else 0.0

    def close(self) -> None:
        self._closed = True
        if self.conn is not None:
            self.conn.close()


class Swarm:
    def __init__(self, cfg: SwarmConfig):
        self.cfg = cfg
        self.host, port = cfg.endpoint.rsplit(":", 1)
        self.port = int(port)
        self.layout = Layout(cfg.nnodes, cfg.nproc_per_node)
        placement = place_replicas(self.layout, min(cfg.replicas, cfg.nnodes - 1))
        self.holds: dict[int, list[int]] = {}          # slot -> ranks whose replica its agent holds
        for rank, holders in placement.items():
            for h in holders:
                self.holds.setdefault(h, []).append(rank)
        n = cfg.nnodes + cfg.spares
        self.agents = [SimAgent(i, f"sim{i:05d}") for i in range(n)]
        self.relays = SwarmRelays(self.agents)        # the directive fan-out (sim/swarm_relay.py)
        self.errors: list[str] = []
        self.acks = SwarmAcks(self.relays, self._send_batch, self._report_directly, self.errors)   # ... and fan-in
        self.watch = SwarmWatch()                     # the ring watch of silent neighbours (sim/swarm_watch.py)
        self.beats = SwarmBeats(self.relays, self._send_beats, self._heard, self.errors,   # ... heartbeats relayed
                                on=cfg.relay_heartbeats)
        self.step = 1
        self.recovering = False       # from the first quiesce to the resume: no step completes (as in a job)
        self.heartbeats_ok = 0
        self.heartbeat_latency: list[float] = []
        self.stalls: list[tuple[float, float]] = []   # (when, seconds): the generator's own loop ran late
        self._stop = asyncio.Event()
        self._report_conns: list[Lane] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._polls: dict[int, Lane] = {}
        self._hb_conns: list[Lane] = []
        self._peer_servers: list[asyncio.AbstractServer] = []
        self._victim_server: dict[int, asyncio.AbstractServer] = {}
        self.arrivals: Counter[tuple[str, int]] = Counter()     # (command, generation) -> agents reached
        self._targets: dict[tuple[str, int], list[tuple[int, asyncio.Future[bool]]]] = {}

    # ------------------------------------------------------------------ wire
    def _raw(self, path: str, payload: dict[str, Any]) -> bytes:
        body = json.dumps(payload).encode()
        return (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.cfg.secret}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body

    def _lane(self) -> Lane:
        return Lane(self.host, self.port)

    # ------------------------------------------------------------------ setup
    async def _peer_listener(self) -> tuple[asyncio.AbstractServer, str]:
        """A port that accepts connections, like an agent's peer server (the master probes it)."""
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()
        srv = await asyncio.start_server(accept, self.cfg.peer_host, 0)
        return srv, f"{self.cfg.peer_host}:{srv.sockets[0].getsockname()[1]}"

    async def register_all(self, concurrency: int = 64) -> None:
        """Register every agent; like a real agent, each starts heartbeating and polling as soon as it
        is registered (call start() first), so early ones are not timed out while the rest join."""
        shared, shared_addr = await self._peer_listener()
        self._peer_servers.append(shared)
        for a in self.agents:
            a.peer_addr = a.peer_addr or shared_addr
        conns = [self._lane() for _ in range(min(concurrency, len(self.agents)))]
        todo = list(self.agents)

        async def worker(conn: Lane) -> None:
            while todo:
                a = todo.pop(0)
                raw = self._raw(Endpoint.REGISTER, {
                    "node_id": a.node_id, "host": self.cfg.peer_host, "agent_pid": 0, "peer_addr": a.peer_addr,
                    "fault_domain": "", "nproc_per_node": self.cfg.nproc_per_node,
                    # as the agent's (agents/agent.py): a retry of a registration whose answer was lost is its own
                    # (without it a retry after a timeout was refused as another process's, for good)
                    "nonce": secrets.token_hex(16)})
                for attempt in range(50):    # like the agent (agents/master_link.py): unreachable, try again
                    try:
                        status, body = await conn.send_within(raw)
                        break
                    except ConnectionError as e:
                        self.errors.append(f"register {a.node_id}: {e}")
                        if attempt == 49:
                            raise
                        await asyncio.sleep(0.2)
                if status != Status.OK:
                    raise RuntimeError(f"register {a.node_id}: HTTP {status} {body[:200]!r}")
                reg = json.loads(body)
                a.role, a.slot, a.token = reg["role"], reg["slot"], reg.get("token")
                self._polls[a.index] = self._lane()
                self._tasks.append(asyncio.create_task(self._poll_loop(a)))
        await asyncio.gather(*(worker(c) for c in conns))
        for c in conns:
            c.close()

    async def give_own_peer_port(self, a: SimAgent) -> None:
        """The victim gets a port of its own (re-registered inventory not needed: the master only
        probes peer_addr), so that failing it makes its address refuse like a killed node's."""
        srv, addr = await self._peer_listener()
        self._victim_server[a.index] = srv
        a.peer_addr = addr

    async def start(self) -> None:
        """Set up the heartbeat and report connections; agents heartbeat once registered."""
        # The cyclic collector off while the swarm runs, its registration included: its full collections (0.2-0.3 s
        # at 16K agents, about once a second) stalled every simulated agent at once, which the master then saw as
        # load bursts and late heartbeats. Stand-ins for separate machines must not share a stop-the-world.
        gc.disable()
        n_hb = max(1, min(self.cfg.hb_connections, len(self.agents)))
        self._hb_conns = [self._lane() for _ in range(n_hb)]
        loop = asyncio.get_running_loop()
        for a in self.agents:   # spread over the period
            loop.call_later(random.random() * self.cfg.heartbeat_s, self._heartbeat, a, self._hb_conns[a.index % n_hb])
        self._report_conns = [self._lane() for _ in range(self.cfg.report_connections)]
        self._tasks.append(asyncio.create_task(self._advance_steps()))
        self._tasks.append(asyncio.create_task(self._watch_own_lag()))
        self._tasks.append(asyncio.create_task(self.watch.run(lambda nid: self.relays.by_id[nid].alive,
                                                              lambda nid, ev: self._report(self.relays.by_id[nid], ev))))

    async def _watch_own_lag(self, period: float = 0.05, note: float = 0.5) -> None:
        """Note when this process itself did not run (a stand-in for thousands of machines on a few cores): a
        stall of the generator stops every simulated agent's heartbeats at once, which the master must see as
        silence - the benchmark reports such stalls rather than blame the master for them."""
        while not self._stop.is_set():
            t0 = time.monotonic()
            await asyncio.sleep(period)
            late = time.monotonic() - t0 - period
            if late > note:
                self.stalls.append((time.time(), round(late, 3)))

    async def stop(self) -> None:
        self._stop.set()
        gc.enable()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for c in [*self._polls.values(), *self._hb_conns, *self._report_conns]:
            c.close()
        for s in [*self._peer_servers, *self._victim_server.values()]:
            s.close()

    # ------------------------------------------------------------------ agent behaviour
    def _inventory(self, a: SimAgent) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """Its snapshots and replicas: rank -> steps."""
        steps = [self.step - 1, self.step]
        if a.slot is None:
            return {}, {}
        return {r: steps for r in self.layout.ranks_of_slot(a.slot)}, {r: steps for r in self.holds.get(a.slot, [])}

    async def _advance_steps(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(1.0)
            if not self.recovering:
                self.step += 1

    def _heartbeat(self, a: SimAgent, conn: Lane) -> None:
        """One heartbeat; like the real agent's heartbeat thread, the next goes one period after its
        reply. Pipelined on a shared connection, so one agent's slow reply does not delay the others'."""
        if self._stop.is_set() or not a.alive:
            return
        loop = asyncio.get_running_loop()
        if not a.role:                    # not registered yet
            loop.call_later(self.cfg.heartbeat_s, self._heartbeat, a, conn)
            return
        prefix, raw = beat_bytes(a, self.step, lambda: self._inventory(a), self.cfg.nproc_per_node, self._raw)
        late = self.beats.hand(a, prefix)
        if late is None:                  # through its relay (sim/swarm_beats.py): the reply comes with a batch's
            loop.call_later(self.cfg.heartbeat_s * random.uniform(0.9, 1.1), self._heartbeat, a, conn)
            return
        if late > 0:                      # its call to a hung relay timed out first
            loop.call_later(late, self._heartbeat_directly, a, conn, raw)
            return
        self._heartbeat_directly(a, conn, raw)

    def _heartbeat_directly(self, a: SimAgent, conn: Lane, raw: bytes) -> None:
        if self._stop.is_set() or not a.alive:
            return
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()

        def done(f: Answer) -> None:
            if f.cancelled() or self._stop.is_set():
                return
            if f.exception() is not None:     # the next one goes out on a new connection, as the agent's would
                self.errors.append(f"heartbeat {a.node_id}: {f.exception()}")
            elif f.result()[0] == Status.OK:
                self.relays.follow(a, f.result()[1])
                self.watch.follow(a.node_id, f.result()[1])
                a.last_heartbeat = time.time()
                self.heartbeats_ok += 1
                self.heartbeat_latency.append(time.monotonic() - t0)
                self.beats.confirmed(a, t0)
                if a.node_id in self.relays.serves:    # a relay: its children's heartbeats, right after its own
                    self.beats.flush(a)
            else:
                self.errors.append(f"heartbeat {a.node_id}: HTTP {f.result()[0]}")
            loop.call_later(self.cfg.heartbeat_s * random.uniform(0.9, 1.1), self._heartbeat, a, conn)
        conn.send_within(raw).add_done_callback(done)

    async def _poll_loop(self, a: SimAgent) -> None:
        conn, relays = self._polls[a.index], self.relays

        def poll() -> Answer:
            payload: dict[str, Any] = {"node_id": a.node_id, "token": a.token, "version": a.version,
                                       "timeout": relays.poll_timeout(a, self.cfg.poll_timeout_s)}
            state = relays.state(a)
            if state is not None:
                payload["relay"] = state
            return conn.send(self._raw(Endpoint.DIRECTIVE, payload))
        pending: Answer | None = None
        while a.alive and not self._stop.is_set():
            relay = relays.relay_of(a) if pending is None else None
            if relay is not None:          # a child polls its relay (in-process: sim/swarm_relay.py)
                got = await relays.next_relayed(a, relay)
                if got is not None and a.alive and got[0].get("version", -1) > a.version:
                    self._act(a, *got)
                continue
            pending = pending or poll()
            try:   # the agent's client gives a poll its timeout + 5 s, then drops the connection and redials
                status, body = await asyncio.wait_for(pending, self.cfg.poll_timeout_s + 5)
            except (ConnectionError, asyncio.TimeoutError) as e:
                if not a.alive:
                    return
                self.errors.append(f"poll {a.node_id}: {e or 'no answer within the poll timeout'}")
                if isinstance(e, asyncio.TimeoutError) and conn.conn is not None and conn.conn.transport:
                    conn.conn.transport.abort()
                status, body = 0, b""
            if status != Status.OK:         # like the agent's poll thread: note it, poll again shortly
                if status:
                    self.errors.append(f"poll {a.node_id}: HTTP {status}")
                await asyncio.sleep(0.2)
                pending = None
                continue
            d, pending = json.loads(body), None
            if not a.alive:
                return
            if d.get("bundle") == 1:
                relays.master_writes += 1
                d = relays.forward(a, d, conn.answered_at)
            elif d.get("version", -1) > a.version:
                relays.master_writes += 1
            if d.get("version", -1) <= a.version:
                continue
            # the next poll goes out before the directive is acted on, as the real agent's poll thread hands
            # the directive to another thread and polls again at once
            if d["command"] != Command.STOP and relays.relay_of(a) is None:
                pending = poll()
            # when the bytes arrived, not when this task got its turn: the swarm's own backlog (it
            # shares the machine's cores with the master) is not the master's broadcast time
            self._act(a, d, conn.answered_at)

    def _act(self, a: SimAgent, d: dict[str, Any], at: float) -> None:
        """Do what the directive says, as a node whose workers obey at once would."""
        order = decode(d)     # as the real agent decodes it (protocol/directives.py)
        a.version = order.version
        cmd, g = order.command, a.generation if order.generation is None else order.generation
        a.received.setdefault((cmd, g), at)
        a.generation = g
        if order.own.slot is not None:
            a.slot = order.own.slot
        if cmd == Command.QUIESCE:
            self.recovering = True
            snapshots, replicas = self._inventory(a)
            self._report(a, reports.Quiesced(node_id=a.node_id, generation=g, slot=a.slot, snapshots=snapshots,
                                             replicas=replicas, next_step=self.step + 1))
        elif cmd == Command.RESTORE:
            self._report(a, reports.Resumed(node_id=a.node_id, generation=g, slot=a.slot))
        elif cmd == Command.RUN:
            a.role = "active"
            if isinstance(order.order, Run) and order.order.resume:
                self.recovering = False
        elif cmd == Command.STOP:
            a.alive = False
        self._arrived((cmd, g))

    def _arrived(self, key: tuple[str, int]) -> None:
        self.arrivals[key] += 1
        waiting = self._targets.get(key)
        if waiting:
            for n, fut in [w for w in waiting if self.arrivals[key] >= w[0]]:
                if not fut.done():
                    fut.set_result(True)
            self._targets[key] = [w for w in waiting if not w[1].done()]

    def _send_beats(self, relay: SimAgent, batch: Batch) -> Answer:
        return self._hb_conns[relay.index % len(self._hb_conns)].send_within(
            self._raw(Endpoint.HEARTBEATS, batch.to_wire()))

    def _heard(self, a: SimAgent, reply: dict[str, Any]) -> None:
        """A child's heartbeat reply, from its relay's batch."""
        self.relays.follow_reply(a, reply)
        self.watch.follow_reply(a.node_id, reply)
        a.last_heartbeat = time.time()
        self.heartbeats_ok += 1

    def _report(self, a: SimAgent, ev: reports.Report) -> None:
        """Send a report now: an ack through the agent's relay (sim/swarm_relay.py), anything else directly."""
        self.acks.report(a, ev)

    def _send_batch(self, relay: SimAgent, batch: Batch) -> Answer:
        return self._report_conns[relay.index % len(self._report_conns)].send_within(
            self._raw(Endpoint.REPORTS, batch.to_wire()))

    def _report_directly(self, a: SimAgent, ev: reports.Report) -> None:
        """Send a report now, as an agent's own connection would (pipelined on a shared one: a slow
        reply must not hold up the reports queued behind it)."""
        conn = self._report_conns[a.index % len(self._report_conns)]

        def done(f: Answer) -> None:
            if f.cancelled() or self._stop.is_set():
                return
            if f.exception() is not None:
                self.errors.append(f"report {ev.kind}: {f.exception()}")
            elif f.result()[0] != Status.OK:
                self.errors.append(f"report {ev.kind}: HTTP {f.result()[0]} {f.result()[1][:100]!r}")
        conn.send_within(self._raw(Endpoint.REPORT, {**ev.to_wire(), "token": a.token})).add_done_callback(done)

    # ------------------------------------------------------------------ control
    async def fail(self, a: SimAgent, fault: str = "kill") -> float:
        """The node fails; no more heartbeats or polls from it. Returns the time.
        kill: its process died - its connection to the master closes and its peer port refuses (the kernel does
        both at a process's death); silent: a hung host - its connections stay open and its port still accepts
        (the kernel completes handshakes), it just never answers again."""
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(FAULTS)}, got {fault!r}")
        a.alive = False
        self.relays.fail(a, fault)
        self.watch.fail(a.node_id)
        if fault == "kill":
            srv = self._victim_server.pop(a.index, None)
            if srv is not None:
                srv.close()
            self._polls[a.index].close()
        return time.time()

    def lane_of(self, a: SimAgent) -> Lane:
        """The agent's own directive-poll connection."""
        return self._polls[a.index]

    async def wait_reached(self, command: str, generation: int, n: int, timeout: float) -> bool:
        """Wait until n agents have received `command` of `generation` (woken by the arrivals)."""
        key = (command, generation)
        if self.arrivals[key] >= n:
            return True
        fut = asyncio.get_running_loop().create_future()
        self._targets.setdefault(key, []).append((n, fut))
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except asyncio.TimeoutError:
            return False


def beat_bytes(a: SimAgent, step: int, inventory: Callable[[], tuple[dict[int, list[int]], dict[int, list[int]]]],
               nproc: int, render: Callable[[str, dict[str, Any]], bytes]) -> tuple[bytes, bytes]:
    """The agent's heartbeat as its relay gets it (without the token, up to its `seq`) and as a direct request,
    built once a step, when what it says changes (one process plays thousands of agents: its time is not the
    master's, and what it spends on building bytes is not spent answering)."""
    key = (step, a.slot, a.token)
    if a.beat_cache is not None and a.beat_cache[0] == key:
        return a.beat_cache[1], a.beat_cache[2]
    snapshots, replicas = inventory()
    # each rank's figures as a real worker's (protocol/figures.py): the master's straggler check and throughput
    # sample read them every heartbeat, so the load must carry them (a step ~1 s here, compute within 5%)
    protection = {r: {"every": 1, "committed_step": step - 1, "step_s": 1.0,
                      "compute_s": round(random.uniform(0.76, 0.84), 4)} for r in snapshots}
    payload = {"node_id": a.node_id, "worker_pids": list(range(nproc)), "snapshots": snapshots, "replicas": replicas,
               "protection": protection, "api": True}
    prefix = json.dumps(payload).encode()[:-1] + b', "seq": '
    raw = render(Endpoint.HEARTBEAT, {**payload, "token": a.token})
    a.beat_cache = (key, prefix, raw)
    return prefix, raw
