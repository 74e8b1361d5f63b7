"""The correctness probe's edge: a prompt answered greedily with its log-probabilities, by the bundled
server's control canary or any OpenAI-compatible completions route.

What comes back is an answer to compare (`correctness.Answer`), or why there is none. A server that
answers garbage is reported as unanswered, never taken for a verdict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from gpu_watchdog import contract
from gpu_watchdog.watchdog.core import correctness
from gpu_watchdog.watchdog.edge.control_client import ControlClient, ControlError
from gpu_watchdog.watchdog.edge.samplers.canary import ANSWER_BYTES, COMPLETIONS, OpenAICanary
from gpu_watchdog.watchdog.edge.samplers.http_body import read_capped


@dataclass(frozen=True)
class ProbeAnswer:
    answer: correctness.Answer | None
    error: str | None = None
    nonfinite: bool = False  # the server failed the step for NaN or infinite logits
    instance_id: str | None = None


class Prober(Protocol):
    async def ask(self, prompt: str, tokens: int, top: int) -> ProbeAnswer: ...
    async def model(self) -> str | None:
        """The model the answers are of (part of the reference's key)."""


class ControlProber:
    """`POST /control/canary {"probe": ...}`: on the canary's reserved slot, so a busy server answers."""

    def __init__(self, client: ControlClient, timeout: float) -> None:
        self.client = client
        self.timeout = timeout
        self._model: str | None = None

    async def model(self) -> str | None:
        if self._model is None:
            try:
                name = (await self.client.memory()).get("model")
            except ControlError:
                return None
            self._model = name if isinstance(name, str) and name else None
        return self._model

    async def ask(self, prompt: str, tokens: int, top: int) -> ProbeAnswer:
        body = {"timeout": self.timeout, "probe": {"prompt": prompt, "max_tokens": tokens, "top_logprobs": top}}
        try:
            data = await self.client.call("POST", contract.CANARY, body, self.timeout + 2.0)
            result, instance, _ = contract.CanaryResult.parse(data)
        except (ControlError, ValueError) as exc:
            return ProbeAnswer(None, str(exc)[:300])
        if not result.ok or result.answer is None:
            return ProbeAnswer(None, result.error or "the canary answered no probe", result.nonfinite, instance)
        try:
            return ProbeAnswer(correctness.from_control(correctness.probe_id(prompt), result.answer), None, False,
                               instance)
        except ValueError as exc:
            return ProbeAnswer(None, f"not a probe's answer: {exc}", False, instance)


class OpenAIProber:
    """A greedy completion with `logprobs` on the server the OpenAI canary watches (its model, its key)."""

    def __init__(self, canary: OpenAICanary, session: aiohttp.ClientSession, timeout: float) -> None:
        self.canary = canary
        self.session = session
        self.timeout = timeout

    async def model(self) -> str | None:
        return self.canary.model

    async def ask(self, prompt: str, tokens: int, top: int) -> ProbeAnswer:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "logprobs": top}
        if self.canary.model:
            body["model"] = self.canary.model
        try:
            async with self.session.post(self.canary.base + COMPLETIONS, json=body, headers=self.canary.headers(),
                                         timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                text = (await read_capped(resp, ANSWER_BYTES)).decode("utf-8", errors="replace")
                status = resp.status
        except TimeoutError:
            return ProbeAnswer(None, f"no answer within {self.timeout:g}s")
        except aiohttp.ClientError as exc:
            return ProbeAnswer(None, str(exc)[:300])
        try:
            data = json.loads(text)
        except ValueError:
            return ProbeAnswer(None, f"{status}: not JSON: {text[:200]!r}")
        if status != 200:
            kind = ((data.get("error") or {}).get("type") if isinstance(data, dict) else None) or ""
            return ProbeAnswer(None, f"{status}: {text[:300]}", kind == "nonfinite")
        try:
            choice = data["choices"][0]
            return ProbeAnswer(correctness.from_openai(correctness.probe_id(prompt), choice))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            return ProbeAnswer(None, f"not a completion: {str(exc)[:200]}")
