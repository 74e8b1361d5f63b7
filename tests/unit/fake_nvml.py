"""A stand-in NVML device behind the sampler's backend interface, two GPUs whose figures a test sets.
No GPU is needed to test the NVML sampler here, nor the driver's word and the pod's GPUs in
tests/integration, which drive the same stand-in."""

from __future__ import annotations

import time

from gpu_watchdog.watchdog.edge.samplers.nvml import GpuLost, GpuReading, NvmlUnavailable

A = "GPU-11111111-aaaa"
B = "GPU-22222222-bbbb"


class FakeNvml:
    """Stands in for the hardware edge only; its figures are test inputs, not measurements."""

    def __init__(self) -> None:
        self.missing = False
        self.lost: set[str] = set()
        self.broken = False
        self.used = {A: 10 * 2**30, B: 1 * 2**30}
        self.xids: list[tuple[str | None, int]] = []
        self.closed = False
        self.visible = [A, B]
        self.recovery: dict[str, int] = {}  # NVML's recovery action per GPU; absent: a driver without the field

    def open(self) -> None:
        if self.missing:
            raise NvmlUnavailable("NVML Shared Library Not Found")

    def uuids(self) -> list[str]:
        return list(self.visible)

    def read(self, uuid: str) -> GpuReading:
        if self.broken:
            raise RuntimeError("unexpected NVML answer")
        if uuid in self.lost:
            raise GpuLost("GPU is lost")
        return GpuReading(index=[A, B].index(uuid), uuid=uuid, name="Fake H100", memory_used_bytes=self.used[uuid],
                          memory_total_bytes=80 * 2**30, utilization_percent=42.0, temperature_celsius=61.0,
                          power_milliwatts=312_500.0, ecc_uncorrected=0)

    def wait_xid(self, timeout_ms: int) -> list[tuple[str | None, int]]:
        if self.xids:
            out, self.xids = self.xids, []
            return out
        time.sleep(timeout_ms / 1000 / 10)
        return []

    def recovery_action(self, uuid: str) -> int | None:
        return self.recovery.get(uuid)

    def close(self) -> None:
        self.closed = True
