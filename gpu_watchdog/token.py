"""The control API's bearer token: `GPU_WATCHDOG_TOKEN` wins, else a token file, generated (mode
0600, whole, once) when absent. `serve`, `up` and the agent make it; the sidecar reads it."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from pathlib import Path

from gpu_watchdog.contract import ENV_VAR

__all__ = ["ENV_VAR", "TokenError", "default_token_path", "ensure_token", "read_token"]


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
        _check_trusted(path)
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise TokenError(f"cannot read token file {path}: {exc.strerror}") from None
    if not token:
        raise TokenError(f"token file {path} is empty")
    return token


def _check_trusted(path: Path) -> None:
    """A token file someone else may have written chooses who may drive the control API: one that
    group or others can write, or that belongs to another user (root's aside: a Secret mounted by
    the kubelet is root's), is refused. Readable by others is allowed: a Secret's default mode."""
    st = path.stat()  # through a link, as a mounted Secret is one
    uid = os.getuid()
    if st.st_mode & 0o022:
        raise TokenError(f"token file {path} can be written by others (mode {st.st_mode & 0o777:o}): whoever writes"
                         f" it chooses the control API's token; make it 600 (chmod 600 {path}) or set {ENV_VAR}")
    if uid != 0 and st.st_uid not in (uid, 0):
        raise TokenError(f"token file {path} belongs to uid {st.st_uid}, not to this user (uid {uid}) or root:"
                         f" remove it, or give a token file of your own, or set {ENV_VAR}")


def _check_private_folder(folder: Path) -> None:
    """The default token's folder lies in a shared temp folder, where anyone may have made it first."""
    st = folder.lstat()
    uid = os.getuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise TokenError(f"the token folder {folder} is not private to this user (owner uid {st.st_uid}, mode"
                         f" {st.st_mode & 0o777:o}{', a link' if stat.S_ISLNK(st.st_mode) else ''}): someone else"
                         f" may read or replace the token there; remove it, or give a token file, or set {ENV_VAR}")


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
        if token_file is None:
            _check_private_folder(path.parent)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # 0600, a name of its own
    except OSError as exc:
        raise TokenError(f"cannot write token file {path}: {exc.strerror}") from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(token + "\n")
        try:
            # Whole, and once: the workers of one service starting together must all require the
            # token the file holds, not each its own with the last writer's in the file.
            os.link(tmp, path)
        except FileExistsError:
            won = _sibling_token(path)
            if won is not None:
                return won, str(path)
            os.replace(tmp, path)  # empty, unreadable or not private to us: replaced, as ever
        except OSError:  # a file system without hard links: whole, the last writer's
            os.replace(tmp, path)
    except OSError as exc:
        raise TokenError(f"cannot write token file {path}: {exc.strerror}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return token, str(path)


def _sibling_token(path: Path) -> str | None:
    """The token another process of this service just wrote at `path`: only a non-empty file of
    ours that no one else may read counts (never one planted in a shared temp folder)."""
    try:
        st = path.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            return None
        return path.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None
