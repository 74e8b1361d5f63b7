"""`watchdog` and `inference` share their import names with unrelated packages on the package index
(a file-system-events library, an inference SDK): the ones that load must be this project's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def test_the_import_packages_resolve_to_this_project(tmp_path: Path) -> None:
    # From a neutral folder, as the console script runs: whatever the environment holds wins there.
    code = "import watchdog, inference, watchdog.cli; print(watchdog.__file__); print(inference.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    files = [Path(line).resolve() for line in out.stdout.split()]
    assert [f.parent.parent for f in files] == [ROOT, ROOT], files
    assert [f.parent.name for f in files] == ["watchdog", "inference"]


def test_the_console_script_is_ours(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "gpu-watchdog"
    out = subprocess.run([str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert "serve" in out.stdout and "run" in out.stdout and "up" in out.stdout
