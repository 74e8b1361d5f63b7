"""The sidecar's own memory: `gpu-watchdog run` in local mode (no Kubernetes API, strategy none),
watching a real server, stays within 64 MiB resident; it imports what a mode needs when it needs it
(the Kubernetes client and protobuf only where the config asks for the API or the kubelet)."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from tests.helpers import free_port, spawn, start_server, wait_http

LOCAL_MODE_LIMIT = 64 * 2**20


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def mapped_packages(pid: int) -> set[str]:
    """The site-packages whose native libraries the process has loaded."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1].split("site-packages/")[1].split("/")[0] for line in maps
            if "site-packages/" in line and ".so" in line}


def test_local_mode_stays_within_64_mib(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(server.token + "\n")
    wport = free_port()
    config = tmp_path / "watchdog.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"control_url": server.control, "openai_url": server.url, "token_file": str(token_file)},
        "sampling": {"torch_interval": "200ms"},
        "canary": {"interval": "300ms", "timeout": "2s"},
        "restart": {"strategy": "none"},
        "server": {"host": "127.0.0.1", "port": wport},
    }))
    watchdog = spawn(["run", "--config", str(config)], tmp_path / "watchdog.log", env={"GPU_WATCHDOG_TOKEN": ""})
    try:
        wait_http(f"http://127.0.0.1:{wport}/readyz", watchdog)
        time.sleep(5)  # canaries, allocator samples, scrapes: every loop has run many times
        samples = []
        for _ in range(5):
            samples.append(rss_bytes(watchdog.proc.pid))
            time.sleep(0.5)
        native = mapped_packages(watchdog.proc.pid)
    finally:
        watchdog.stop()
        server.proc.stop()
    print(f"sidecar RSS, local mode: {max(samples) / 2**20:.1f} MiB (samples {[s >> 20 for s in samples]} MiB)")
    assert max(samples) <= LOCAL_MODE_LIMIT, [s >> 20 for s in samples]
    # Nothing of the Kubernetes client's stack or of protobuf was needed, so none of it is loaded.
    assert not native & {"google", "pydantic_core", "rpds", "charset_normalizer", "grpc"}, native
