"""Logs that are not lost with several processes on one stdout: every line whole (one JSON object),
each naming its worker and GPU, and a process that ends by `os._exit` loses nothing it logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import ROOT

WORKER = """
import os, sys
from gpu_watchdog import logs
logs.configure("inference", force_json=True)
log = logs.get("load")
n, exit_after = int(sys.argv[1]), int(sys.argv[2])
for i in range(n):
    # Lines of every length up to near the pipe's atomic write size, so a split write would show.
    log.info("step", i=i, pad="x" * (i * 37 % 3800))
    if i + 1 == exit_after:
        os._exit(3)  # as a poisoned worker leaves: no flush, no atexit
"""


def test_workers_sharing_stdout_write_whole_lines_and_os_exit_loses_none() -> None:
    lines_each, poisoned, exit_after = 1500, "2", 600
    read, write = os.pipe()
    procs = []
    for worker in ("0", "1", "2", "3"):
        env = {**os.environ, "GPU_WATCHDOG_WORKER": worker, "CUDA_VISIBLE_DEVICES": worker}
        after = exit_after if worker == poisoned else 0
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(lines_each), str(after)], stdout=write,
                                      env=env, cwd=ROOT))
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        out = fh.read()
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0, 0, 3, 0]
    counts: dict[str, list[int]] = {}
    for raw in out.decode().splitlines():
        line = json.loads(raw)  # a line split or interleaved with another would not parse
        assert line["gpu"] == line["worker"] and line["event"] == "step" and line["component"] == "inference"
        assert len(line["pad"]) == line["i"] * 37 % 3800
        counts.setdefault(line["worker"], []).append(line["i"])
    # Every line of every worker, in its order; the one that left by os._exit up to its last line.
    assert counts == {w: list(range(exit_after if w == poisoned else lines_each)) for w in "0123"}
