"""Torch allocator figures from the inference process's `GET /control/memory`."""

from __future__ import annotations

from collections.abc import Callable

from gpu_watchdog.contract import MemoryReport
from gpu_watchdog.watchdog.core.samples import TorchSample
from gpu_watchdog.watchdog.edge.control_client import ControlClient, ControlError


def parse_memory(data: object, at: float) -> TorchSample:
    """The control API's answer as a sample; garbage raises ValueError naming the field, never crashes later."""
    r = MemoryReport.parse(data)
    return TorchSample(
        at=at, reachable=True, device=r.device, uuid=r.uuid,
        total_bytes=r.total_bytes, allocated_bytes=r.allocated_bytes, reserved_bytes=r.reserved_bytes,
        active_bytes=r.active_bytes, inactive_split_bytes=r.inactive_split_bytes, alloc_retries=r.alloc_retries,
        ooms=max(r.num_ooms, r.ooms_caught), fragmentation_ratio=r.fragmentation_ratio, injected=r.injected,
        uptime_s=r.uptime_s, poisoned=r.poisoned, poison_reason=r.poison_reason,
        instance_id=r.instance_id, inflight=r.inflight, queued=r.queued,
        admission_limit=r.admission.limit, admission_mode=r.admission.mode,
    )


class AllocatorSampler:
    def __init__(self, client: ControlClient, clock: Callable[[], float]) -> None:
        self.client = client
        self.clock = clock

    async def sample(self) -> TorchSample:
        try:
            data = await self.client.memory()
        except ControlError as exc:
            return TorchSample(at=self.clock(), reachable=False, error=f"{exc.kind}: {exc}")
        try:
            return parse_memory(data, self.clock())
        except ValueError as exc:
            return TorchSample(at=self.clock(), reachable=False, error=f"bad_response: {exc}")
