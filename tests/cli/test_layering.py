"""The sidecar must run where torch is not installed."""

from __future__ import annotations

import subprocess
import sys

SNIPPET = """
import sys
sys.modules["torch"] = None          # any import of torch now fails
sys.modules["transformers"] = None
import gpu_watchdog.watchdog.runtime.app, gpu_watchdog.watchdog.cli.up, gpu_watchdog.watchdog.core.policy
import gpu_watchdog.watchdog.edge.samplers.nvml, gpu_watchdog.watchdog.edge.effects.restart
from gpu_watchdog.cli import main
sys.exit(main(["check-config", sys.argv[1]]))
"""


def test_sidecar_imports_and_runs_without_torch(tmp_path: object) -> None:
    from pathlib import Path

    cfg = Path(str(tmp_path)) / "c.yaml"
    cfg.write_text("restart: {strategy: none}\n")
    out = subprocess.run([sys.executable, "-c", SNIPPET, str(cfg)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


SIDECAR_ONLY = """
import sys
sys.modules["gpu_watchdog.inference"] = None   # the sidecar's image carries no inference half
sys.modules["gpu_watchdog.benchmarks"] = None
from gpu_watchdog.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_sidecar_alone_keeps_every_command_and_says_what_it_lacks(tmp_path: object) -> None:
    from pathlib import Path

    cfg = Path(str(tmp_path)) / "c.yaml"
    cfg.write_text("restart: {strategy: none}\n")
    ok = subprocess.run([sys.executable, "-c", SIDECAR_ONLY, "check-config", str(cfg)], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0 and "ok" in ok.stdout, ok.stderr
    helptext = subprocess.run([sys.executable, "-c", SIDECAR_ONLY, "--help"], capture_output=True, text=True,
                              timeout=60).stdout
    assert all(c in helptext for c in ("serve", "plan", "up", "run", "fleet", "quarantine"))
    for argv in (["serve", "--port", "8000", "--max-concurrency", "4"], ["up"], ["plan", "--total", "24GiB"]):
        out = subprocess.run([sys.executable, "-c", SIDECAR_ONLY, *argv], capture_output=True, text=True, timeout=60)
        # Never "unrecognized arguments" or a traceback: the command is there and names what is missing.
        assert out.returncode == 2, (argv, out)
        assert "carries only the sidecar" in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr)
    bench = subprocess.run([sys.executable, "-c", SIDECAR_ONLY, "bench", "--requests", "1"], capture_output=True,
                           text=True, timeout=60)
    assert bench.returncode == 2 and "comes with the source" in bench.stderr, bench.stderr


def test_the_agent_loads_nothing_of_the_server() -> None:
    # What a user's service pays for importing the agent: the gate, the control API, the contract,
    # the error table; never the engine, the decode loop, the model loader or the public server.
    code = ("import sys, gpu_watchdog.inference.agent_asgi, gpu_watchdog.inference.agent_aiohttp;"
            " print(' '.join(m for m in sys.modules if m.startswith('gpu_watchdog')))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                timeout=120).stdout.split())
    server = {f"gpu_watchdog.inference.{m}" for m in ("engine", "decode", "service", "http_public", "main", "model",
                                                      "item_loop", "handlers", "kv", "lean", "prefix_cache")}
    assert "gpu_watchdog.inference.agent" in loaded and not loaded & server, loaded & server
    assert not any(m.startswith("gpu_watchdog.watchdog") for m in loaded)
