"""HTTP client of the inference process's control API."""

from __future__ import annotations

from typing import Any

import aiohttp

from gpu_watchdog import contract


class ControlError(Exception):
    """The control API could not be reached or answered something unusable."""

    def __init__(self, message: str, kind: str = "unreachable") -> None:
        super().__init__(message)
        self.kind = kind  # unreachable | timeout | bad_response | unauthorized


class ControlClient:
    def __init__(self, base_url: str, token: str | None, session: aiohttp.ClientSession) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._session = session

    def set_token(self, token: str | None) -> None:
        self._token = token

    async def call(self, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        """Any control route: its JSON object, or ControlError (kind: unauthorized, timeout, ...)."""
        return await self._call(method, path, body, timeout)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None, timeout: float,
                    query: dict[str, str] | None = None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        try:
            async with self._session.request(
                method, self.base_url + path, json=body, headers=headers, params=query,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                if resp.status == 401:
                    raise ControlError("control API rejected the token (401)", "unauthorized")
                text = await resp.text()
                if resp.status == 409:
                    raise ControlError(f"{method} {path} answered 409: {text[:200]}", "conflict")
                if resp.status >= 400:
                    raise ControlError(f"{method} {path} answered {resp.status}: {text[:200]}", "bad_response")
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    raise ControlError(f"{method} {path} answered non-JSON: {text[:200]!r}", "bad_response") from None
        except TimeoutError:
            raise ControlError(f"{method} {path} timed out after {timeout:g}s", "timeout") from None
        except aiohttp.ClientError as exc:
            raise ControlError(f"{method} {path}: {exc}", "unreachable") from None
        if not isinstance(data, dict):
            raise ControlError(f"{method} {path} answered {type(data).__name__}, expected an object", "bad_response")
        return data

    async def memory(self, timeout: float = 5.0) -> dict[str, Any]:
        return await self._call("GET", contract.MEMORY, None, timeout)

    async def empty_cache(self, timeout: float = 30.0) -> dict[str, Any]:
        return await self._call("POST", contract.EMPTY_CACHE, {}, timeout)

    async def canary(self, timeout: float) -> dict[str, Any]:
        # The server bounds the generation by `timeout`; the HTTP call gets a margin on top.
        return await self._call("POST", contract.CANARY, {"timeout": timeout}, timeout + 2.0)

    async def set_admission(self, limit: int, timeout: float = 10.0) -> dict[str, Any]:
        return await self._call("POST", contract.ADMISSION, {"limit": limit}, timeout)

    async def drain(self, timeout: float, deadline: float | None = None) -> dict[str, Any]:
        """Stop admission and wait up to `timeout` s for in-flight work; the server lifts the drain
        by itself `deadline` s from now (its default, `contract.DRAIN_DEADLINE_DEFAULT_S`, when None)."""
        body: dict[str, Any] = {"timeout": timeout}
        if deadline is not None:
            body["deadline"] = deadline
        return await self._call("POST", contract.DRAIN, body, timeout + 5.0)

    async def undrain(self, timeout: float = 10.0) -> dict[str, Any]:
        """Lift the drain now (`DELETE /control/drain`; lifting none is not an error)."""
        return await self._call("DELETE", contract.DRAIN, None, timeout)

    async def exit(self, reason: str, instance_id: str | None = None, timeout: float = 5.0) -> dict[str, Any]:
        """The worker rung: the process exits (code 75) and its server starts it again; `instance_id`:
        only if it is still that process (409 otherwise)."""
        body: dict[str, Any] = {"reason": reason}
        if instance_id is not None:
            body["instance_id"] = instance_id
        return await self._call("POST", contract.EXIT, body, timeout)

    async def stacks(self, reason: str, timeout: float = 5.0) -> dict[str, Any]:
        """Every thread's stack and where the process is stuck, also written to its termination log."""
        return await self._call("POST", contract.STACKS, {"reason": reason}, timeout)

    async def requests(self, timeout: float = 3.0, evidence: bool = False) -> dict[str, Any]:
        """The fingerprints in flight, and those in flight when the context was lost (`at_failure`).
        `evidence`: this read takes the failure's evidence (a poisoned server waits for it to exit)."""
        return await self._call("GET", contract.REQUESTS, None, timeout,
                                {contract.REQUESTS_EVIDENCE: "1"} if evidence else None)

    async def quarantine(self, timeout: float = 3.0) -> dict[str, Any]:
        return await self._call("GET", contract.QUARANTINE, None, timeout)

    async def set_quarantine(self, entries: list[dict[str, Any]], timeout: float = 3.0) -> dict[str, Any]:
        """The server's whole quarantine list replaced (`PUT /control/quarantine`)."""
        return await self._call("PUT", contract.QUARANTINE, {"entries": entries}, timeout)
