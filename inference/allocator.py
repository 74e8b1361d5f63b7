"""The torch allocator's figures and its cache, read the same way by `serve`'s engine and the agent.

Honest zeros on CPU, where there is no CUDA allocator; an injected fragmentation fault is
labelled as injected, never passed off as a measurement.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_watchdog.inference.faults import Fragmentation


def figures(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {
        "device": device.type,
        "device_name": "cpu",
        "uuid": None,
        "total_bytes": 0,
        "allocated_bytes": 0,
        "reserved_bytes": 0,
        "active_bytes": 0,
        "inactive_split_bytes": 0,
        "alloc_retries": 0,
        "num_ooms": 0,
    }
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        stats = torch.cuda.memory_stats(idx)
        uuid = getattr(props, "uuid", None)
        out.update(
            device_name=props.name,
            uuid=None if uuid is None else _format_uuid(uuid),
            total_bytes=int(props.total_memory),
            allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
            reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
            active_bytes=int(stats.get("active_bytes.all.current", 0)),
            inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current", 0)),
            alloc_retries=int(stats.get("num_alloc_retries", 0)),
            num_ooms=int(stats.get("num_ooms", 0)),
        )
    return out


def with_fragmentation(figures: dict[str, Any], frag: Fragmentation | None) -> dict[str, Any]:
    """The figures plus `fragmentation_ratio` and `injected`, an injected fault applied where there is one."""
    out = dict(figures)
    if frag is not None:
        reserved = out["reserved_bytes"] or (1 << 30)
        out["reserved_bytes"] = reserved
        out["allocated_bytes"] = int(reserved * (1 - frag.ratio))
        out["active_bytes"] = out["allocated_bytes"]
        out["inactive_split_bytes"] = int(reserved * frag.ratio)
        out["alloc_retries"] = out["alloc_retries"] + 1
    reserved = out["reserved_bytes"]
    out["fragmentation_ratio"] = (reserved - out["allocated_bytes"]) / reserved if reserved > 0 else 0.0
    out["injected"] = frag is not None
    return out


def empty_cache(device: torch.device) -> int:
    """Return cached blocks to the driver; the bytes freed (0 on CPU)."""
    if device.type != "cuda":
        return 0
    before = torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    return max(0, int(before - torch.cuda.memory_reserved(device)))


def _format_uuid(uuid: object) -> str:
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"
