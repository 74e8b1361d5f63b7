"""What a process with a poisoned CUDA context leaves behind: the termination log line and the exit code.

Shared by `serve` and the in-process agent, so the kubelet and the watchdog read the same thing
whichever process died.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

EXIT_POISONED = 3
# Told to exit through the control API (`POST /control/exit`): a hung or poisoned worker of several,
# which its server (`serve --workers`' parent, a pre-fork server) starts again. EX_TEMPFAIL: try again.
EXIT_TOLD = 75
# gunicorn's arbiter stops the whole service when a worker exits with 3 ("failed to boot") or 4
# ("app failed to load"): a worker of it that must leave says EXIT_TOLD instead, and is replaced.
GUNICORN_HALTS = (3, 4)


def exit_code(code: int) -> int:
    """`code`, or EXIT_TOLD where the server this process is a worker of would stop on `code`."""
    return EXIT_TOLD if code in GUNICORN_HALTS and "gunicorn" in sys.modules else code


def leave(code: int) -> NoReturn:
    """Exit now, what was logged flushed: worker threads may sit in a hung kernel, and a normal
    interpreter exit would wait for them forever."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code(code))

TERMINATION_LOG = os.environ.get("GPU_WATCHDOG_TERMINATION_LOG", "/dev/termination-log")


INFLIGHT_PREFIX = "inflight: "
# The kubelet keeps a termination message's last 4096 bytes: the reason and 32 fingerprints fit.
REASON_MAX = 300


def write_termination_log(reason: str, inflight: list[str] | None = None) -> None:
    """The reason, and on a line of its own the fingerprints in flight at the failure (the query of
    death's evidence, readable from the pod's status once the process is gone)."""
    text = f"gpu-watchdog inference: CUDA context poisoned: {reason[:REASON_MAX]}\n"
    if inflight:
        text += INFLIGHT_PREFIX + ",".join(inflight) + "\n"
    try:
        path = Path(TERMINATION_LOG)
        # Kubernetes mounts /dev/termination-log; elsewhere only an explicitly named file is written.
        if path.exists() or "GPU_WATCHDOG_TERMINATION_LOG" in os.environ:
            path.write_text(text, encoding="utf-8")
    except OSError:
        pass
