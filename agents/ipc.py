"""The agent's end of the worker channel: a Unix socket, JSON lines, one connection per worker."""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
from typing import Any, Callable

from phoenixrun.protocol.worker_orders import WorkerOrder

log = logging.getLogger("phoenixrun.agent.ipc")


class WorkerConn:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.local_rank: int | None = None
        self.pid: int | None = None
        self._wlock = threading.Lock()
        self.closed = False

    def send(self, msg: dict[str, Any] | WorkerOrder) -> None:
        """One JSON line; an order (protocol/worker_orders.py) is encoded here, at the edge."""
        data = (json.dumps(msg.to_wire() if isinstance(msg, WorkerOrder) else msg) + "\n").encode()
        with self._wlock:
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True


class WorkerChannelServer:
    def __init__(self, path: str, on_message: Callable[[WorkerConn, dict[str, Any]], None],
                 on_close: Callable[[WorkerConn], None]):
        self.path = path
        if os.path.exists(path):
            os.unlink(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)  # only this user's processes may talk to the agent
        self.sock.listen(64)
        self.on_message, self.on_close = on_message, on_close
        threading.Thread(target=self._accept, daemon=True, name="worker-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(WorkerConn(s),), daemon=True).start()

    def _serve(self, conn: WorkerConn) -> None:
        f = conn.sock.makefile("rb")
        try:
            for line in f:
                try:
                    msg = json.loads(line)
                except ValueError:
                    log.warning("malformed message from worker pid %s dropped", conn.pid)
                    continue
                self.on_message(conn, msg)
        except OSError:
            pass
        finally:
            conn.closed = True
            self.on_close(conn)

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
