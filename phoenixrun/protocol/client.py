"""Authenticated JSON-over-HTTP client for the master's control API.

Keep-alive: each calling thread keeps one HTTP/1.1 connection to the master (an agent's heartbeat
and directive poll each reuse theirs), so a 16K-node job does not open 16K connections a second.
"""
from __future__ import annotations

import http.client
import json
import threading
from urllib.parse import urlsplit

from phoenixrun.protocol.constants import CLIENT_TIMEOUT_S


class ControlError(Exception):
    """The master could not be reached or refused the call. `status`: the HTTP status of a refusal (a 4xx: the
    message itself was refused and sending it again will not help), None if the master was not reached."""

    def __init__(self, msg: str, status: int | None = None):
        super().__init__(msg)
        self.status = status

    @property
    def refused(self) -> bool:
        return self.status is not None and 400 <= self.status < 500


class ControlClient:
    def __init__(self, endpoint: str, secret: str, timeout: float = CLIENT_TIMEOUT_S):
        self.base = endpoint if endpoint.startswith("http") else f"http://{endpoint}"
        u = urlsplit(self.base)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.secret = secret
        self.timeout = timeout
        self._local = threading.local()

    def _request(self, method: str, path: str, payload: dict | None, timeout: float | None) -> bytes:
        data = json.dumps(payload).encode() if payload is not None else None
        headers = {"Authorization": f"Bearer {self.secret}", "Content-Type": "application/json"}
        t = timeout or self.timeout
        for attempt in range(2):
            conn = getattr(self._local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=t)
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
                raise ControlError(f"cannot reach master at {self.base}: {e}") from None
            except (OSError, http.client.HTTPException) as e:
                self._drop()
                raise ControlError(f"cannot reach master at {self.base}: {e}") from None
            if resp.will_close:
                self._drop()
            if resp.status >= 400:
                raise ControlError(f"master refused {path}: HTTP {resp.status} {body.decode(errors='replace')}",
                                   status=resp.status)
            return body
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def close(self) -> None:
        """Close the calling thread's connection."""
        self._drop()

    def post(self, path: str, payload: dict, timeout: float | None = None) -> dict:
        return json.loads(self._request("POST", path, payload, timeout) or b"{}")

    def get_json(self, path: str) -> dict:
        return json.loads(self._request("GET", path, None, None))

    def get_text(self, path: str) -> str:
        return self._request("GET", path, None, None).decode()
