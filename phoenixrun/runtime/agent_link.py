"""The worker's end of the channel to its node agent (Unix socket, JSON lines).

A reader thread sorts incoming messages: replies to requests, commit acknowledgements, and
control orders (assign, quiesce, rebuild). A quiesce is acted on immediately from the reader
thread (the training thread may be blocked inside a collective), through `on_quiesce`.
"""
from __future__ import annotations

import itertools
import json
import queue
import socket
import threading
from typing import Any, Callable

from phoenixrun.protocol.names import WorkerOp
from phoenixrun.protocol.worker_messages import Pong, R, Request
from phoenixrun.protocol.worker_orders import (AbortComm, ChannelClosed, ChannelMessage, Committed, CommitFailed, Ping,
                                               PoisonLoss, Quiesce, Slow, WorkerOrder, decode)


class AgentGone(RuntimeError):
    """The node agent closed the channel: this worker cannot be protected or recovered."""


class StateUnavailable(RuntimeError):
    """The agent has not got the state this request needs and will not get it from the fetch under way (the fetch
    failed, or a new recovery began): the master plans again, and this worker waits for its next order."""


class AgentLink:
    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self._wlock = threading.Lock()
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}   # a request's id -> where its reply goes (raw:
        # the request decodes it as the reply type it names)
        self.orders: queue.Queue[WorkerOrder] = queue.Queue()   # assign / rebuild / quiesce, for the training thread
        self.cv = threading.Condition()
        self.committed_step = -1
        self.commit_error: str | None = None
        self.last_commit: Committed | None = None
        self.quiesce_generation = -1                       # highest generation we were told to quiesce for
        self.closed = False
        self.on_quiesce: Callable[[int], None] = lambda g: None
        self.on_abort: Callable[[], None] = lambda: None   # fault drill: make this worker's collectives fail
        # a drain's quiesce (`at_step`): True if the training thread will stop at that step boundary by itself
        self.on_drain: Callable[[int, int], bool] = lambda g, at_step: False
        self.poison_loss = False                           # fault drill: the next observed loss is NaN
        self.slow_factor = 1.0                             # fault drill: each step's compute this many times longer
        self._reader = threading.Thread(target=self._read, daemon=True, name="phoenixrun-agent-link")
        self._reader.start()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout=2.0)
        self.sock.close()

    def send(self, msg: ChannelMessage) -> None:
        """One JSON line; a message (protocol/worker_messages.py) is encoded here, at the edge."""
        self._send_wire(msg.to_wire())

    def _send_wire(self, wire: dict[str, Any]) -> None:
        data = (json.dumps(wire) + "\n").encode()
        with self._wlock:
            try:
                self.sock.sendall(data)
            except OSError as e:
                raise AgentGone(f"lost the node agent: {e}") from None

    def request(self, msg: Request[R], timeout: float = 60.0) -> R:
        """The agent's answer to `msg`, as the reply type the request names; a refusal raises (StateUnavailable
        where the state will not come from the fetch under way, RuntimeError otherwise)."""
        rid = next(self._ids)
        q: queue.Queue[dict[str, Any]] = queue.Queue()
        self._replies[rid] = q
        op = msg.OP.value
        self._send_wire({**msg.to_wire(), "id": rid})
        try:
            raw = q.get(timeout=timeout)
        except queue.Empty:
            raise AgentGone(f"node agent did not answer {op} within {timeout}s") from None
        finally:
            self._replies.pop(rid, None)
        reply = msg.decode_reply(raw)
        if reply.error:
            raise (StateUnavailable if reply.unavailable else RuntimeError)(f"node agent refused {op}: {reply.error}")
        return reply

    def _read(self) -> None:
        f = self.sock.makefile("rb")
        try:
            for line in f:
                msg = json.loads(line)
                if msg.get("op") == WorkerOp.REPLY:       # decoded by its request, as the reply type it names
                    q = self._replies.get(msg.get("id"))
                    if q is not None:
                        q.put(msg)
                    continue
                order = decode(msg)
                if isinstance(order, (Committed, CommitFailed)):
                    with self.cv:
                        if isinstance(order, Committed):
                            self.committed_step = max(self.committed_step, order.step)
                            self.last_commit = order
                        else:
                            self.commit_error = order.error
                        self.cv.notify_all()
                elif isinstance(order, Ping):              # liveness for the agent's hang watchdog
                    self.send(Pong())
                elif isinstance(order, AbortComm):         # `phoenixrun inject --fault comm-timeout|partition`
                    self.on_abort()
                elif isinstance(order, PoisonLoss):        # `phoenixrun inject --fault nan`
                    self.poison_loss = True
                elif isinstance(order, Slow):              # `phoenixrun inject --fault slow:FACTOR`
                    self.slow_factor = float(order.factor)
                elif order is not None:
                    if isinstance(order, Quiesce):
                        g = order.generation
                        if order.at_step is not None and self.on_drain(g, order.at_step):
                            continue                       # stops at the boundary: nothing to interrupt
                        with self.cv:
                            self.quiesce_generation = max(self.quiesce_generation, g)
                            self.cv.notify_all()
                        self.on_quiesce(g)
                    self.orders.put(order)
        except (OSError, ValueError):
            pass
        self.closed = True
        with self.cv:
            self.cv.notify_all()
        self.orders.put(ChannelClosed())
