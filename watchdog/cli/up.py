"""`gpu-watchdog up`: the inference server as a child process, watched by the watchdog in local mode."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import uuid

import aiohttp

from gpu_watchdog import logs
from gpu_watchdog.token import ENV_VAR, TokenError, ensure_token
from gpu_watchdog.watchdog.edge.config import METRICS_AUTO, ConfigError, Settings, from_mapping, read_yaml, replace
from gpu_watchdog.watchdog.edge.effects.restart import LocalRestarter
from gpu_watchdog.watchdog.runtime.app import Watchdog

log = logs.get("watchdog.up")


class ChildSupervisor:
    """Keeps one inference child running, like a kubelet with restartPolicy Always."""

    def __init__(self, argv: list[str], env: dict[str, str], ready_url: str, ready_timeout: float = 300.0,
                 stop_timeout: float = 5.0) -> None:
        self.argv = argv
        self.env = env
        self.ready_url = ready_url
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.proc: asyncio.subprocess.Process | None = None
        self.instance_id: str | None = None
        self.restarts = 0
        self._stopping = False
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        self._backoff = 1.0

    async def start(self) -> bool:
        async with self._lock:
            await self._spawn()
        return await self.wait_ready()

    async def _spawn(self) -> None:
        self.instance_id = uuid.uuid4().hex[:12]
        env = {**self.env, "GPU_WATCHDOG_INSTANCE_ID": self.instance_id}
        self.proc = await asyncio.create_subprocess_exec(*self.argv, env=env)
        log.info("inference_started", pid=self.proc.pid, instance_id=self.instance_id)
        self._watch = asyncio.get_running_loop().create_task(self._watch_exit(self.proc))

    async def _watch_exit(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self._stopping or proc is not self.proc:
            return
        log.warning("inference_exited", pid=proc.pid, code=code, instance_id=self.instance_id,
                    respawn_in_s=self._backoff)
        await asyncio.sleep(self._backoff)
        self._backoff = min(self._backoff * 2, 30.0)
        async with self._lock:
            if proc is self.proc and not self._stopping:
                await self._spawn()

    async def _terminate(self, graceful: bool = True) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        if not graceful:
            proc.kill()
            await proc.wait()
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=self.stop_timeout)
        except TimeoutError:
            # A hung kernel keeps the process from draining: kill it.
            proc.kill()
            await proc.wait()

    async def restart_child(self, instance_id: str | None, reason: str, graceful: bool = True) -> bool:
        async with self._lock:
            if instance_id is None or instance_id == self.instance_id or self.proc is None \
                    or self.proc.returncode is not None:
                old = self.proc
                self.proc = None  # the exit watcher of the old process must not respawn it
                if old is not None and old.returncode is None:
                    self.proc = old
                    await self._terminate(graceful)
                await self._spawn()
                self.restarts += 1
                log.warning("inference_restarted", reason=reason, instance_id=self.instance_id)
            else:
                log.info("inference_already_replaced", reason=reason, instance_id=self.instance_id)
        ok = await self.wait_ready()
        if ok:
            self._backoff = 1.0
        return ok

    async def wait_ready(self) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout
        async with aiohttp.ClientSession() as session:
            while loop.time() < deadline:
                if self.proc is not None and self.proc.returncode is not None and not self._stopping:
                    await asyncio.sleep(0.2)  # the exit watcher will respawn it
                try:
                    async with session.get(self.ready_url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        if resp.status == 200:
                            return True
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.1)
        return False

    async def stop(self) -> None:
        self._stopping = True
        await self._terminate()


def up_settings(args: argparse.Namespace) -> Settings:
    data = read_yaml(args.config) if args.config else {}
    if isinstance(data, dict) and isinstance(data.get("restart"), dict):
        configured = data["restart"].get("strategy", "evict")
        if configured != "local":
            log.info("strategy_overridden", configured=configured, used="local",
                     why="up restarts its own child process instead of calling Kubernetes")
        data["restart"] = {**data["restart"], "strategy": "local"}
    elif isinstance(data, dict):
        data["restart"] = {"strategy": "local"}
    settings = from_mapping(data)
    # The watchdog reads the child's own /metrics too, on the port `up` gave it.
    server_metrics = (f"http://127.0.0.1:{args.port}/metrics" if settings.target.metrics_url == METRICS_AUTO
                      else settings.target.metrics_url)
    settings = replace(settings, "target", control_url=f"http://127.0.0.1:{args.control_port}", openai_url=None,
                       token_file=None, metrics_url=server_metrics)
    return replace(settings, "server", port=args.watchdog_port)


async def _up(args: argparse.Namespace, serve_argv: list[str], settings: Settings, token: str,
              token_path: str | None) -> int:
    env = {**os.environ, ENV_VAR: token}
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    supervisor = ChildSupervisor(serve_argv, env, f"http://{host}:{args.port}/readyz")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    start = loop.create_task(supervisor.start())
    await asyncio.wait({start, loop.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        await supervisor.stop()
        return 130
    if not start.result():
        log.error("inference_not_ready", timeout_s=supervisor.ready_timeout)
        await supervisor.stop()
        return 1
    watchdog = Watchdog(settings, LocalRestarter(supervisor), token=token)
    await watchdog.start()
    routes, example = _routes(getattr(args, "handler", "causal-lm"))
    banner = [
        "gpu-watchdog up: both processes are running",
        f"  inference API  http://{host}:{args.port}   {routes}, GET /v1/models /readyz /metrics",
        f"  control API    http://127.0.0.1:{args.control_port}   bearer token in "
        + (token_path or f"${ENV_VAR}"),
        f"  watchdog       http://{host}:{watchdog.port}   GET /status /readyz /healthz /metrics",
        f"  try: curl -s localhost:{args.port}{example}",
        "  Ctrl-C stops both.",
    ]
    print("\n".join(banner), file=sys.stderr, flush=True)
    await stop.wait()
    log.info("stopping")
    await watchdog.stop()
    await supervisor.stop()
    return 0


def _routes(handler: str) -> tuple[str, str]:
    """What the child serves, for the banner: its routes and a request to try."""
    if handler == "embeddings":
        return "POST /v1/embeddings", """/v1/embeddings -d '{"input": "hello"}'"""
    if handler == "classifier":
        return "POST /v1/classify", """/v1/classify -d '{"input": "hello"}'"""
    if handler != "causal-lm":
        return "POST /predict", "/predict -d '{...}'"
    return ("POST /v1/completions /v1/chat/completions",
            """/v1/completions -d '{"prompt": "hello", "max_tokens": 16}'""")


def up_main(args: argparse.Namespace, serve_argv: list[str]) -> int:
    """`serve_argv`: the child's command line, built from the same flags `serve` takes."""
    logs.configure("up")
    try:
        settings = up_settings(args)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"error: {line}", file=sys.stderr)
        return 2
    try:
        token, path = ensure_token(None)
    except TokenError as exc:
        print(f"gpu-watchdog up: {exc}", file=sys.stderr)
        return 2
    if path:
        log.info("control_token", token_file=path)
    try:
        return asyncio.run(_up(args, serve_argv, settings, token, path))
    except OSError as exc:
        print(f"gpu-watchdog up: {exc}", file=sys.stderr)
        return 2
