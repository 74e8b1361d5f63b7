"""`gpu-watchdog plan` in a process of its own: the figures and the Helm snippet printed, usage errors
named, and a handler it cannot measure said why."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_plan_cli_prints_result_and_helm_snippet() -> None:
    out = subprocess.run([sys.executable, "-m", "gpu_watchdog", "plan", "--total", "24GiB", "--base", "15GiB",
                          "--peak", "2GiB", "--reserve", "12%"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "N_max = floor(budget / peak) = 3" in out.stdout
    assert "maxConcurrency: 3" in out.stdout


def test_plan_cli_usage_errors() -> None:
    out = subprocess.run([sys.executable, "-m", "gpu_watchdog", "plan", "--total", "24GiB"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "go together" in out.stderr
    out = subprocess.run([sys.executable, "-m", "gpu_watchdog", "plan", "--total", "lots", "--base", "1GiB",
                          "--peak", "1GiB"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--total" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "gpu_watchdog", "plan"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no CUDA device" in out.stderr


@pytest.mark.parametrize(("handler", "said"), [
    ("embeddings", "no CUDA device to measure on"),  # a measurable handler: only the device is missing here
    ("nope", "--handler nope: not a built-in"),
    ("json:dumps", "--handler json:dumps: calling dumps() failed"),
    ("json:JSONDecoder", "--handler json:JSONDecoder: the handler lacks"),
])
def test_plan_measures_a_handlers_item_or_says_why_not(handler: str, said: str) -> None:
    out = subprocess.run([sys.executable, "-m", "gpu_watchdog", "plan", "--handler", handler], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and said in out.stderr, out.stderr
