"""Authenticated JSON-over-HTTP client for the master's control API.

Keep-alive: each calling thread keeps one HTTP/1.1 connection to the master (an agent's heartbeat
and directive poll each reuse theirs), so a 16K-node job does not open 16K connections a second.

A refusal raises ControlError with the answer's status (protocol/status.py): callers decide on the code.
A `gate` (an injected hook, agents/partition.py's drill) can make calls fail as if the network dropped them.

Several endpoints (`HOST:PORT,HOST:PORT`: the active master and its standby, docs/operations.md "A standby
master"): calls go to one of them; a call that cannot reach it moves every thread on to the next (`next_endpoint`),
so the agent finds whichever master acts now. A refusal (a 4xx) never moves it: that master answered.
"""
from __future__ import annotations

import http.client
import json
import threading
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from phoenixrun.protocol.constants import CLIENT_TIMEOUT_S
from phoenixrun.protocol.status import Status, refused

# None while calls may go out, else why they cannot (checked before a call and again after its answer: a cut
# that began while the call was in flight loses the reply, as a real partition would)
Gate = Callable[[], "str | None"]


class ControlError(Exception):
    """The master could not be reached or refused the call. `status`: the HTTP status of a refusal (a 4xx: the
    message itself was refused), None if the master was not reached; `reason`: the refusal's category."""

    def __init__(self, msg: str, status: int | None = None, reason: str | None = None):
        super().__init__(msg)
        self.status = status
        self.reason = reason

    @property
    def refused(self) -> bool:
        """Sending the same message again will not help (a 4xx other than UNKNOWN_NODE)."""
        return refused(self.status)

    @property
    def unknown_node(self) -> bool:
        """The master has no record of this node (it restarted): register again, then retry."""
        return self.status == Status.UNKNOWN_NODE


def split_endpoints(endpoint: str) -> list[str]:
    """"A:1,B:2" -> ["A:1", "B:2"] (empty parts dropped). Pure."""
    return [e.strip() for e in endpoint.split(",") if e.strip()]


def next_endpoint(current: int, failed: int, count: int) -> int:
    """The endpoint to use after a call to endpoint `failed` could not reach it, while `current` is in use: the
    next one round-robin, unless another thread has already moved on (then stay). Pure."""
    return (failed + 1) % count if current == failed else current


class ControlClient:
    def __init__(self, endpoint: str, secret: str, timeout: float = CLIENT_TIMEOUT_S, gate: Gate | None = None):
        self.endpoints = split_endpoints(endpoint) or [endpoint]
        self.current = 0
        self.secret = secret
        self.timeout = timeout
        self.gate = gate
        self._local = threading.local()
        self._switch_lock = threading.Lock()

    @property
    def base(self) -> str:
        e = self.endpoints[self.current]
        return e if e.startswith("http") else f"http://{e}"

    @property
    def host(self) -> str:
        return urlsplit(self.base).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        return urlsplit(self.base).port or 80

    def move_on(self, failed: int | None = None) -> None:
        """Endpoint `failed` (default: the current one) does not act as the master: use the next one."""
        with self._switch_lock:
            self.current = next_endpoint(self.current, self.current if failed is None else failed,
                                         len(self.endpoints))

    def _check_gate(self) -> None:
        why = self.gate() if self.gate is not None else None
        if why:
            raise ControlError(f"cannot reach master at {self.base}: {why}")

    def _request(self, method: str, path: str, payload: Mapping[str, object] | None, timeout: float | None) -> bytes:
        self._check_gate()
        out = self._exchange(method, path, payload, timeout)
        self._check_gate()
        return out

    def _exchange(self, method: str, path: str, payload: Mapping[str, object] | None, timeout: float | None) -> bytes:
        data = json.dumps(payload).encode() if payload is not None else None
        headers = {"Authorization": f"Bearer {self.secret}", "Content-Type": "application/json"}
        t = timeout or self.timeout
        at = self.current
        for attempt in range(2):
            conn = getattr(self._local, "conn", None)
            if conn is not None and getattr(self._local, "at", at) != at:   # another thread moved on
                self._drop()
                conn = None
            reused = conn is not None
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=t)
                self._local.at = at
            try:
                conn.timeout = t
                if conn.sock is not None:
                    conn.sock.settimeout(t)
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                body = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                self._drop()
                if reused and attempt == 0:   # the master closed an idle connection (or restarted): redial once
                    continue
                raise self._unreachable(at, e) from None
            except (OSError, http.client.HTTPException) as e:
                self._drop()
                raise self._unreachable(at, e) from None
            if resp.will_close:
                self._drop()
            if resp.status >= 400:
                raise ControlError(f"master refused {path}: HTTP {resp.status} {body.decode(errors='replace')}",
                                   status=resp.status, reason=_reason(body))
            return body
        raise AssertionError("unreachable")

    def _unreachable(self, at: int, e: Exception) -> ControlError:
        err = ControlError(f"cannot reach master at {self.endpoints[at]}: {e}")
        if len(self.endpoints) > 1:
            self.move_on(at)
        return err

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def close(self) -> None:
        """Close the calling thread's connection."""
        self._drop()

    def post(self, path: str, payload: Mapping[str, object], timeout: float | None = None) -> dict[str, Any]:
        reply: dict[str, Any] = json.loads(self._request("POST", path, payload, timeout) or b"{}")   # the API answers objects
        return reply

    def get_json(self, path: str) -> dict[str, Any]:
        reply: dict[str, Any] = json.loads(self._request("GET", path, None, None))
        return reply

    def get_text(self, path: str) -> str:
        return self._request("GET", path, None, None).decode()


def _reason(body: bytes) -> str | None:
    """The `reason` of a refusal's JSON body, if it has one."""
    try:
        r = json.loads(body).get("reason")
    except (ValueError, AttributeError):
        return None
    return r if isinstance(r, str) else None
