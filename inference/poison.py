"""What a process with a poisoned CUDA context leaves behind: the termination log line and the exit code.

Shared by `serve` and the in-process agent, so the kubelet and the watchdog read the same thing
whichever process died.
"""

from __future__ import annotations

import os
from pathlib import Path

EXIT_POISONED = 3

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
