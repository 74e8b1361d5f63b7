"""Torch allocator figures from the inference process's `GET /control/memory`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from watchdog.control_client import ControlClient, ControlError
from watchdog.samples import TorchSample


def _num(data: dict[str, Any], key: str, kind: type = int) -> Any:
    value = data.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{key}: expected a non-negative number, got {value!r}")
    return kind(value)


def parse_memory(data: dict[str, Any], at: float) -> TorchSample:
    """Validate the control API's answer field by field; garbage raises ValueError, never crashes later."""
    missing = [k for k in ("device", "total_bytes", "allocated_bytes", "reserved_bytes") if k not in data]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    admission = data.get("admission") or {}
    if not isinstance(admission, dict):
        raise ValueError("admission: expected an object")
    frag = data.get("fragmentation_ratio", 0.0)
    if isinstance(frag, bool) or not isinstance(frag, int | float) or not 0.0 <= frag <= 1.0:
        raise ValueError(f"fragmentation_ratio: expected 0..1, got {frag!r}")
    poisoned = data.get("poisoned", False)
    if not isinstance(poisoned, bool):
        raise ValueError("poisoned: expected a boolean")
    uuid = data.get("uuid")
    instance = data.get("instance_id")
    return TorchSample(
        at=at, reachable=True, device=str(data.get("device", "unknown")),
        uuid=uuid if isinstance(uuid, str) else None,
        total_bytes=_num(data, "total_bytes"), allocated_bytes=_num(data, "allocated_bytes"),
        reserved_bytes=_num(data, "reserved_bytes"), active_bytes=_num(data, "active_bytes"),
        inactive_split_bytes=_num(data, "inactive_split_bytes"), alloc_retries=_num(data, "alloc_retries"),
        ooms=max(_num(data, "num_ooms"), _num(data, "ooms_caught")), fragmentation_ratio=float(frag),
        injected=bool(data.get("injected", False)), uptime_s=_num(data, "uptime_s", float), poisoned=poisoned,
        poison_reason=str(data["poison_reason"]) if data.get("poison_reason") else None,
        instance_id=instance if isinstance(instance, str) else None,
        inflight=_num(data, "inflight"), queued=_num(data, "queued"),
        admission_limit=_num(admission, "limit") if "limit" in admission else 0,
        admission_mode=str(admission.get("mode", "")),
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
