"""The agent in an aiohttp app: `install(app, agent)`, one line.

Adds the `gpu_inference_` request metrics, `GET /metrics`, the answers of `serve` for
admission, OOM and poison errors, and starts and stops the agent with the app.
"""

from __future__ import annotations

import time

from aiohttp import web

from gpu_watchdog.inference.agent import METRICS_CONTENT_TYPE, Agent
from gpu_watchdog.inference.errors import AdmissionTimeout, Draining, FatalCudaError, InferenceOOM, QueueFull
from gpu_watchdog.inference.http_errors import Route, error_response
from gpu_watchdog.inference.screen import MARKED, SCREEN_MAX_BYTES, QuarantinedRequest, RequestAccount

ANSWERED = (AdmissionTimeout, QueueFull, Draining, InferenceOOM, FatalCudaError)
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def install(app: web.Application, agent: Agent, metrics_path: str = "/metrics") -> None:
    retry_after = agent.settings.retry_after_s

    @web.middleware
    async def observe(request: web.Request, handler: Route) -> web.StreamResponse:
        if request.path == metrics_path:
            # Scrapes are not requests: counted, they would pass for progress while the model hangs.
            return await handler(request)
        start = time.perf_counter()
        status = 500
        account = RequestAccount()
        # One connection's requests run in one task: no request's fault marks carry over to the next.
        marked = MARKED.set(frozenset())
        try:
            length = request.content_length
            if (request.method in BODY_METHODS and request.can_read_body and length is not None
                    and length <= SCREEN_MAX_BYTES and not request.content_type.startswith("multipart/")):
                # Read once here; aiohttp keeps it for the handler's own read (a multipart or
                # streamed body is the handler's to read as it comes: not screened).
                agent.screen_body(account, await request.read())
            response = await handler(request)
            status = response.status
            return response
        except QuarantinedRequest as exc:
            status = exc.status
            return web.json_response(exc.body(), status=status)
        except ANSWERED as exc:
            answer = error_response(exc, retry_after)
            status = answer.status
            return answer
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            MARKED.reset(marked)
            agent.request_done(account, status)
            resource = request.match_info.route.resource
            # The template, not the path: a scan of random paths must not grow the label set.
            route = resource.canonical if resource is not None else "other"
            agent.observe(route, status, time.perf_counter() - start)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=agent.metrics_page(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def start(app: web.Application) -> None:
        agent.start()

    async def stop(app: web.Application) -> None:
        agent.stop()

    app.middlewares.append(observe)
    app.router.add_get(metrics_path, metrics)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
