"""Everything of ours imports from one root of our own (`gpu_watchdog`), the folders of this checkout
mapped into it; nothing of ours answers to a name another distribution owns."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def test_the_import_root_resolves_to_this_checkout(tmp_path: Path) -> None:
    # From a neutral folder, as the console script runs: whatever the environment holds wins there.
    code = ("import gpu_watchdog.watchdog.cli.commands, gpu_watchdog.inference.cli, gpu_watchdog.benchmarks.loadgen"
            " as b;"
            " print(gpu_watchdog.watchdog.__file__); print(gpu_watchdog.inference.cli.__file__); print(b.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    files = [Path(line) for line in out.stdout.split()]
    assert [f.parent.parent for f in files] == [ROOT / "gpu_watchdog"] * 3, files
    # Through the links, the files are the top-level folders' own.
    assert [f.resolve().parent for f in files] == [ROOT / "watchdog", ROOT / "inference", ROOT / "benchmarks"]


def test_nothing_of_ours_under_a_name_others_own(tmp_path: Path) -> None:
    # From a neutral folder: `watchdog`, `inference` and `benchmarks` are not ours to answer to
    # (not importable at all here, or, where another distribution is installed, theirs).
    for name in ("watchdog", "inference", "benchmarks"):
        code = f"import importlib.util as u; s = u.find_spec({name!r}); print(s.origin if s else None)"
        found = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                               check=True).stdout.strip()
        # Another distribution's copy may sit in a venv inside the checkout (mkdocs brings PyPI's
        # watchdog): ours is the folder of that name at the checkout's root.
        assert found == "None" or not Path(found).resolve().is_relative_to(ROOT / name), (name, found)


def test_the_console_script_is_ours(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "gpu-watchdog"
    out = subprocess.run([str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert "serve" in out.stdout and "run" in out.stdout and "up" in out.stdout


def test_the_source_imports_only_through_the_root() -> None:
    # A module loaded under two names would be two modules (two registries, two contextvars).
    import re

    bare = re.compile(r"^\s*(from|import)\s+(watchdog|inference|benchmarks)\b", re.M)
    files = [*(ROOT / "gpu_watchdog").glob("*.py"),
             *(p for folder in ("watchdog", "inference", "benchmarks", "tests", "examples")
               for p in (ROOT / folder).rglob("*.py")),
             # Python inside the shell scripts and the images' recipes too.
             *(ROOT / "benchmarks").glob("*.sh"), *(ROOT / "docker").glob("*"), ROOT / "Makefile"]
    # test_install_beside.py: PyPI's `watchdog`, used on purpose (in a script it runs elsewhere).
    offenders = [str(p.relative_to(ROOT)) for p in files
                 if bare.search(p.read_text()) and p.name != "test_install_beside.py"]
    assert offenders == []
    assert importlib.util.find_spec("gpu_watchdog") is not None
