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


def run_check(tmp_path: Path, env: dict[str, str]) -> tuple[Path, str]:
    out, scratch = tmp_path / "results", tmp_path / "scratch"
    scratch.mkdir()
    env = {**env, "GPU_CHECK_ALLOW_CPU": "1", "TMPDIR": str(scratch)}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=280)
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    return out, log


@pytest.mark.timeout(300)
def test_gpu_check_dry_run_writes_every_result(tmp_path: Path) -> None:
    out, log = run_check(tmp_path, {**os.environ, "GPU_CHECK_VENV": sys.prefix})
    check_results(out, log, tmp_path / "scratch")


def check_results(out: Path, log: str, scratch: Path) -> None:
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
    assert "cached decoding, alone and batched: OK" in log
    # One worker per GPU needs two: on fewer, the step says it was skipped and why.
    assert "one worker per GPU: the agent's example" in log and "GPU(s) visible; one worker per GPU needs two" in log
    assert "serve --workers N behind one port" in log and "GPU(s) visible; serve --workers needs two or more" in log
    # The generated model (a few GB on a GPU) goes to the temp folder, not the results, and is removed again.
    assert list(scratch.rglob("model-big")) == [] and list(scratch.rglob("*.safetensors")) == []


@pytest.mark.timeout(300)
def test_gpu_check_on_an_offline_image_with_carried_wheels(tmp_path: Path) -> None:
    """As on the GPU machines: python3 has torch and transformers 5.17 but neither kubernetes nor
    structlog, and no network; the wheel folder completes it."""
    python, wheels = os.environ.get("GPU_WATCHDOG_OFFLINE_PYTHON"), os.environ.get("GPU_WATCHDOG_OFFLINE_WHEELS")
    if not python or not wheels:
        if os.environ.get("CI"):
            pytest.fail("`make test` prepares the offline image stand-in (make offline)")
        pytest.skip("run `make offline` and pass GPU_WATCHDOG_OFFLINE_PYTHON / GPU_WATCHDOG_OFFLINE_WHEELS")
    bare = subprocess.run([python, "-c", "import structlog"], capture_output=True, text=True)
    assert bare.returncode != 0, "the stand-in must lack what the wheels bring"
    version = subprocess.run([python, "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == "5.17.0"
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECK_VENV", "PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{Path(python).parent}:{env['PATH']}"
    env["GPU_CHECK_WHEELS"] = wheels
    # Nothing may come from the index: pip is pointed at an address where nothing listens.
    env["PIP_INDEX_URL"] = "http://127.0.0.1:9/simple"
    env["PIP_EXTRA_INDEX_URL"] = ""
    out, log = run_check(tmp_path, env)
    assert f"wheels from {wheels}" in log
    assert "using the system python3 and its packages" in log
    assert "transformers 5.17.0 cache keyword: past_key_values" in log
    check_results(out, log, tmp_path / "scratch")
