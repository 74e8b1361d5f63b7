"""What a process with a poisoned CUDA context leaves behind: the termination log line and the exit code.

Shared by `serve` and the in-process agent, so the kubelet and the watchdog read the same thing
whichever process died.
"""

from __future__ import annotations

import os
from pathlib import Path

EXIT_POISONED = 3

TERMINATION_LOG = os.environ.get("GPU_WATCHDOG_TERMINATION_LOG", "/dev/termination-log")


def write_termination_log(reason: str) -> None:
    try:
        path = Path(TERMINATION_LOG)
        # Kubernetes mounts /dev/termination-log; elsewhere only an explicitly named file is written.
        if path.exists() or "GPU_WATCHDOG_TERMINATION_LOG" in os.environ:
            path.write_text(f"gpu-watchdog inference: CUDA context poisoned: {reason}\n", encoding="utf-8")
    except OSError:
        pass
