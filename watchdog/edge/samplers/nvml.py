"""GPU figures through NVML, behind a narrow interface so tests can stand in for the hardware."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core.samples import GpuReadout, GpuSample, XidEvent

log = logs.get("watchdog.nvml")


class NvmlUnavailable(Exception):
    """No NVML library or driver on this machine: a state to report, not a crash."""


class GpuLost(Exception):
    """The GPU fell off the bus or needs a reset."""


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_percent: float
    temperature_celsius: float
    power_milliwatts: float
    ecc_uncorrected: int
    driver: str = ""  # the driver's version: with the name, the device class answers are compared within


class NvmlBackend(Protocol):
    def open(self) -> None: ...

    def uuids(self) -> list[str]: ...

    def read(self, uuid: str) -> GpuReading: ...

    def wait_xid(self, timeout_ms: int) -> list[tuple[str | None, int]]: ...

    def recovery_action(self, uuid: str) -> int | None:
        """NVML's GPU recovery action for `uuid` (`xid_catalog.RECOVERY_ACTIONS`); None where the
        driver or the bindings have no such field."""
        ...

    def close(self) -> None: ...


class PynvmlBackend:
    """The real thing, via `nvidia-ml-py`."""

    def __init__(self) -> None:
        self._nv: Any = None
        self._events: Any = None

    def open(self) -> None:
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a base dependency
            raise NvmlUnavailable(f"nvidia-ml-py not installed: {exc}") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(str(exc)) from None
        self._nv = pynvml
        try:
            self._events = pynvml.nvmlEventSetCreate()
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                try:
                    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
                except pynvml.NVMLError as exc:
                    log.warning("xid_events_unsupported", index=i, error=str(exc))
        except pynvml.NVMLError as exc:
            log.warning("xid_events_unavailable", error=str(exc))
            self._events = None

    def uuids(self) -> list[str]:
        nv = self._nv
        return [str(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(i))) for i in range(nv.nvmlDeviceGetCount())]

    def read(self, uuid: str) -> GpuReading:
        nv = self._nv
        try:
            h = nv.nvmlDeviceGetHandleByUUID(uuid)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            util = _optional(lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu, 0)
            temp = _optional(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU), 0)
            power = _optional(lambda: nv.nvmlDeviceGetPowerUsage(h), 0)
            ecc = _optional(lambda: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC), 0)
            return GpuReading(
                index=int(nv.nvmlDeviceGetIndex(h)), uuid=uuid, name=str(nv.nvmlDeviceGetName(h)),
                memory_used_bytes=int(mem.used), memory_total_bytes=int(mem.total),
                utilization_percent=float(util), temperature_celsius=float(temp),
                power_milliwatts=float(power), ecc_uncorrected=int(ecc),
                driver=str(_optional(nv.nvmlSystemGetDriverVersion, "")),
            )
        except (nv.NVMLError_GpuIsLost, nv.NVMLError_ResetRequired) as exc:
            raise GpuLost(str(exc)) from None

    def wait_xid(self, timeout_ms: int) -> list[tuple[str | None, int]]:
        nv = self._nv
        if self._events is None:
            threading.Event().wait(timeout_ms / 1000.0)
            return []
        try:
            data = nv.nvmlEventSetWait_v2(self._events, timeout_ms)
        except nv.NVMLError_Timeout:
            return []
        uuid = None
        try:
            uuid = str(nv.nvmlDeviceGetUUID(data.device))
        except nv.NVMLError:
            pass
        return [(uuid, int(data.eventData))]

    def recovery_action(self, uuid: str) -> int | None:
        nv = self._nv
        # Releases of nvidia-ml-py older than the field have no constant for it.
        field_id = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None:
            return None
        try:
            [value] = nv.nvmlDeviceGetFieldValues(nv.nvmlDeviceGetHandleByUUID(uuid), [field_id])
        except (nv.NVMLError, AttributeError):  # NotSupported, or bindings without the function
            return None
        if value.nvmlReturn != nv.NVML_SUCCESS:
            return None  # a driver that does not know field 230 answers per field, not by raising
        return int(getattr(value.value, _FIELD_VALUE.get(value.valueType, "uiVal")))

    def close(self) -> None:
        if self._nv is None:
            return
        if self._events is not None:
            self._nv.nvmlEventSetFree(self._events)
        self._nv.nvmlShutdown()


# nvmlValueType_t -> the member of the nvmlValue_t union that holds it.
_FIELD_VALUE = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _optional(read: Callable[[], Any], default: Any) -> Any:
    """Some figures are unsupported on some boards (power on MIG, ECC on consumer cards)."""
    try:
        return read()
    except Exception as exc:  # NVMLError_NotSupported and friends
        if type(exc).__name__ in ("NVMLError_GpuIsLost", "NVMLError_ResetRequired"):
            raise
        return default


class NvmlSampler:
    """Reads the GPU the inference process runs on; reports 'unavailable' instead of failing."""

    def __init__(self, backend: NvmlBackend, clock: Callable[[], float]) -> None:
        self.backend = backend
        self.clock = clock
        self._opened = False
        self._unavailable: str | None = None
        self._xid_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._recovery_error: str | None = None

    def open(self) -> None:
        try:
            self.backend.open()
            self._opened = True
            self._unavailable = None
            log.info("nvml_opened", gpus=len(self.backend.uuids()))
        except NvmlUnavailable as exc:
            self._unavailable = str(exc)
            log.warning("nvml_unavailable", reason=self._unavailable)

    @property
    def available(self) -> bool:
        return self._opened

    def _read(self, wanted: tuple[str, ...] | None) -> GpuReadout:
        now = self.clock()
        if not self._opened:
            return GpuReadout((GpuSample(at=now, available=False, reason=self._unavailable or "not opened"),), 0)
        try:
            visible = self.backend.uuids()
        except Exception as exc:  # NVML said something unexpected: report it, keep going
            return GpuReadout((GpuSample(at=now, available=False, reason=f"nvml error: {exc}"),), 0)
        if wanted is None:
            if len(visible) != 1:
                # Several GPUs and no word on which are ours: reading one would be a guess.
                why = "no GPU visible to NVML" if not visible else f"{len(visible)} GPUs visible, the pod's unknown"
                return GpuReadout((GpuSample(at=now, available=False, reason=why),), len(visible))
            wanted = (visible[0],)
        return GpuReadout(tuple(self._read_one(now, uuid, visible) for uuid in wanted), len(visible))

    def _read_one(self, now: float, uuid: str, visible: list[str]) -> GpuSample:
        if uuid not in visible:
            return GpuSample(at=now, available=False, uuid=uuid, reason=f"{uuid} not visible to NVML here")
        try:
            r = self.backend.read(uuid)
        except GpuLost as exc:
            # A lost GPU may still say what it needs (a reset, a reboot): the node is told so at once.
            return GpuSample(at=now, available=True, reason=str(exc), uuid=uuid, lost=True,
                             recovery_action=self._recovery_action(uuid))
        except Exception as exc:  # NVML said something unexpected: report it, keep going
            return GpuSample(at=now, available=False, uuid=uuid, reason=f"nvml error: {exc}")
        return GpuSample(
            at=now, available=True, index=r.index, uuid=r.uuid, name=r.name,
            memory_used_bytes=r.memory_used_bytes, memory_total_bytes=r.memory_total_bytes,
            utilization_ratio=r.utilization_percent / 100.0, temperature_celsius=r.temperature_celsius,
            power_watts=r.power_milliwatts / 1000.0, ecc_uncorrected=r.ecc_uncorrected,
            recovery_action=self._recovery_action(uuid), driver=r.driver or None,
        )

    def _recovery_action(self, uuid: str) -> int | None:
        try:
            return self.backend.recovery_action(uuid)
        except Exception as exc:  # a figure missing is no reason to lose the rest of the reading
            if str(exc) != self._recovery_error:  # said once per kind, not every second
                log.warning("recovery_action_unreadable", uuid=uuid, error=str(exc))
            self._recovery_error = str(exc)
            return None

    async def sample(self, wanted: tuple[str, ...] | None) -> GpuReadout:
        """The pod's GPUs (`wanted`), or the only one NVML sees when the pod's are not known."""
        if not self._opened:
            return self._read(wanted)
        return await asyncio.to_thread(self._read, wanted)

    def start_xid_watch(self, deliver: Callable[[XidEvent], object]) -> None:
        """Wait on the NVML event set in a thread: the wait blocks."""
        if not self._opened or self._xid_thread is not None:
            return

        def watch() -> None:
            while not self._stop.is_set():
                try:
                    events = self.backend.wait_xid(500)
                except Exception as exc:
                    log.warning("xid_wait_failed", error=str(exc))
                    self._stop.wait(1.0)
                    continue
                for uuid, xid in events:
                    deliver(XidEvent(at=self.clock(), xid=xid, uuid=uuid))

        self._xid_thread = threading.Thread(target=watch, name="nvml-xid", daemon=True)
        self._xid_thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._xid_thread is not None:
            self._xid_thread.join(timeout=2.0)
        if self._opened:
            try:
                self.backend.close()
            except Exception as exc:
                log.warning("nvml_close_failed", error=str(exc))
