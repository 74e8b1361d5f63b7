"""The public port of `serve --workers N`: every request to one ready worker, probes and metrics for all.

A request goes whole to the least loaded ready worker and its answer comes back as it is written
(a stream chunk by chunk; a client that leaves closes the worker's connection, which cancels its
sequences). A worker that refuses it without starting it (drained, poisoned, gone) is taken off
and the request tried on the next; `/metrics` is every worker's series labelled `worker`, with the
parent's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from gpu_watchdog.inference.http_errors import read_body
from gpu_watchdog.inference.settings import ServeSettings
from gpu_watchdog.inference.validation import BadRequest
from gpu_watchdog.inference.workers import Supervisor, Worker, pick, plan_workers
from gpu_watchdog.token import ensure_token

log = structlog.get_logger(__name__)

# Answers that say the worker did not start the request: safe to send it to another.
REFUSED_CODES = frozenset({"context_lost", "draining", "queue_full"})
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
METRICS_TIMEOUT_S = 2.0


def label_sample(line: str, worker: str) -> str:
    """`name{a="b"} 1` → `name{worker="k",a="b"} 1`."""
    brace, space = line.find("{"), line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        rest = line[brace + 1:]
        sep = "" if rest.startswith("}") else ","
        return f'{line[:brace]}{{worker="{worker}"{sep}{rest}'
    return f'{line[:space]}{{worker="{worker}"}}{line[space:]}'


def merge_metrics(texts: Mapping[str, str]) -> str:
    """Prometheus text from several processes as one exposition: each family's HELP and TYPE once,
    then every process's samples of it, each labelled with its `worker`."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for worker, text in texts.items():
        family: str | None = None
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                headers.setdefault(family, [])
                samples.setdefault(family, [])
                if not any(h.startswith(line[:7]) for h in headers[family]):
                    headers[family].append(line)
            elif line.strip() and not line.startswith("#"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                key = family if family is not None and name.startswith(family) else name
                headers.setdefault(key, [])
                samples.setdefault(key, []).append(label_sample(line, worker))
    out: list[str] = []
    for key, lines in samples.items():
        out += headers.get(key, [])
        out += lines
    return "\n".join(out) + ("\n" if out else "")


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.up = Gauge("gpu_inference_worker_up", "1 while the worker is ready and gets requests",
                        ["worker", "gpu"], registry=self.registry)
        self.restarts = Counter("gpu_inference_worker_restarts", "Worker processes started again after they exited",
                                ["worker", "gpu", "reason"], registry=self.registry)

    def exited(self, w: Worker, reason: str) -> None:
        self.restarts.labels(worker=str(w.index), gpu=w.plan.gpu or "", reason=reason).inc()

    def update(self, w: Worker) -> None:
        gpu = w.plan.gpu or ""
        self.up.labels(worker=str(w.index), gpu=gpu).set(1 if w.routable else 0)


class Front:
    def __init__(self, settings: ServeSettings, supervisor: Supervisor, metrics: WorkerMetrics) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self.metrics = metrics
        self.sessions: dict[int, aiohttp.ClientSession] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_route("*", "/{tail:.*}", self.proxy)
        app.on_cleanup.append(self._close)
        return app

    def _session(self, w: Worker) -> aiohttp.ClientSession:
        s = self.sessions.get(w.index)
        if s is None or s.closed:
            # No pool limit: the worker's own gate and queue bound what it takes, and answer when full.
            s = aiohttp.ClientSession("http://worker", connector=aiohttp.UnixConnector(path=w.plan.socket, limit=0),
                                      auto_decompress=False,
                                      timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
            self.sessions[w.index] = s
        return s

    async def _close(self, _: web.Application) -> None:
        await asyncio.gather(*(s.close() for s in self.sessions.values()))

    async def healthz(self, request: web.Request) -> web.Response:
        # Liveness of this process; a worker that exits is started again here, not by the kubelet.
        return web.json_response({"status": "ok", "workers": [w.view() for w in self.supervisor.workers]})

    async def readyz(self, request: web.Request) -> web.Response:
        ready = [w.index for w in self.supervisor.workers if w.routable]
        body = {"ready": bool(ready) and not self.supervisor.stopping, "workers_ready": ready,
                "workers": len(self.supervisor.workers)}
        if not body["ready"]:
            body["reason"] = "shutting_down" if self.supervisor.stopping else "no_worker_ready"
        return web.json_response(body, status=200 if body["ready"] else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        workers = [w for w in self.supervisor.workers if w.proc is not None]

        async def one(w: Worker) -> tuple[str, str | None]:
            try:
                timeout = aiohttp.ClientTimeout(total=METRICS_TIMEOUT_S)
                async with self._session(w).get("/metrics", timeout=timeout,
                                                headers={"Accept-Encoding": "identity"}) as r:
                    return str(w.index), (await r.text()) if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
                return str(w.index), None

        texts = {k: t for k, t in await asyncio.gather(*(one(w) for w in workers)) if t is not None}
        for w in self.supervisor.workers:
            self.metrics.update(w)
        body = merge_metrics(texts) + generate_latest(self.metrics.registry).decode()
        return web.Response(text=body, content_type="text/plain", charset="utf-8",
                            headers={"X-Workers-Scraped": ",".join(texts)})

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_body(request, self.settings.body_timeout_s, self.settings.max_body_bytes)
        except BadRequest as exc:
            return web.json_response(exc.body(), status=exc.status)
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP)
        if request.remote:
            headers["X-Forwarded-For"] = request.remote
        tried: set[int] = set()
        last: Refusal | None = None
        while True:
            w = pick(self.supervisor.workers, tried)
            if w is None:
                if last is not None:  # every worker refused it: the last refusal, as it was
                    return web.Response(status=last.status, body=last.body, headers=last.headers)
                return _no_worker(self.settings.retry_after_s)
            tried.add(w.index)
            w.inflight += 1
            try:
                answer = await self._forward(request, w, headers, body)
            finally:
                w.inflight -= 1
            if not isinstance(answer, Refusal):
                w.served += 1
                return answer
            last = answer if answer.status else last
            if answer.code != "queue_full":  # full is busy, not unready: it stays in the rotation
                self.supervisor.mark_refusing(w)

    async def _forward(self, request: web.Request, w: Worker, headers: CIMultiDict[str], body: bytes
                       ) -> web.StreamResponse | Refusal:
        """The worker's answer streamed to the client, or its refusal of work it never started (only
        then may the request go to another worker: once sent, it may have run, and runs once)."""
        try:
            up = await self._session(w).request(request.method, request.rel_url, headers=headers, data=body)
        except aiohttp.ClientConnectorError as exc:  # never connected: nothing was sent
            log.warning("worker_unreachable", worker=w.index, path=request.path, error=str(exc))
            return Refusal(0, b"", CIMultiDict(), "unreachable")
        except (aiohttp.ClientError, TimeoutError) as exc:  # sent, and the worker went away
            log.warning("worker_lost", worker=w.index, path=request.path, error=str(exc))
            return _worker_lost(w)
        whole = False
        try:
            out_headers = CIMultiDict((k, v) for k, v in up.headers.items()
                                      if k.lower() not in HOP_BY_HOP or k.lower() == "content-length")
            if up.status in (500, 503) and "json" in up.content_type:
                try:
                    raw = await up.read()
                    whole = True
                except (aiohttp.ClientError, TimeoutError) as exc:
                    log.warning("worker_lost", worker=w.index, path=request.path, error=str(exc))
                    return _worker_lost(w)
                code = _refused(raw)
                if code is not None:
                    return Refusal(up.status, raw, out_headers, code)
                return web.Response(status=up.status, body=raw, headers=out_headers)
            resp = web.StreamResponse(status=up.status, reason=up.reason, headers=out_headers)
            await resp.prepare(request)
            while True:
                try:
                    chunk = await up.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    # The worker went away mid-answer: the client must see a cut answer, not a whole one.
                    log.warning("worker_answer_cut", worker=w.index, path=request.path, error=str(exc))
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                if not chunk:
                    break
                await resp.write(chunk)  # a client gone raises here: the handler ends, the worker's connection closes
            whole = True
            await resp.write_eof()
            return resp
        finally:
            # An answer not read to its end leaves its connection unusable: closed, which is also how
            # the worker learns that a client left.
            if whole:
                up.release()
            else:
                up.close()


@dataclass(frozen=True)
class Refusal:
    """A worker's answer to work it never started (or 0: it could not be reached)."""

    status: int
    body: bytes
    headers: CIMultiDict[str]
    code: str


def _no_worker(retry_after: int) -> web.Response:
    return web.json_response(
        {"error": {"message": "no worker is ready (starting, restarting or draining)",
                   "type": "no_worker_ready", "param": None, "code": "no_worker_ready"}},
        status=503, headers={"Retry-After": str(retry_after)})


def _worker_lost(w: Worker) -> web.Response:
    # 502: the request reached a worker that then went away; it may have run, so it is not sent again.
    return web.json_response(
        {"error": {"message": f"worker {w.index} went away while answering; the request may have run",
                   "type": "worker_lost", "param": None, "code": "worker_lost"}}, status=502)


def _refused(raw: bytes) -> str | None:
    """The refusal code of an answer that says the work never started, else None."""
    try:
        data: Any = json.loads(raw)
    except ValueError:
        return None
    code = data.get("error", {}).get("code") if isinstance(data, dict) and isinstance(data.get("error"), dict) else None
    return code if code in REFUSED_CODES else None


def _has_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl")


async def serve_workers(settings: ServeSettings) -> int:
    """`serve --workers N` until SIGTERM; the exit code."""
    _, token_path = ensure_token(settings.token_file)  # one token for every worker, in the file they read
    with tempfile.TemporaryDirectory(prefix="gpu-watchdog-workers-") as sockets:
        plans = plan_workers(settings, Path(sockets), os.environ, _has_gpu())
        metrics = WorkerMetrics()
        supervisor = Supervisor(settings, plans, on_change=metrics.update, on_exit=metrics.exited)
        front = Front(settings, supervisor, metrics)
        runner = web.AppRunner(front.app(), handle_signals=False, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, settings.host, settings.port).start()
        log.info("listening", api=f"http://{settings.host}:{settings.port}", workers=settings.workers,
                 control=[f"http://127.0.0.1:{p.control_port}" for p in plans],
                 gpus=[p.gpu for p in plans], token_file=token_path)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await supervisor.start()
        stop_task = asyncio.create_task(stop.wait())
        failed_task = asyncio.create_task(supervisor.failed.wait())
        await asyncio.wait({stop_task, failed_task}, return_when=asyncio.FIRST_COMPLETED)
        code = 2 if supervisor.failed.is_set() else 0
        log.info("shutdown", workers=settings.workers, reason=supervisor.failure or "signal")
        await supervisor.stop(settings.shutdown_grace_s + 5)
        await runner.cleanup()
        for t in (stop_task, failed_task):
            t.cancel()
        return code
