"""The service's other workers (`serve --workers N`, the agent under `uvicorn --workers N`,
gunicorn's workers): each answers its control API on the next port from the watched one's; its
memory is shown as it answers, and its own canary tells a hung worker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from yarl import URL

from gpu_watchdog.watchdog.core.samples import WorkerCanaries, WorkerSample, WorkersSample
from gpu_watchdog.watchdog.edge.control_client import ControlClient
from gpu_watchdog.watchdog.edge.samplers.allocator import AllocatorSampler
from gpu_watchdog.watchdog.edge.samplers.canary import CanarySampler


def worker_url(control_url: str, worker: int) -> str:
    """Worker k's control API: the k-th port from the first's (the agent binds them in turn)."""
    url = URL(control_url)
    return str(url.with_port((url.port or 80) + worker))


class WorkersSampler:
    def __init__(self, control_url: str, workers: int, token: str | None, session: aiohttp.ClientSession,
                 clock: Callable[[], float], canary_timeout: float = 10.0) -> None:
        """Workers 1 .. workers - 1; worker 0 is the target the other samplers watch."""
        self.clock = clock
        self.canary_timeout = canary_timeout
        self.clients = [(k, worker_url(control_url, k), ControlClient(worker_url(control_url, k), token, session))
                        for k in range(1, workers)]

    def set_token(self, token: str | None) -> None:
        for _, _, client in self.clients:
            client.set_token(token)

    async def sample(self) -> WorkersSample:
        read = await asyncio.gather(*(AllocatorSampler(client, self.clock).sample() for _, _, client in self.clients))
        return WorkersSample(self.clock(), tuple(WorkerSample(k, url, memory)
                                                 for (k, url, _), memory in zip(self.clients, read, strict=True)))

    def client(self, worker: int) -> ControlClient:
        return next(client for k, _, client in self.clients if k == worker)

    async def canaries(self) -> WorkerCanaries:
        samples = await asyncio.gather(*(CanarySampler(client, self.clock, self.canary_timeout).sample()
                                         for _, _, client in self.clients))
        return WorkerCanaries(self.clock(), tuple((k, c) for (k, _, _), c in zip(self.clients, samples, strict=True)))
