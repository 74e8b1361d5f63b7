"""Fingerprints: the same work, the same fingerprint on any replica; never the text."""

from __future__ import annotations

from gpu_watchdog.inference.fingerprint import fingerprint

KEY = b"workload-key"


def test_the_same_work_is_the_same_fingerprint_whatever_else_differs() -> None:
    a = {"model": "m", "prompt": "boom", "max_tokens": 8, "user": "alice", "stream": True, "temperature": 0.1}
    b = {"max_tokens": 8, "prompt": "boom", "model": "m", "user": "bob", "stream": False, "temperature": 0.9}
    assert fingerprint(KEY, a) == fingerprint(KEY, b)
    assert len(fingerprint(KEY, a)) == 16 and "boom" not in fingerprint(KEY, a)


def test_what_changes_the_work_changes_the_fingerprint() -> None:
    base = {"model": "m", "prompt": "boom", "max_tokens": 8}
    seen = {fingerprint(KEY, base)}
    for change in ({"max_tokens": 9}, {"n": 2}, {"logprobs": 1}, {"echo": True}, {"prompt": "boom!"},
                   {"model": "other"}):
        seen.add(fingerprint(KEY, {**base, **change}))
    assert len(seen) == 7
    assert fingerprint(b"another-key", base) != fingerprint(KEY, base)


def test_tokens_stand_for_the_text_and_any_body_has_one() -> None:
    assert fingerprint(KEY, {"prompt": "a b"}, tokens=[1, 2]) == fingerprint(KEY, {"prompt": "a  b"}, tokens=[1, 2])
    assert fingerprint(KEY, ["an", "app's", "own", "body"]) != fingerprint(KEY, ["another"])
