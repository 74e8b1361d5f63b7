"""The two images as a cluster runs them: built by `make images-ci` (buildah), run here as non-root.

The inference image serves the built-in model on a loopback port and answers a completion; the
watchdog image, pointed at it, turns ready. Sizes go to the test's output for the README.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.helpers import free_port

pytestmark = pytest.mark.timeout(300)
TAG = os.environ.get("GPU_WATCHDOG_IMAGES", "")
BUILDAH = ["buildah", "--storage-driver", "vfs"]


@pytest.fixture(scope="module", autouse=True)
def images_built() -> None:
    if not TAG:
        if os.environ.get("CI"):
            pytest.fail(".ci/run builds the images (make images-ci) and names their tag in GPU_WATCHDOG_IMAGES")
        pytest.skip("build the images first: make images-ci, then GPU_WATCHDOG_IMAGES=ci")


def sh(*args: str) -> str:
    return subprocess.run([*BUILDAH, *args], check=True, capture_output=True, text=True).stdout.strip()


class Container:
    """`buildah run` of an image's command, in the background, on the host's network (loopback)."""

    def __init__(self, image: str, command: list[str], log: Path, env: dict[str, str],
                 volumes: tuple[str, ...] = ()) -> None:
        self.ctr = sh("from", "-q", f"localhost/{image}:{TAG}")
        args = [*BUILDAH, "run", "--isolation", "chroot"]
        for k, v in env.items():
            args += ["--env", f"{k}={v}"]
        for v in volumes:
            args += ["--volume", v]
        self.log = log
        self.proc = subprocess.Popen([*args, self.ctr, "--", *command], stdout=open(log, "wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
        subprocess.run([*BUILDAH, "rm", self.ctr], capture_output=True)


def wait_ok(url: str, c: Container, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert c.proc.poll() is None, c.log.read_text(errors="replace")[-3000:]
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready in {timeout}s:\n{c.log.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, int]]:
    tmp = tmp_path_factory.mktemp("images")
    port, control = free_port(), free_port()
    c = Container("gpu-watchdog-inference", ["gpu-watchdog", "serve", "--device", "cpu", "--host", "127.0.0.1",
                                             "--port", str(port), "--control-port", str(control)],
                  tmp / "inference.log", {"GPU_WATCHDOG_TOKEN": "image-test-token"})
    try:
        wait_ok(f"http://127.0.0.1:{port}/readyz", c, 180)
        yield str(tmp), port, control
    finally:
        c.stop()


def test_the_inference_image_serves_a_completion_as_non_root(served: tuple[str, int, int]) -> None:
    _, port, _ = served
    r = requests.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    config = json.loads(sh("inspect", "--type", "image", f"localhost/gpu-watchdog-inference:{TAG}"))
    assert config["OCIv1"]["config"]["User"] == "10001:10001"


def test_the_watchdog_image_watches_it_and_turns_ready(served: tuple[str, int, int]) -> None:
    tmp, port, control = served
    wport = free_port()
    cfg = Path(tmp) / "watchdog.yaml"
    cfg.write_text(f"target: {{control_url: 'http://127.0.0.1:{control}', token_file: null,"
                   f" metrics_url: 'http://127.0.0.1:{port}/metrics'}}\ncanary: {{interval: 2s, timeout: 5s}}\n"
                   f"restart: {{strategy: none}}\nserver: {{host: 127.0.0.1, port: {wport}}}\n")
    c = Container("gpu-watchdog-watchdog", ["gpu-watchdog", "run", "--config", "/etc/gpu-watchdog/config.yaml"],
                  Path(tmp) / "watchdog.log", {"GPU_WATCHDOG_TOKEN": "image-test-token"},
                  volumes=(f"{cfg}:/etc/gpu-watchdog/config.yaml:ro",))
    try:
        wait_ok(f"http://127.0.0.1:{wport}/readyz", c, 90)
        status = requests.get(f"http://127.0.0.1:{wport}/status", timeout=5).json()
        assert status["server_metrics"]["last"]["server"] == "bundled"
    finally:
        c.stop()


def test_the_sidecar_image_has_no_torch_and_neither_has_pip() -> None:
    ctr = sh("from", "-q", f"localhost/gpu-watchdog-watchdog:{TAG}")
    try:
        # Only the sidecar, under our own import root: no inference half, no load generator, and no
        # top-level `watchdog` or `inference` to collide with other distributions.
        probe = ("import importlib.util as u, os; import gpu_watchdog.watchdog.runtime.app;"
                 " print(*(u.find_spec(m) is None for m in ('torch', 'pip', 'watchdog', 'inference', 'benchmarks')),"
                 " u.find_spec('gpu_watchdog.inference') is None, u.find_spec('gpu_watchdog.benchmarks') is None,"
                 " os.getuid())")
        out = subprocess.run([*BUILDAH, "run", "--isolation", "chroot", ctr, "--", "python3", "-c", probe],
                             check=True, capture_output=True, text=True).stdout.split()
        assert out == ["True"] * 7 + ["10001"]
        # The inference half's commands are not dropped: they say what this image lacks.
        serve = subprocess.run([*BUILDAH, "run", "--isolation", "chroot", ctr, "--", "gpu-watchdog", "serve",
                                "--port", "8000"], capture_output=True, text=True)
        assert serve.returncode == 2 and "carries only the sidecar" in serve.stderr, serve
    finally:
        subprocess.run([*BUILDAH, "rm", ctr], capture_output=True)
    print({name: sh("images", "--format", "{{.Size}}", f"localhost/{name}:{TAG}")
           for name in ("gpu-watchdog-inference", "gpu-watchdog-watchdog")})
