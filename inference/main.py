"""`gpu-watchdog serve`: run the public API and the control API in one process."""

from __future__ import annotations

import asyncio
import signal
import sys

import structlog
from aiohttp import web

from gpu_watchdog.inference import stacks
from gpu_watchdog.inference.http_control import ControlAPI
from gpu_watchdog.inference.http_public import PublicAPI
from gpu_watchdog.inference.poison import leave
from gpu_watchdog.inference.service import InferenceService
from gpu_watchdog.inference.settings import ServeSettings, SettingsError
from gpu_watchdog.token import TokenError, ensure_token

log = structlog.get_logger(__name__)


async def _serve(settings: ServeSettings) -> int:
    stacks.register_signal()  # `kill -USR2`: every thread's stack to stderr, even with the GIL held in C
    token, token_path = ensure_token(settings.token_file)
    service = InferenceService(settings)
    # A client that leaves cancels its handler (aiohttp does not by default), which cancels its
    # sequences at the next decode step: nothing notices a gone client of a plain response otherwise.
    public = web.AppRunner(PublicAPI(service).app(), handle_signals=False, access_log=None,
                           handler_cancellation=True)
    control = web.AppRunner(ControlAPI(service, token).app(), handle_signals=False, access_log=None)
    await public.setup()
    await control.setup()
    # Probes answer (503 on /readyz) while the model loads, so a startupProbe can watch it.
    if settings.unix_socket is not None:
        await web.UnixSite(public, settings.unix_socket).start()
        api = f"unix:{settings.unix_socket}"
    else:
        await web.TCPSite(public, settings.host, settings.port).start()
        api = f"http://{settings.host}:{settings.port}"
    await web.TCPSite(control, settings.control_host, settings.control_port).start()
    log.info("listening", api=api,
             control=f"http://{settings.control_host}:{settings.control_port}",
             token_file=token_path, token_source="env" if token_path is None else "file",
             fault_injection=settings.fault_injection)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    start_task = asyncio.create_task(service.start())
    stop_task = asyncio.create_task(stop.wait())
    fatal_task = asyncio.create_task(service.fatal_event.wait())
    done, _ = await asyncio.wait({start_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if start_task in done and start_task.exception() is not None:
        exc = start_task.exception()
        log.error("start_failed", error=str(exc))
        return 2
    # Started: what is in flight when the engine's loop stops advancing is frozen for the sidecar.
    watch_task = asyncio.create_task(service.watch_progress()) if start_task in done else None
    if not stop.is_set():
        await asyncio.wait({stop_task, fatal_task}, return_when=asyncio.FIRST_COMPLETED)

    if service.guard.poisoned:
        # In-flight requests were answered with 500 and new ones get 500 at once.
        return await service.guard.linger(settings.poison_linger_s, stop_task)

    # For good: no drain deadline and no control lift ends the shutdown's drain.
    service.guard.drain.begin_shutdown()
    if service.started:
        sched = service.engine
        deadline = loop.time() + settings.shutdown_grace_s
        log.info("shutdown_drain", inflight=sched.inflight, queued=sched.queued, grace_s=settings.shutdown_grace_s)
        while (sched.inflight or sched.queued) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        log.info("shutdown", inflight_left=sched.inflight)
    if watch_task is not None:
        watch_task.cancel()
    await public.cleanup()
    await control.cleanup()
    return 0


def run(settings: ServeSettings) -> int:
    """Serve until SIGTERM; the caller configured logging (structlog) once, at the entry point."""
    try:
        if settings.workers > 1:
            from gpu_watchdog.inference.front import serve_workers

            code = asyncio.run(serve_workers(settings))
        else:
            code = asyncio.run(_serve(settings))
    except SettingsError as exc:
        print(f"gpu-watchdog serve: {exc}", file=sys.stderr)
        code = 2
    except TokenError as exc:
        print(f"gpu-watchdog serve: {exc}", file=sys.stderr)
        code = 2
    except OSError as exc:
        print(f"gpu-watchdog serve: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        code = 2
    leave(code)
