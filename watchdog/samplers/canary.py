"""The canary: a real one-token inference, through the control API or any OpenAI-compatible server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

from watchdog.control_client import ControlClient, ControlError, openai_canary
from watchdog.samples import CanarySample

ERROR_CLASSES = ("oom", "fatal_cuda", "timeout", "other", "unreachable")


class CanarySampler:
    def __init__(
        self,
        clock: Callable[[], float],
        timeout: float,
        client: ControlClient | None = None,
        session: aiohttp.ClientSession | None = None,
        openai_url: str | None = None,
        openai_model: str | None = None,
    ) -> None:
        self.clock = clock
        self.timeout = timeout
        self.client = client
        self.session = session
        self.openai_url = openai_url
        self.openai_model = openai_model

    async def sample(self) -> CanarySample:
        start = self.clock()
        if self.openai_url is not None:
            assert self.session is not None
            ok, error_class, error = await openai_canary(self.session, self.openai_url, self.openai_model,
                                                         self.timeout)
            return CanarySample(at=self.clock(), ok=ok, latency_s=self.clock() - start, error_class=error_class,
                                error=error)
        assert self.client is not None
        try:
            data = await self.client.canary(self.timeout)
        except ControlError as exc:
            # Our own HTTP timeout firing means the server did not answer at all: a hang.
            cls = "timeout" if exc.kind == "timeout" else "unreachable" if exc.kind == "unreachable" else "other"
            return CanarySample(at=self.clock(), ok=False, latency_s=self.clock() - start, error_class=cls,
                                error=str(exc)[:300])
        answered_ok: Any = data.get("ok")
        error_class = data.get("error_class")
        latency = data.get("latency_s")
        if not isinstance(answered_ok, bool) or (error_class is not None and error_class not in ERROR_CLASSES) \
                or isinstance(latency, bool) or not isinstance(latency, int | float):
            return CanarySample(at=self.clock(), ok=False, latency_s=self.clock() - start, error_class="other",
                                error=f"bad canary answer: {str(data)[:200]}")
        instance = data.get("instance_id")
        return CanarySample(at=self.clock(), ok=answered_ok, latency_s=float(latency),
                            error_class=None if answered_ok else error_class,
                            error=None if answered_ok else str(data.get("error"))[:300],
                            instance_id=instance if isinstance(instance, str) else None)
