"""A small OpenAI-style model server: a real process that answers at once, or hangs like a stuck engine.

    python -m tests.fleet.model_server --port P [--hang-after N]

- `GET /v1/models` -> `{"data": [{"id": "m"}]}`; `GET /health` -> 200 (also while hung, as vLLM's does).
- `POST /v1/completions` (and `/v1/chat/completions`) -> `{"choices": [{"text": "x"}]}` at once.
- `POST /fault {"kind": "hang"}`: every completion from then on gets no answer, its socket held open
  (a hung engine); `{"kind": "error"}`: completions answer 500; `{"kind": "clear"}`: serves again
  (completions held by a hang are answered then).
- `--hang-after N`: hangs by itself after N answered completions (a replacement that comes back
  failing the same way).
- A completion asking `logprobs: K` answers its tokens with log-probabilities, the same for a prompt
  on every healthy server (a greedy model whose first tokens lead by a wide margin); `--corrupt`:
  a card that computes wrong, its first token another one, as confident.
- `GET /stats`: what it served, for assertions.

Prints one JSON line (`{"event": "listening", ...}`) once it listens. Imports nothing heavy, so it
starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MODEL = "m"
FAULTS = ("hang", "error", "clear")


@dataclass
class Engine:
    """What the server is doing: serving, hung or failing. `hang_after`: answered completions before
    it hangs by itself (None: never)."""

    hang_after: int | None = None
    corrupt: bool = False
    fault: str | None = None
    answered: int = 0
    held: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def set_fault(self, kind: str) -> None:
        if kind == "clear":
            self.fault = None
            self.hang_after = None  # cleared for good: the self-inflicted hang must not come back
            self.released.set()
            self.released = asyncio.Event()
        else:
            self.fault = kind

    def hung(self) -> bool:
        return self.fault == "hang" or (self.hang_after is not None and self.answered >= self.hang_after)

    def stats(self) -> dict[str, Any]:
        return {"answered": self.answered, "held": self.held, "hung": self.hung(), "fault": self.fault,
                "hang_after": self.hang_after}


def build_app(engine: Engine) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completion(request: web.Request) -> web.Response:
        raw = await request.read()
        if engine.hung():
            engine.held += 1
            released = engine.released
            try:
                await released.wait()  # a stuck engine: the request stays open, nothing comes back
            finally:
                engine.held -= 1
        if engine.fault == "error":
            return web.json_response({"error": {"message": "engine failed", "type": "server_error"}}, status=500)
        engine.answered += 1
        body = json.loads(raw or b"{}")
        choice: dict[str, Any] = {"index": 0, "text": "x", "finish_reason": "length"}
        if isinstance(body, dict) and body.get("logprobs"):
            choice = answer(str(body.get("prompt", "")), int(body.get("max_tokens") or 1), engine.corrupt)
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                                  "choices": [choice]})

    async def fault(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            kind = body["kind"]
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": 'expected {"kind": "hang" | "error" | "clear"}'}, status=400)
        if kind not in FAULTS:
            return web.json_response({"error": f"unknown fault kind {kind!r}; one of {', '.join(FAULTS)}"},
                                     status=400)
        engine.set_fault(kind)
        return web.json_response(engine.stats())

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(engine.stats())

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_post("/fault", fault)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    return app


def answer(prompt: str, n: int, corrupt: bool) -> dict[str, Any]:
    """A greedy answer with log-probabilities: the prompt's letters in turn, each 4 nats ahead of the next."""
    letters = [c for c in prompt.lower() if c.isalpha()] or ["a"]
    tokens = [f" {letters[i % len(letters)]}" for i in range(n)]
    if corrupt:
        tokens[0] = " #"
    top = [{t: -0.02, " ~": -4.02} for t in tokens]
    return {"index": 0, "text": "".join(tokens), "finish_reason": "length",
            "logprobs": {"tokens": tokens, "token_logprobs": [-0.02] * n, "top_logprobs": top}}


async def serve(host: str, port: int, hang_after: int | None, corrupt: bool = False) -> None:
    engine = Engine(hang_after=hang_after, corrupt=corrupt)
    # Requests held by a hang must not keep a SIGTERM waiting: the kubelet's stop is immediate here.
    runner = web.AppRunner(build_app(engine), shutdown_timeout=0.1, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"event": "listening", "host": host, "port": port, "pid": os.getpid(),
                      "hang_after": hang_after}), flush=True)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fleet.model_server", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--hang-after", type=int, default=None, metavar="N",
                        help="hang by itself after N answered completions")
    parser.add_argument("--corrupt", action="store_true", help="answer probes wrong (a card that computes wrong)")
    args = parser.parse_args(argv)
    if args.hang_after is not None and args.hang_after < 0:
        parser.error(f"--hang-after must be 0 or more, not {args.hang_after}")
    asyncio.run(serve(args.host, args.port, args.hang_after, args.corrupt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
