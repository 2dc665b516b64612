"""Authenticated JSON-over-HTTP client for the master's control API."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


class ControlError(Exception):
    """The master could not be reached or refused the call."""


class ControlClient:
    def __init__(self, endpoint: str, secret: str, timeout: float = 5.0):
        self.base = endpoint if endpoint.startswith("http") else f"http://{endpoint}"
        self.secret = secret
        self.timeout = timeout

    def _request(self, method: str, path: str, payload: dict | None, timeout: float | None) -> bytes:
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.secret}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            raise ControlError(f"master refused {path}: HTTP {e.code} {e.read().decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ControlError(f"cannot reach master at {self.base}: {getattr(e, 'reason', e)}") from None

    def post(self, path: str, payload: dict, timeout: float | None = None) -> dict:
        return json.loads(self._request("POST", path, payload, timeout) or b"{}")

    def get_json(self, path: str) -> dict:
        return json.loads(self._request("GET", path, None, None))

    def get_text(self, path: str) -> str:
        return self._request("GET", path, None, None).decode()
