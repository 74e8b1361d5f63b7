"""The NVML sampler against a stand-in device behind the backend interface (no GPU here)."""

from __future__ import annotations

import threading
import types
from typing import Any

from gpu_watchdog.watchdog.core.samples import XidEvent
from gpu_watchdog.watchdog.edge.samplers.nvml import NvmlSampler, PynvmlBackend
from tests.unit.fake_nvml import A, B, FakeNvml


async def test_reads_the_pods_gpus_and_only_those() -> None:
    fake = FakeNvml()
    s = NvmlSampler(fake, clock=lambda: 7.0)
    s.open()
    r = await s.sample((B,))
    [g] = r.gpus
    assert (g.available, g.uuid, g.index, g.memory_used_bytes) == (True, B, 1, 2**30)
    assert g.utilization_ratio == 0.42 and g.power_watts == 312.5 and r.visible == 2
    r = await s.sample((A, B))  # a multi-GPU pod: every one of its GPUs
    assert [g.uuid for g in r.gpus] == [A, B] and all(g.available for g in r.gpus)


async def test_several_gpus_and_none_known_samples_none() -> None:
    fake = FakeNvml()
    s = NvmlSampler(fake, clock=lambda: 7.0)
    s.open()
    r = await s.sample(None)
    [g] = r.gpus
    assert g.available is False and g.uuid is None and r.visible == 2
    assert g.reason == "2 GPUs visible, the pod's unknown"


async def test_one_gpu_and_none_known_is_that_one() -> None:
    fake = FakeNvml()
    fake.visible = [A]
    s = NvmlSampler(fake, clock=lambda: 7.0)
    s.open()
    [g] = (await s.sample(None)).gpus
    assert (g.available, g.uuid, g.at) == (True, A, 7.0)


async def test_library_missing_is_a_state_not_a_crash() -> None:
    fake = FakeNvml()
    fake.missing = True
    s = NvmlSampler(fake, clock=lambda: 1.0)
    s.open()
    [g] = (await s.sample((A,))).gpus
    assert g.available is False and "Not Found" in (g.reason or "")
    assert s.available is False


async def test_gpu_lost_and_unexpected_errors() -> None:
    fake = FakeNvml()
    s = NvmlSampler(fake, clock=lambda: 1.0)
    s.open()
    fake.lost.add(A)
    [lost, fine] = (await s.sample((A, B))).gpus
    assert (lost.lost, lost.uuid, fine.lost, fine.available) == (True, A, False, True)
    fake.broken = True
    [g] = (await s.sample((B,))).gpus
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


async def test_real_backend_without_a_driver_reports_why() -> None:
    """The real pynvml path: here (no driver) the outcome is a reported state, with NVML's own words."""
    s = NvmlSampler(PynvmlBackend(), clock=lambda: 2.0)
    s.open()
    readout = await s.sample(None)
    if s.available:  # pragma: no cover - only on a machine with a GPU driver
        assert readout.visible >= 1 and readout.gpus
        s.close()
        return
    [g] = readout.gpus
    assert (g.available, g.at, g.uuid, readout.visible) == (False, 2.0, None, 0)
    assert g.reason is not None and "NVML Shared Library Not Found" in g.reason
    s.start_xid_watch(lambda ev: None)  # nothing to watch: must not start a thread that fails
    s.close()


async def test_the_recovery_action_comes_with_every_reading_a_lost_gpus_included() -> None:
    fake = FakeNvml()
    fake.recovery = {A: 1, B: 2}
    fake.lost.add(B)
    s = NvmlSampler(fake, clock=lambda: 1.0)
    s.open()
    a, b = (await s.sample((A, B))).gpus
    assert (a.recovery_action, a.lost, b.recovery_action, b.lost) == (1, False, 2, True)
    fake.recovery = {}  # a driver without the field
    [a] = (await s.sample((A,))).gpus
    assert a.recovery_action is None and a.available


async def test_a_recovery_action_that_cannot_be_read_costs_nothing_else() -> None:
    class NoField(FakeNvml):
        def recovery_action(self, uuid: str) -> int | None:
            raise RuntimeError("NVML_ERROR_UNKNOWN")

    s = NvmlSampler(NoField(), clock=lambda: 1.0)
    s.open()
    [a] = (await s.sample((A,))).gpus
    assert (a.available, a.memory_used_bytes, a.recovery_action) == (True, 10 * 2**30, None)


def _bindings(**changes: Any) -> Any:
    """nvidia-ml-py itself (its constants and structures), with the calls that need a driver answered here."""
    import pynvml

    nv = types.SimpleNamespace(**{k: getattr(pynvml, k) for k in dir(pynvml) if not k.startswith("__")})
    nv.nvmlDeviceGetHandleByUUID = lambda uuid: object()
    for name, value in changes.items():
        if value is None:
            delattr(nv, name)
        else:
            setattr(nv, name, value)
    return nv


def _field(nvml_return: int, value_type: int = 1, value: int = 0) -> Any:
    import pynvml

    values = (pynvml.c_nvmlFieldValue_t * 1)()
    values[0].fieldId = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    values[0].nvmlReturn, values[0].valueType = nvml_return, value_type
    if value_type == pynvml.NVML_VALUE_TYPE_DOUBLE:
        values[0].value.dVal = float(value)
    else:
        values[0].value.uiVal = value
    return lambda handle, ids: values if list(ids) == [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION] else None


def test_the_real_backend_reads_field_230_and_guards_every_way_it_can_be_missing() -> None:
    import pynvml

    backend = PynvmlBackend()
    backend._nv = _bindings(nvmlDeviceGetFieldValues=_field(pynvml.NVML_SUCCESS, value=4))
    assert backend.recovery_action(A) == 4
    backend._nv = _bindings(nvmlDeviceGetFieldValues=_field(pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_DOUBLE, 2))
    assert backend.recovery_action(A) == 2  # the value's type says which member of the union holds it
    # A driver that does not know the field answers per field.
    backend._nv = _bindings(nvmlDeviceGetFieldValues=_field(pynvml.NVML_ERROR_NOT_SUPPORTED, value=1))
    assert backend.recovery_action(A) is None

    def not_supported(handle: Any, ids: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    backend._nv = _bindings(nvmlDeviceGetFieldValues=not_supported)
    assert backend.recovery_action(A) is None
    backend._nv = _bindings(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION=None)  # bindings older than the field
    assert backend.recovery_action(A) is None
    backend._nv = _bindings(nvmlDeviceGetFieldValues=None)  # bindings without the call
    assert backend.recovery_action(A) is None
