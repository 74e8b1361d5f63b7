"""A service with the in-process agent whose own code fails with messages that read like CUDA trouble.

    python tests/integration/hostile_agent_app.py --framework fastapi|aiohttp --port P --control-port C

`GET /names/{name}` looks a name up inside `agent.admit()` and raises `KeyError(f"no such name: {name}")`
for an unknown one; `POST /raise {"kind", "message"}` raises the app's exception of that kind inside
`admit()` (thread or coroutine) or `agent.guard()`; `GET /ok` is served normally.

`--fault-injection` turns on the agent's `POST /control/fault`; `--exit-never-answers` makes its
`POST /control/exit` never answer (a worker wedged past its control API).
"""

from __future__ import annotations

import argparse
from typing import Any

KNOWN = {"alice": "ok"}


class LookupFailed(RuntimeError):
    """The app's own exception class."""


KINDS: dict[str, type[Exception]] = {"key": KeyError, "value": ValueError, "own": LookupFailed,
                                     "runtime": RuntimeError}


def fail(body: dict[str, Any]) -> None:
    raise KINDS[str(body["kind"])](str(body["message"]))


def lookup(name: str) -> str:
    if name not in KNOWN:
        raise KeyError(f"no such name: {name}")
    return KNOWN[name]


def fastapi_app(agent: Any) -> Any:
    from fastapi import FastAPI

    from gpu_watchdog.inference.agent_asgi import install

    app = FastAPI()
    install(app, agent)

    @app.get("/names/{name}")
    def name(name: str) -> dict[str, str]:
        with agent.admit():
            return {"value": lookup(name)}

    @app.post("/raise")
    async def raise_(body: dict[str, Any]) -> dict[str, str]:
        where = body.get("where", "admit")
        if where == "async":
            async with agent.admit():
                fail(body)
        elif where == "guard":
            with agent.guard():
                fail(body)
        else:
            with agent.admit():
                fail(body)
        return {}

    @app.get("/ok")
    def ok() -> dict[str, bool]:
        with agent.admit():
            return {"ok": True}

    return app


def aiohttp_app(agent: Any) -> Any:
    from aiohttp import web

    from gpu_watchdog.inference.agent_aiohttp import install

    async def name(request: web.Request) -> web.Response:
        async with agent.admit():
            return web.json_response({"value": lookup(request.match_info["name"])})

    async def raise_(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("where") == "guard":
            with agent.guard():
                fail(body)
        async with agent.admit():
            fail(body)
        return web.json_response({})

    async def ok(request: web.Request) -> web.Response:
        async with agent.admit():
            return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/names/{name}", name)
    app.router.add_post("/raise", raise_)
    app.router.add_get("/ok", ok)
    install(app, agent)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=("fastapi", "aiohttp"), default="fastapi")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--control-port", type=int, required=True)
    p.add_argument("--fault-injection", action="store_true")
    p.add_argument("--exit-never-answers", action="store_true")
    args = p.parse_args()

    from gpu_watchdog.inference.agent import Agent, AgentSettings

    if args.exit_never_answers:
        import asyncio

        from gpu_watchdog.inference.http_control import ControlAPI

        async def never(self: Any, request: Any) -> Any:
            await asyncio.Event().wait()

        ControlAPI.exit = never  # type: ignore[method-assign]
    agent = Agent(AgentSettings(limit=2, control_port=args.control_port, device="cpu",
                                fault_injection=args.fault_injection))
    agent.register_canary(lambda: None)
    if args.framework == "fastapi":
        import uvicorn

        agent.start()
        uvicorn.run(fastapi_app(agent), host="127.0.0.1", port=args.port, log_level="warning")
    else:
        from aiohttp import web

        web.run_app(aiohttp_app(agent), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
