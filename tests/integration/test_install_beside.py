"""What we install sits beside any other distribution: PyPI's `watchdog` (file-system events) and
ours in one fresh environment, both imported and used, then either uninstalled, leaves the other
working. A real wheel built from this checkout, real pip, the real package from the index."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.timeout(600)

# Theirs, used as their users use it: an observer that sees a file appear.
THEIRS = """
import pathlib, sys, tempfile, threading
from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer
seen = threading.Event()
class Handler(FileSystemEventHandler):
    def on_created(self, event):
        if event.src_path.endswith("hello.txt"):
            seen.set()
with tempfile.TemporaryDirectory() as d:
    obs = Observer(); obs.schedule(Handler(), d); obs.start()
    try:
        pathlib.Path(d, "hello.txt").write_text("hi")
        sys.exit(0 if seen.wait(10) else 3)
    finally:
        obs.stop(); obs.join()
"""

# Ours: both halves import, and the sidecar's command checks a config.
OURS = """
import gpu_watchdog, gpu_watchdog.watchdog.core.policy, gpu_watchdog.inference.fingerprint, gpu_watchdog.contract
print(gpu_watchdog.__version__, gpu_watchdog.__file__)
"""


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


def _ok(args: list[str], cwd: Path) -> str:
    out = _run(args, cwd)
    assert out.returncode == 0, (args, out.stdout[-2000:], out.stderr[-2000:])
    return out.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy, so the checkout gets no build/ or egg-info; links kept as links, as git has them.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("gpu_watchdog", "watchdog", "inference", "benchmarks"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    _ok([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        src)
    (whl,) = out.glob("gpu_watchdog-*.whl")
    return whl


def test_the_wheel_installs_one_import_root_of_its_own(wheel: Path) -> None:
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"gpu_watchdog"}, top
    top_level = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["gpu_watchdog"]
    # Every half and the load generator are inside, under their folder names.
    for module in ("gpu_watchdog/watchdog/runtime/app.py", "gpu_watchdog/inference/agent.py",
                   "gpu_watchdog/benchmarks/loadgen.py", "gpu_watchdog/contract.py"):
        assert module in names, module


def test_beside_pypi_watchdog_either_uninstalled_leaves_the_other_working(wheel: Path, tmp_path: Path) -> None:
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    py, pip, script = env / "bin" / "python", [str(env / "bin" / "python"), "-m", "pip"], env / "bin" / "gpu-watchdog"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("restart: {strategy: none}\n")
    work = tmp_path / "elsewhere"  # a neutral folder: the checkout must not be what imports
    work.mkdir()

    def both_work() -> None:
        _ok([str(py), "-c", THEIRS], work)
        assert "gpu_watchdog" in _ok([str(py), "-c", OURS], work)
        assert "ok" in _ok([str(script), "check-config", str(cfg)], work)

    _ok([*pip, "install", "-q", "watchdog"], work)
    _ok([*pip, "install", "-q", str(wheel)], work)
    both_work()

    _ok([*pip, "uninstall", "-y", "-q", "watchdog"], work)
    assert "ok" in _ok([str(script), "check-config", str(cfg)], work)
    _ok([str(py), "-c", OURS], work)
    assert _run([str(py), "-c", "import watchdog.observers"], work).returncode != 0  # theirs is really gone

    _ok([*pip, "install", "-q", "watchdog"], work)
    both_work()
    _ok([*pip, "uninstall", "-y", "-q", "gpu-watchdog"], work)
    _ok([str(py), "-c", THEIRS], work)
    assert not script.exists()
    assert _run([str(py), "-c", "import gpu_watchdog"], work).returncode != 0
