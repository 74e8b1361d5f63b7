"""What the inference process and the sidecar agree on: the control API's routes and its bearer token.

A leaf: it imports nothing else of this project, so the inference package can depend on it (and
on nothing else of the sidecar's). The token: `GPU_WATCHDOG_TOKEN` wins, else a token file;
generated when absent.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

VERSION = "0.1.0"

ENV_VAR = "GPU_WATCHDOG_TOKEN"

# The control API (pod-local, 127.0.0.1:8001, bearer token).
MEMORY = "/control/memory"
EMPTY_CACHE = "/control/empty_cache"
CANARY = "/control/canary"
DRAIN = "/control/drain"  # POST drains (until its `deadline`), DELETE lifts the drain
ADMISSION = "/control/admission"
FAULT = "/control/fault"
# The query of death: the fingerprints in flight (and at the failure), and the quarantine list
# (GET lists, POST adds one, PUT replaces all, DELETE lifts one).
REQUESTS = "/control/requests"
QUARANTINE = "/control/quarantine"
CONTROL_OPENAPI = "/control/openapi.json"

# A drain the server lifts by itself once its deadline passes, so a sidecar that dies mid-restart
# cannot leave the pod drained for good (seconds; `POST /control/drain {"deadline": S}`).
DRAIN_DEADLINE_DEFAULT_S = 300.0
DRAIN_DEADLINE_MAX_S = 3600.0


class TokenError(RuntimeError):
    pass


def default_token_path() -> Path:
    return Path(tempfile.gettempdir()) / f"gpu-watchdog-{os.getuid()}" / "token"


def read_token(token_file: str | None) -> str | None:
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env
    if token_file is None:
        return None
    path = Path(token_file)
    if not path.exists():
        return None
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise TokenError(f"cannot read token file {path}: {exc.strerror}") from None
    if not token:
        raise TokenError(f"token file {path} is empty")
    return token


def ensure_token(token_file: str | None) -> tuple[str, str | None]:
    """The token to require, and the file it lives in (None when it came from the environment).

    Generates a fresh token into `token_file` (or a private default path) when none exists, with
    mode 0600 so only this user can read it.
    """
    existing = read_token(token_file)
    if existing is not None:
        return existing, None if os.environ.get(ENV_VAR, "").strip() else token_file
    path = Path(token_file) if token_file else default_token_path()
    token = secrets.token_urlsafe(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(token + "\n")
        os.chmod(path, 0o600)
    except OSError as exc:
        raise TokenError(f"cannot write token file {path}: {exc.strerror}") from None
    return token, str(path)
