"""The canary: a real one-token inference, through the control API or any OpenAI-compatible server.

Every canary (these two, and `http_canary.HttpCanary` for any HTTP model server) answers to
`Canary` and reports the same `CanarySample`; config chooses one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from gpu_watchdog import contract, logs
from gpu_watchdog.watchdog.core.samples import CanarySample
from gpu_watchdog.watchdog.edge.control_client import ControlClient, ControlError
from gpu_watchdog.watchdog.edge.samplers.http_body import read_capped

log = logs.get("watchdog.canary")

CONTROL_ROUTE = contract.CANARY
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
ANSWER_BYTES = 1 << 20  # a one-token answer or a model list is kilobytes


class Canary(Protocol):
    route: str

    async def sample(self) -> CanarySample: ...
    def describe(self) -> dict[str, Any]: ...
    def forget(self) -> None:
        """After a restart: drop what was learnt about the old process."""


def read_api_key(path: str | None) -> str | None:
    """The target server's API key. Not token.read_token: GPU_WATCHDOG_TOKEN is the control
    API's token, and must never be sent to another server as its key."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8").strip() or None
    except OSError as exc:
        log.warning("api_key_unreadable", file=path, error=exc.strerror or str(exc))
        return None


class CanarySampler:
    """The bundled server's canary: `POST /control/canary`, on a slot reserved for it."""

    def __init__(self, client: ControlClient, clock: Callable[[], float], timeout: float) -> None:
        self.client = client
        self.clock = clock
        self.timeout = timeout
        self.route = CONTROL_ROUTE

    def describe(self) -> dict[str, Any]:
        return {"route": self.route}

    def forget(self) -> None:
        """After a restart: nothing learnt about the old process to drop."""

    async def sample(self) -> CanarySample:
        start = self.clock()
        try:
            data = await self.client.canary(self.timeout)
        except ControlError as exc:
            # Our own HTTP timeout firing means the server did not answer at all: a hang.
            cls = "timeout" if exc.kind == "timeout" else "unreachable" if exc.kind == "unreachable" else "other"
            return CanarySample(at=self.clock(), ok=False, latency_s=self.clock() - start, error_class=cls,
                                error=str(exc)[:300], route=self.route)
        try:
            result, instance, draining = contract.CanaryResult.parse(data)
        except ValueError as exc:
            return CanarySample(at=self.clock(), ok=False, latency_s=self.clock() - start, error_class="other",
                                error=str(exc), route=self.route)
        return CanarySample(at=self.clock(), ok=result.ok, latency_s=result.latency_s,
                            error_class=None if result.ok else result.error_class,
                            error=None if result.ok else str(result.error)[:300],
                            instance_id=instance, route=self.route, draining=draining)


def api_base(url: str) -> str:
    """`http://h:p`, `http://h:p/`, `http://h:p/v1` and `http://h:p/v1/` all mean the same server."""
    return re.sub(r"/v1/?$", "", url.rstrip("/"))


