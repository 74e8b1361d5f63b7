"""The canary for any HTTP model server (`target.http`): one configured request, judged by status and key.

Triton and KServe v2 (`/v2/models/{m}/infer`), TorchServe (`/predictions/{m}`), LitServe
(`/predict`), text-embeddings-inference (`/embed`) or one's own `/predict`: the request is the
user's, the verdict the same `CanarySample` as every other canary. No answer within the timeout
is a `timeout` (three make a hang); a refused connection is `unreachable` (the process is gone
and the kubelet restarts it: never a hang).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp
from yarl import URL

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core.samples import CanarySample
from gpu_watchdog.watchdog.core.settings import HttpTargetSettings
from gpu_watchdog.watchdog.edge.samplers.canary import ANSWER_BYTES, classify, read_api_key
from gpu_watchdog.watchdog.edge.samplers.http_body import read_capped

log = logs.get("watchdog.canary")

_MISSING = object()


def lookup(data: Any, path: str) -> Any:
    """The value at a key path (`outputs.0.data`: keys of objects, indexes of lists), or _MISSING."""
    for part in path.split("."):
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.lstrip("-").isdigit() and -len(data) <= int(part) < len(data):
            data = data[int(part)]
        else:
            return _MISSING
    return data


class HttpCanary:
    def __init__(self, settings: HttpTargetSettings, session: aiohttp.ClientSession, clock: Callable[[], float],
                 timeout: float, api_key_file: str | None = None) -> None:
        self.settings = settings
        # The request's own key file, else the target's (where the chart mounts a server's key).
        self.api_key_file = settings.api_key_file or api_key_file
        self.session = session
        self.clock = clock
        self.timeout = timeout
        self.route = URL(settings.url).path or "/"
        self._body: bytes | None = None
        if settings.body_file is not None:
            with open(settings.body_file, "rb") as fh:  # checked at config load; read once
                self._body = fh.read()
        elif settings.body is not None:
            self._body = json.dumps(settings.body).encode()
        self._api_key = self._read_key()

    def describe(self) -> dict[str, Any]:
        return {"route": self.route, "url": self.settings.url, "method": self.settings.method,
                "expect_status": self.settings.expect_status, "expect_json": self.settings.expect_json}

    def forget(self) -> None:
        """After a restart: nothing learnt about the old process to drop."""

    def _read_key(self) -> str | None:
        return read_api_key(self.api_key_file)

    def headers(self) -> dict[str, str]:
        """What the metrics page needs too: the API key, nothing of the request's own."""
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def _request_headers(self) -> dict[str, str]:
        headers = dict(self.settings.headers)
        if self._body is not None and not any(k.lower() == "content-type" for k in headers):
            headers["Content-Type"] = "application/json"
        headers.update(self.headers())
        return headers

    async def sample(self) -> CanarySample:
        start = self.clock()
        ok, cls, error = await self._probe()
        return CanarySample(at=self.clock(), ok=ok, latency_s=self.clock() - start, error_class=cls,
                            error=None if ok else error, route=self.route)

    async def _probe(self) -> tuple[bool, str | None, str | None]:
        s = self.settings
        try:
            async with self.session.request(s.method, s.url, data=self._body, headers=self._request_headers(),
                                            timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                raw = await read_capped(resp, ANSWER_BYTES)
                status = resp.status
        except TimeoutError:
            return False, "timeout", f"no answer within {self.timeout:g}s ({s.method} {s.url})"
        except aiohttp.ClientError as exc:
            return False, "unreachable", f"{s.method} {s.url}: {exc}"[:300]
        text = raw.decode("utf-8", errors="replace")
        if status != s.expect_status:
            if status == 401 and self.api_key_file is not None:
                self._api_key = self._read_key()  # the key may have been rotated
            return False, classify(status, text), f"{status} (expected {s.expect_status}): {text[:300]}"
        if s.expect_json is None:
            return True, None, None
        try:
            data = json.loads(text)
        except ValueError:
            return False, "other", f"expected JSON with {s.expect_json}, got: {text[:200]!r}"
        if lookup(data, s.expect_json) is _MISSING:
            return False, "other", f"the answer has no {s.expect_json}: {text[:200]}"
        return True, None, None
