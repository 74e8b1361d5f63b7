"""benchmarks/gpu_check.sh runs end to end without a GPU (GPU_CHECK_ALLOW_CPU=1).

The GPU itself is checked by running the script on a GPU machine; this keeps the script from
rotting in between: every step runs, each result file is written, and the generated model does
not linger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT


@pytest.mark.timeout(300)
def test_gpu_check_dry_run_writes_every_result(tmp_path: Path) -> None:
    out, scratch = tmp_path / "results", tmp_path / "scratch"
    scratch.mkdir()
    env = {**os.environ, "GPU_CHECK_ALLOW_CPU": "1", "GPU_CHECK_VENV": sys.prefix, "TMPDIR": str(scratch)}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=280)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]

    nvml = json.loads((out / "nvml.json").read_text())
    assert len(nvml) == 3 and all("available" in s for s in nvml)
    memory = json.loads((out / "memory.json").read_text())
    assert memory["device"] in ("cpu", "cuda") and memory["admission"]["limit"] >= 1
    status = json.loads((out / "watchdog-status.json").read_text())
    assert status["ready"] is True and status["last_samples"]["torch"]["reachable"] is True
    assert "gpu_watchdog_canary_success 1.0" in (out / "watchdog-metrics.txt").read_text()
    stem = "sweep-gpu" if memory["device"] == "cuda" else "sweep-cpu-dry-run"
    for suffix in (".md", ".csv", ".json", ".png"):
        assert (out / f"{stem}{suffix}").stat().st_size > 0, suffix
    rows = json.loads((out / f"{stem}.json").read_text())
    assert {r["mode"] for r in rows} == {"unbounded", "semaphore", "full"}
    assert sum(r["errors"] for r in rows if r["mode"] == "full") == 0
    assert f"{stem}.json full: OOMs inside the server" in log
    assert "done in" in log and "all checks passed" in log
    # The generated model (a few GB on a GPU) goes to the temp folder, not the results, and is removed again.
    assert list(scratch.rglob("model-big")) == [] and list(scratch.rglob("*.safetensors")) == []
