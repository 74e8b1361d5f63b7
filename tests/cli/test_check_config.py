"""The settings' loader as a user meets it: `check-config` and `run` in a process of their own, a bad
config named by its key path with no traceback, whatever the file holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings

from tests.config_strategies import configs


def test_check_config_cli(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("restart: {strategy: none}\ncanary: {interval: 5s, timeout: 2s}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("canary: {interval: 5x}\nrestart: {strategy: reboot}\npolicy: {hang: {consecutive_timeouts: -2}}\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("canary: [\n")
    run = [sys.executable, "-m", "gpu_watchdog", "check-config"]
    ok = subprocess.run([*run, str(good)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "ok" in ok.stdout
    out = subprocess.run([*run, str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "canary.interval:" in out.stderr and "restart.strategy:" in out.stderr
    assert "policy.hang.consecutive_timeouts:" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([*run, str(broken)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "not valid YAML" in out.stderr and "line" in out.stderr
    out = subprocess.run([*run, str(tmp_path / "missing.yaml")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot read" in out.stderr


def test_run_refuses_a_bad_config_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("restart: {strategy: reboot}\n")
    out = subprocess.run([sys.executable, "-m", "gpu_watchdog", "run", "--config", str(bad)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "restart.strategy:" in out.stderr and "Traceback" not in out.stderr


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(configs)
def test_check_config_cli_never_prints_a_traceback(tmp_path: Path, config: Any) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(config, allow_unicode=True))
    out = subprocess.run([sys.executable, "-m", "gpu_watchdog", "check-config", str(f)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode in (0, 1), out.stderr
    assert "Traceback" not in out.stdout + out.stderr
