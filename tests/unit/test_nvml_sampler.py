"""The NVML sampler against a stand-in device behind the backend interface (no GPU here)."""

from __future__ import annotations

import threading
import time

from watchdog.samplers.nvml import GpuLost, GpuReading, NvmlSampler, NvmlUnavailable, PynvmlBackend
from watchdog.samples import XidEvent

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

    def open(self) -> None:
        if self.missing:
            raise NvmlUnavailable("NVML Shared Library Not Found")

    def uuids(self) -> list[str]:
        return [A, B]

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

    def close(self) -> None:
        self.closed = True


async def test_reads_the_gpu_the_inference_process_reports() -> None:
    fake = FakeNvml()
    s = NvmlSampler(fake, clock=lambda: 7.0)
    s.open()
    g = await s.sample(B)
    assert (g.available, g.uuid, g.index, g.memory_used_bytes) == (True, B, 1, 2**30)
    assert g.utilization_ratio == 0.42 and g.power_watts == 312.5
    g = await s.sample(None)  # unknown: the first visible GPU
    assert g.uuid == A and g.at == 7.0


async def test_library_missing_is_a_state_not_a_crash() -> None:
    fake = FakeNvml()
    fake.missing = True
    s = NvmlSampler(fake, clock=lambda: 1.0)
    s.open()
    g = await s.sample(A)
    assert g.available is False and "Not Found" in (g.reason or "")
    assert s.available is False


async def test_gpu_lost_and_unexpected_errors() -> None:
    fake = FakeNvml()
    s = NvmlSampler(fake, clock=lambda: 1.0)
    s.open()
    fake.lost.add(A)
    assert (await s.sample(A)).lost is True
    fake.broken = True
    g = await s.sample(B)
    assert g.available is False and "unexpected" in (g.reason or "")


def test_xid_events_are_delivered_from_the_waiting_thread() -> None:
    fake = FakeNvml()
    s = NvmlSampler(fake, clock=lambda: 3.0)
    s.open()
    got: list[XidEvent] = []
    done = threading.Event()

    def deliver(ev: XidEvent) -> None:
        got.append(ev)
        done.set()

    fake.xids = [(A, 79)]
    s.start_xid_watch(deliver)
    assert done.wait(5)
    s.close()
    assert got == [XidEvent(at=3.0, xid=79, uuid=A)]
    assert fake.closed


def test_real_backend_reports_no_driver_here() -> None:
    backend = PynvmlBackend()
    try:
        backend.open()
    except NvmlUnavailable as exc:
        assert str(exc)
    else:  # pragma: no cover - only on a machine with a GPU driver
        assert backend.uuids()
        backend.close()
