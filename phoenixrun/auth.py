"""Per-job secret: generated at launch, stored in a file only the user can read,
carried by every control message (agents, workers' agents, status) as a bearer token."""
from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

SECRET_ENV = "PHOENIXRUN_SECRET"
SECRET_FILE = "secret"


def new_secret() -> str:
    return secrets.token_hex(32)


def write_secret(run_dir: Path, secret: str) -> Path:
    path = Path(run_dir) / SECRET_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    os.chmod(path, 0o600)
    return path


def read_secret(run_dir: Path | None = None, secret_file: Path | None = None) -> str | None:
    """The secret from the env, an explicit file, or the run directory, in that order."""
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    for p in (secret_file, Path(run_dir) / SECRET_FILE if run_dir else None):
        if p and Path(p).exists():
            return Path(p).read_text().strip()
    return None


def check(expected: str, header_value: str | None) -> bool:
    if not header_value or not header_value.startswith("Bearer "):
        return False
    return hmac.compare_digest(expected.encode(), header_value[len("Bearer "):].encode())
