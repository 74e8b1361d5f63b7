"""Where a process is stuck: the Python stack of every thread, taken while it hangs, before the
watchdog restarts it (`POST /control/stacks`), and left where it outlives the process (the
termination log, which the kubelet keeps in the pod's status) and in the answer the watchdog records.

Shared by `serve` and the in-process agent. Their control APIs answer from a loop that a hung engine
thread (serve's model thread) or a hung app (the agent's own loop thread) does not hold, so the stacks
are read with the interpreter's own view of each thread's frames. A thread that holds the interpreter
lock inside C code for good stops that loop too; for it, `SIGUSR2` makes faulthandler write every
thread's stack to stderr from its C handler (the pod's log), where nothing else can run.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import sysconfig
import threading
import traceback
from pathlib import Path
from typing import Any

from gpu_watchdog.inference.poison import TERMINATION_LOG

FRAMES_KEPT = 40  # innermost frames per thread: the stuck call and what led to it
THREADS_KEPT = 64
# The kubelet keeps the last 4096 bytes of the termination message: the stuck thread's stack first.
TERMINATION_MAX = 4000
# A thread whose own code (not the standard library's) is at most this many standard-library frames
# above its innermost frame waits on something that code asked for (an event, a lock, a queue): a hang
# where nothing else moves. An idle pool worker has no code of its own on its stack; an idle event
# loop has its runner's and loop's frames between its code and the selector.
WAIT_DEPTH = 3
STDLIB = sysconfig.get_paths()["stdlib"]
PACKAGES = ("site-packages", "dist-packages")


def register_signal(sig: int = signal.SIGUSR2) -> bool:
    """`kill -USR2 <pid>` writes every thread's stack to stderr, even with the interpreter lock held
    in C code; False where signals cannot be registered (not the main thread, or no such signal)."""
    try:
        faulthandler.register(sig, all_threads=True, chain=False)
    except (ValueError, RuntimeError, AttributeError, OSError):
        return False
    return True


def collect() -> dict[str, Any]:
    """Every thread's stack, innermost frame last, with its name; `stuck`: where the first thread that
    is not waiting for work stands (its innermost frame of code of its own: the app's, the server's),
    None where every thread is idle."""
    names = {t.ident: (t.name, t.daemon) for t in threading.enumerate()}
    me = threading.get_ident()
    threads: list[dict[str, Any]] = []
    for ident, frame in list(sys._current_frames().items())[:THREADS_KEPT]:
        frames = [{"file": f.filename, "line": f.lineno, "function": f.name}
                  for f in traceback.extract_stack(frame)[-FRAMES_KEPT:]]
        name, daemon = names.get(ident, (f"thread-{ident}", True))
        where = _where(frames)
        threads.append({"name": name, "ident": ident, "daemon": daemon, "frames": frames, "current": ident == me,
                        "idle": where is None})
    stuck = next((t for t in threads if not t["current"] and not t["idle"]), None)
    return {"pid": os.getpid(), "threads": threads,
            "stuck": None if stuck is None else {"thread": stuck["name"], **_where(stuck["frames"])}}  # type: ignore[dict-item]


def _library(path: str) -> bool:
    return (path.startswith(STDLIB) and not any(p in path for p in PACKAGES)) or path.startswith("<")


def _where(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where a thread stands: its innermost frame outside the standard library, if it runs there or
    waits there on the library at most WAIT_DEPTH frames deep; None: it waits for work."""
    for depth, f in enumerate(reversed(frames)):
        if not _library(f["file"]):
            return f if depth <= WAIT_DEPTH else None
    return None


def text(report: dict[str, Any], reason: str) -> str:
    """The stacks as the termination log holds them: the stuck thread whole first, then the others'."""
    stuck = report.get("stuck")
    head = f"gpu-watchdog inference: stacks for {reason[:200]}"
    if stuck is not None:
        head += f"; stuck in {describe(stuck)} ({stuck['thread']})"
    out = [head]
    ordered = sorted(report["threads"], key=lambda t: (t["current"], t["idle"]))
    for t in ordered:
        out.append(f"Thread {t['name']}{' (idle)' if t['idle'] else ''}{' (this one)' if t['current'] else ''}:")
        out += [f"  {describe(f)}" for f in reversed(t["frames"])]
    return "\n".join(out) + "\n"


def describe(frame: dict[str, Any]) -> str:
    return f"{frame['file']}:{frame['line']} in {frame['function']}"


def write(report: dict[str, Any], reason: str, path: str = TERMINATION_LOG) -> str | None:
    """The stacks into the termination log (within what the kubelet keeps); the path written, or None
    where there is none (outside Kubernetes only an explicitly named file is written)."""
    body = text(report, reason)
    if len(body.encode()) > TERMINATION_MAX:
        body = body.encode()[:TERMINATION_MAX].decode(errors="ignore").rsplit("\n", 1)[0] + "\n"
    try:
        target = Path(path)
        if not (target.exists() or "GPU_WATCHDOG_TERMINATION_LOG" in os.environ):
            return None
        target.write_text(body, encoding="utf-8")
    except OSError:
        return None
    return str(target)
