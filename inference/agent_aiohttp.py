"""The agent in an aiohttp app: `install(app, agent)`, one line.

Adds the `gpu_inference_` request metrics, `GET /metrics`, the answers of `serve` for
admission, OOM and poison errors, and starts and stops the agent with the app.
"""

from __future__ import annotations

import time

from aiohttp import web

from inference.agent import METRICS_CONTENT_TYPE, Agent
from inference.errors import AdmissionTimeout, Draining, FatalCudaError, InferenceOOM, QueueFull
from inference.http_control import Handler
from inference.http_public import error_response

ANSWERED = (AdmissionTimeout, QueueFull, Draining, InferenceOOM, FatalCudaError)


def install(app: web.Application, agent: Agent, metrics_path: str = "/metrics") -> None:
    retry_after = agent.settings.retry_after_s

    @web.middleware
    async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == metrics_path:
            # Scrapes are not requests: counted, they would pass for progress while the model hangs.
            return await handler(request)
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except ANSWERED as exc:
            answer = error_response(exc, retry_after)
            status = answer.status
            return answer
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
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
