"""The control API's token file: one that others could have written is refused, saying why; the
default token's folder, in a shared temp folder, must be this user's alone."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from gpu_watchdog import token
from gpu_watchdog.token import TokenError, ensure_token, read_token


@pytest.fixture(autouse=True)
def no_token_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(token.ENV_VAR, raising=False)


def test_a_token_file_others_can_write_is_refused_and_a_private_one_read(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    path.chmod(0o666)
    with pytest.raises(TokenError, match=r"can be written by others \(mode 666\).*chmod 600"):
        read_token(str(path))
    with pytest.raises(TokenError, match="can be written by others"):
        ensure_token(str(path))  # a server never requires a token someone else chose
    path.chmod(0o600)
    assert read_token(str(path)) == "s3cret"
    path.chmod(0o644)  # readable by others, as a mounted Secret is by default
    assert read_token(str(path)) == "s3cret"


def test_a_token_file_of_another_user_is_refused_and_roots_accepted(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    theirs, roots = tmp_path / "theirs", tmp_path / "roots"
    for path in (theirs, roots):
        path.write_text("t0ken\n")
        path.chmod(0o644)
    real = os.getuid()
    if real == 0:
        os.chown(theirs, 12345, 12345)  # another user's file; `roots` stays root's
    # This process as an ordinary user (1000), another than the files' owners.
    monkeypatch.setattr(token.os, "getuid", lambda: 1000 if real == 0 else real + 1)
    with pytest.raises(TokenError, match=r"belongs to uid \d+, not to this user \(uid \d+\) or root"):
        read_token(str(theirs))
    if real == 0:
        assert read_token(str(roots)) == "t0ken"  # a Secret the kubelet mounted is root's


def test_the_default_tokens_folder_must_be_this_users_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    folder = tmp_path / f"gpu-watchdog-{os.getuid()}"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)  # made first by someone else, open to all
    with pytest.raises(TokenError, match=r"not private to this user .*mode 777"):
        ensure_token(None)
    folder.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    folder.symlink_to(elsewhere)
    with pytest.raises(TokenError, match="a link"):
        ensure_token(None)
    folder.unlink()
    made, path = ensure_token(None)  # made by us: private, and the token in it
    assert path == str(folder / "token") and Path(path).read_text().strip() == made
    assert oct(folder.stat().st_mode & 0o777) == "0o700" and oct(Path(path).stat().st_mode & 0o777) == "0o600"
