"""Per-job secret: generated at launch, stored in a file only the user can read,
carried by every control message (agents, workers' agents, status) as a bearer token."""
from __future__ import annotations

import hmac
import os
import secrets
import time
from pathlib import Path

SECRET_ENV = "PHOENIXRUN_SECRET"
SECRET_FILE = "secret"


def new_secret() -> str:
    return secrets.token_hex(32)


def write_secret(run_dir: Path, secret: str) -> Path:
    """Put `secret` in RUN_DIR/secret, replacing what is there: written whole under another name, then renamed
    into place (a reader never sees it empty or half written). Only where this caller's secret must win (a
    standalone launch, $PHOENIXRUN_SECRET); masters that share a run directory use `ensure_secret`."""
    path = Path(run_dir) / SECRET_FILE
    tmp = _tmp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    os.chmod(path, 0o600)
    return path


def create_once(path: Path, text: str, mode: int = 0o600) -> bool:
    """Create `path` holding `text` unless it exists: True if this call created it. Exactly one of any number of
    processes racing here creates it, and the file appears whole (written under another name, then hard-linked
    into place; where the file system has no hard links, an exclusive create and then the write)."""
    path = Path(path)
    tmp = _tmp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(text)
            return True
    finally:
        _unlink(tmp)


def ensure_secret(run_dir: Path, candidate: str | None = None) -> str:
    """The run directory's secret, created exactly once: the first caller writes `candidate` (a new secret if
    None), every caller - the first included - returns what the file holds. Two masters started together with
    --lease-ttl therefore serve the same secret, whoever starts first (both reading no file and then both writing
    their own made one of them answer 401 to the file's secret)."""
    path = Path(run_dir) / SECRET_FILE
    create_once(path, candidate or new_secret())
    deadline = time.monotonic() + 5.0
    while True:       # only the no-hard-link path can show the file before its content
        secret = path.read_text().strip()
        if secret or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if not secret:
        raise OSError(f"{path} is empty")
    os.chmod(path, 0o600)
    return secret


def master_secret(run_dir: Path) -> str:
    """A master's secret: $PHOENIXRUN_SECRET if set (and written to RUN_DIR/secret when that holds another),
    else the run directory's (`ensure_secret`: created once, whoever starts first)."""
    env = os.environ.get(SECRET_ENV)
    secret = ensure_secret(run_dir, env)
    if env and secret != env:
        write_secret(run_dir, env)
        return env
    return secret


def read_secret(run_dir: Path | None = None, secret_file: Path | None = None) -> str | None:
    """The secret from the env, an explicit file, or the run directory, in that order."""
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    for p in (secret_file, Path(run_dir) / SECRET_FILE if run_dir else None):
        if p and Path(p).exists():
            return Path(p).read_text().strip()
    return None


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _unlink(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def check(expected: str, header_value: str | None) -> bool:
    if not header_value or not header_value.startswith("Bearer "):
        return False
    return hmac.compare_digest(expected.encode(), header_value[len("Bearer "):].encode())