class OpenAICanary:
    """A `max_tokens: 1`, temperature 0 request to any OpenAI-compatible server (vLLM, TGI, SGLang, ...).

    Learns what it needs from the server: the model (first id of `GET /v1/models` unless
    configured; asked again after a restart or when the server no longer knows it) and the route
    (`/v1/completions`, or `/v1/chat/completions` for a server that serves only chat).
    """

    def __init__(self, url: str, model: str | None, api_key_file: str | None, session: aiohttp.ClientSession,
                 clock: Callable[[], float], timeout: float) -> None:
        self.base = api_base(url)
        self.configured_model = model
        self.model = model
        self.api_key_file = api_key_file
        self.session = session
        self.clock = clock
        self.timeout = timeout
        self.route = COMPLETIONS
        self._api_key = self._read_key()

    def describe(self) -> dict[str, Any]:
        return {"route": self.route, "base_url": self.base, "model": self.model,
                "model_discovered": self.configured_model is None and self.model is not None}

    def forget(self) -> None:
        if self.configured_model is None:
            self.model = None

    def _read_key(self) -> str | None:
        return read_api_key(self.api_key_file)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    async def sample(self) -> CanarySample:
        start = self.clock()
        ok, cls, error = await self._probe(start)
        return CanarySample(at=self.clock(), ok=ok, latency_s=self.clock() - start, error_class=cls,
                            error=None if ok else error, route=self.route)

    def _left(self, start: float) -> float:
        return max(0.05, self.timeout - (self.clock() - start))

    async def _probe(self, start: float) -> tuple[bool, str | None, str | None]:
        if self.model is None:
            failure = await self._discover(start)
            if failure is not None:
                return failure
        status, text = await self._post(self.route, start)
        if status is None:
            return False, text[0], text[1]
        if status == 200:
            return True, None, None
        body = text[1] or ""
        if status == 401 and self.api_key_file is not None:
            self._api_key = self._read_key()  # the key may have been rotated
        if status == 404 and self.configured_model is None and "model" in body.lower():
            self.model = None  # the server was restarted with another model: ask again next time
        if self.route == COMPLETIONS and status in (400, 404, 405, 501):
            # A server that serves only chat, or only embedding models (vLLM's pooling runner, ours
            # with the embeddings handler); if those fail too, the completions answer is reported.
            for route in (CHAT, EMBEDDINGS):
                other_status, _ = await self._post(route, start)
                if other_status == 200:
                    log.info("canary_route", route=route, because=f"{COMPLETIONS} answered {status}")
                    self.route = route
                    return True, None, None
        return False, classify(status, body), f"{status}: {body[:300]}"

    async def _discover(self, start: float) -> tuple[bool, str | None, str | None] | None:
        status, text = await self._request("GET", "/v1/models", None, start)
        if status is None:
            return False, text[0], text[1]
        if status != 200:
            log.warning("model_discovery_failed", status=status, body=(text[1] or "")[:200])
            return None  # many servers take a request without a model: try it
        try:
            data = json.loads(text[1] or "")
            model = data["data"][0]["id"]
            if not isinstance(model, str) or not model:
                raise ValueError("empty id")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            log.warning("model_discovery_failed", error=f"bad /v1/models answer: {exc}")
            return None
        self.model = model
        log.info("model_discovered", model=model, base_url=self.base)
        return None

    def _body(self, route: str) -> dict[str, Any]:
        if route == EMBEDDINGS:
            return {"input": "ping", **({"model": self.model} if self.model else {})}
        body: dict[str, Any] = {"max_tokens": 1, "temperature": 0}
        if route == CHAT:
            body["messages"] = [{"role": "user", "content": "ping"}]
        else:
            body["prompt"] = "ping"
        if self.model:
            body["model"] = self.model
        return body

    async def _post(self, route: str, start: float) -> tuple[int | None, tuple[str | None, str | None]]:
        return await self._request("POST", route, self._body(route), start)

    async def _request(self, method: str, path: str, body: dict[str, Any] | None,
                       start: float) -> tuple[int | None, tuple[str | None, str | None]]:
        """(status, (None, text)) for an answer; (None, (error_class, error)) for none."""
        left = self._left(start)
        try:
            async with self.session.request(method, self.base + path, json=body, headers=self.headers(),
                                            timeout=aiohttp.ClientTimeout(total=left)) as resp:
                text = (await read_capped(resp, ANSWER_BYTES)).decode("utf-8", errors="replace")
                return resp.status, (None, text)
        except TimeoutError:
            return None, ("timeout", f"no answer within {self.timeout:g}s ({method} {path})")
        except aiohttp.ClientError as exc:
            return None, ("unreachable", f"{method} {path}: {exc}"[:300])


def classify(status: int, body: str) -> str:
    lowered = body.lower()
    if "out of memory" in lowered:
        return "oom"
    if status >= 500 and ("cuda error" in lowered or "illegal memory access" in lowered or "fatal_cuda" in lowered):
        return "fatal_cuda"
    return "other"
