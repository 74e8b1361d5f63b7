"""Every shell block the README and docs/ mark `<!-- check: run -->` (or `run-any`) is run, as a reader
would paste it, against a real `gpu-watchdog up --fault-injection` (built-in model, CPU) started
here: the ports the pages write (8000 inference, 8001 control API, 9402 watchdog) are mapped to this
run's own. Blocks run in page order on one stack, and each must leave it serving."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.docs import pages
from tests.helpers import Proc, free_port, spawn, wait_http

RUN_BLOCKS = [b for page in pages.doc_pages() for b in pages.blocks(page)
              if b.lang in pages.SHELL and b.check in ("run", "run-any")]
_PORT = re.compile(r"\b(localhost|127\.0\.0\.1):(8000|8001|9402)\b")
BLOCK_TIMEOUT = 60.0


class Stack:
    def __init__(self, proc: Proc, ports: dict[str, int]) -> None:
        self.proc = proc
        self.ports = ports

    def mapped(self, text: str) -> str:
        return _PORT.sub(lambda m: f"{m.group(1)}:{self.ports[m.group(2)]}", text)


def _env() -> dict[str, str]:
    """The reader's shell: the project's venv first on PATH, no token in the environment (under `up`
    the control API's token lives in its file, as the pages say), the default temporary folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_WATCHDOG_TOKEN", "TMPDIR")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("docs-up")
    ports = {"8000": free_port(), "8001": free_port(), "9402": free_port()}
    # With fault injection, as the fault model's page starts it: its blocks inject and cure faults.
    proc = spawn(["up", "--fault-injection", "--device", "cpu", "--host", "127.0.0.1", "--port", str(ports["8000"]),
                  "--control-port", str(ports["8001"]), "--watchdog-port", str(ports["9402"])],
                 tmp / "up.log", env=_env())
    s = Stack(proc, ports)
    try:
        wait_http(f"http://127.0.0.1:{ports['9402']}/readyz", proc, timeout=180)
        yield s
    finally:
        code = proc.stop(timeout=20)
        assert code == 0, proc.log()[-3000:]


def _preamble(check: str) -> str:
    # A reader sees an HTTP error on the screen; here it must fail the block, unless the block is
    # one that shows a refusal.
    return "curl() { command curl --fail-with-body \"$@\"; }\n" if check == "run" else ""


def test_the_pages_have_blocks_to_run() -> None:
    assert len(RUN_BLOCKS) >= 10, [b.where for b in RUN_BLOCKS]
    assert any(b.page.name == "README.md" for b in RUN_BLOCKS)


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda b: b.where)
def test_the_block_runs_against_up(block: pages.Block, stack: Stack) -> None:
    script = _preamble(block.check or "run") + stack.mapped(block.text)
    try:
        done = subprocess.run(["bash", "-e", "-c", script], cwd=pages.ROOT, env=_env(),
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT:g} s:\n{block.text}")
    assert done.returncode == 0, (f"{block.where} exited {done.returncode}:\n{block.text}\n--- stdout\n"
                                  f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
    # A block leaves the stack serving, as the next reader's command expects it.
    ready = requests.get(f"http://127.0.0.1:{stack.ports['8000']}/readyz", timeout=30)
    assert ready.status_code == 200, f"after {block.where}: inference /readyz {ready.status_code}"
