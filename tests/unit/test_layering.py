"""The sidecar must run where torch is not installed."""

from __future__ import annotations

import subprocess
import sys

SNIPPET = """
import sys
sys.modules["torch"] = None          # any import of torch now fails
sys.modules["transformers"] = None
import watchdog.app, watchdog.up, watchdog.policy, watchdog.samplers.nvml, watchdog.actions.restart
from watchdog.cli import main
sys.exit(main(["check-config", sys.argv[1]]))
"""


def test_sidecar_imports_and_runs_without_torch(tmp_path: object) -> None:
    from pathlib import Path

    cfg = Path(str(tmp_path)) / "c.yaml"
    cfg.write_text("restart: {strategy: none}\n")
    out = subprocess.run([sys.executable, "-c", SNIPPET, str(cfg)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout
