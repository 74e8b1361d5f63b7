"""What the inference process and the sidecar agree on: the control API's routes, the name of its
bearer token's variable and the memory report's shape.

A leaf: it imports nothing else of this project, so both halves depend on it and on nothing of
each other's; and pure (no file, no environment), so the sidecar's rules may read it. The token
file itself is `gpu_watchdog.token`'s. The memory report (`GET /control/memory`) is one typed
record: `serve` and the agent build it, the sidecar parses it, the control API's schema is derived
from it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

VERSION = "0.1.0"

ENV_VAR = "GPU_WATCHDOG_TOKEN"

# The control API (pod-local, 127.0.0.1:8001, bearer token).
MEMORY = "/control/memory"
EMPTY_CACHE = "/control/empty_cache"
CANARY = "/control/canary"
DRAIN = "/control/drain"  # POST drains (until its `deadline`), DELETE lifts the drain
ADMISSION = "/control/admission"
FAULT = "/control/fault"
EXIT = "/control/exit"  # POST: the process exits (code 75) for its server to start again; a worker's rung
# The query of death: the fingerprints in flight (and at the failure), and the quarantine list
# (GET lists, POST adds one, PUT replaces all, DELETE lifts one).
REQUESTS = "/control/requests"
# `GET /control/requests?evidence=1`: the read that takes a failure's evidence (`at_failure`), the one a
# poisoned process waits for before it exits. Other reads (what was answered lately) do not count:
# the process must not leave before the restart's own read has its evidence.
REQUESTS_EVIDENCE = "evidence"
# POST: every thread's Python stack, into the termination log and the answer (before a hang's restart).
STACKS = "/control/stacks"
QUARANTINE = "/control/quarantine"
CONTROL_OPENAPI = "/control/openapi.json"

# A drain the server lifts by itself once its deadline passes, so a sidecar that dies mid-restart
# cannot leave the pod drained for good (seconds; `POST /control/drain {"deadline": S}`).
DRAIN_DEADLINE_DEFAULT_S = 300.0
DRAIN_DEADLINE_MAX_S = 3600.0


# What a canary's failure was: as the process that ran it classifies it (by type, never by text),
# or "unreachable", the sidecar's own word for no answer at all.
CANARY_ERROR_CLASSES = ("oom", "fatal_cuda", "timeout", "other", "unreachable")


# A correctness probe (`POST /control/canary {"probe": {...}}`): a greedy generation of a few tokens
# of a given prompt, answered with each step's top log-probabilities, on the canary's reserved slot.
PROBE_PROMPT_MAX = 2000
PROBE_TOKENS_MAX = 16
PROBE_TOP_MAX = 5


@dataclasses.dataclass(frozen=True)
class CanaryProbe:
    prompt: str
    max_tokens: int = 3
    top_logprobs: int = 2

    @classmethod
    def parse(cls, data: object) -> CanaryProbe:
        """ValueError naming the field (`probe.prompt`, ...) when `data` is not a probe."""
        if not isinstance(data, dict):
            raise ValueError("probe: must be an object {prompt, max_tokens, top_logprobs}")
        prompt = data.get("prompt")
        if not isinstance(prompt, str) or not 0 < len(prompt) <= PROBE_PROMPT_MAX:
            raise ValueError(f"probe.prompt: must be a non-empty string of at most {PROBE_PROMPT_MAX} characters")
        counts: list[int] = []
        for name, default, top in (("max_tokens", 3, PROBE_TOKENS_MAX), ("top_logprobs", 2, PROBE_TOP_MAX)):
            value = data.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ValueError(f"probe.{name}: must be an integer between 1 and {top}")
            counts.append(value)
        unknown = sorted(set(data) - {"prompt", "max_tokens", "top_logprobs"})
        if unknown:
            raise ValueError(f"probe.{unknown[0]}: unknown field")
        return cls(prompt, counts[0], counts[1])


@dataclasses.dataclass(frozen=True)
class CanaryResult:
    """One canary: a real one-token inference on the reserved slot. `POST /control/canary` answers
    it (`to_json`, with the process's instance and whether it is draining); the sidecar `parse`s it."""

    ok: bool
    latency_s: float
    error_class: str | None
    error: str | None = None
    # A probe's answer: `tokens` (the greedy ids) and `top` (per step, [[id, logprob], ...] best first).
    answer: dict[str, Any] | None = None
    # The step's logits held NaN or infinities (the engine failed it rather than answer noise).
    nonfinite: bool = False

    def to_json(self, instance_id: str, draining: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "latency_s": self.latency_s, "error_class": self.error_class,
                               "error": self.error, "instance_id": instance_id, "draining": draining}
        if self.answer is not None:
            out["answer"] = self.answer
        if self.nonfinite:
            out["nonfinite"] = True
        return out

    @classmethod
    def parse(cls, data: object) -> tuple[CanaryResult, str | None, bool]:
        """(result, instance_id, draining); ValueError when the answer is not a canary's."""
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        ok, error_class, latency = data.get("ok"), data.get("error_class"), data.get("latency_s")
        if not isinstance(ok, bool) or (error_class is not None and error_class not in CANARY_ERROR_CLASSES) \
                or isinstance(latency, bool) or not isinstance(latency, int | float):
            raise ValueError(f"bad canary answer: {str(data)[:200]}")
        instance = data.get("instance_id")
        error = data.get("error")
        answer = data.get("answer")
        return (cls(ok, float(latency), error_class, None if error is None else str(error),
                    answer if isinstance(answer, dict) else None, data.get("nonfinite") is True),
                instance if isinstance(instance, str) else None, data.get("draining") is True)


@dataclasses.dataclass(frozen=True)
class AdmissionReport:
    """The gate, as `GET /control/memory` reports it under `admission`."""

    mode: str
    limit: int
    capacity: float = 0  # slots, or weights in slots: not whole numbers with weighted admission
    in_use: float = 0
    holders: int = 0
    waiting: int = 0
    peak_holders: int = 0
    canary_busy: bool = False
    source: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """`GET /control/memory`: the torch allocator's figures (honest zeros on CPU) and the process's state.

    `injected`: the fragmentation figures come from an injected fault, not from the allocator.
    `engine` and `prefix_cache` are `serve`'s alone (the agent has neither: an app's model call has
    no batches); `faults` is there only with fault injection on.
    """

    device: str
    device_name: str
    uuid: str | None
    total_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int
    inactive_split_bytes: int
    alloc_retries: int
    num_ooms: int
    fragmentation_ratio: float
    injected: bool
    ooms_caught: int
    empty_cache_count: int
    uptime_s: float
    poisoned: bool
    poison_reason: str | None
    inflight: int
    queued: int
    draining: bool
    drain_deadline_left_s: float | None
    ready: bool
    instance_id: str | None  # None only when read from a server that sends none
    pid: int
    model: str
    time: float
    admission: AdmissionReport
    faults: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    prefix_cache: dict[str, Any] | None = None

    # Sections a server without them leaves out of its answer instead of sending null.
    OPTIONAL_SECTIONS: typing.ClassVar[tuple[str, ...]] = ("engine", "prefix_cache")

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in self.OPTIONAL_SECTIONS:
            if out[key] is None:
                del out[key]
        return out

    @classmethod
    def parse(cls, data: object) -> MemoryReport:
        """The answer, checked field by field: ValueError names the first field that is wrong.

        Lenient where a server of another release may differ: only the allocator's four essentials
        are required; a number or flag that is absent reads as zero or false.
        """
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
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

        def text(key: str, default: str = "") -> str:
            value = data.get(key)
            return value if isinstance(value, str) else default

        def section(key: str) -> dict[str, Any] | None:
            value = data.get(key)
            return value if isinstance(value, dict) else None

        drain_left = data.get("drain_deadline_left_s")
        return cls(
            device=str(data.get("device", "unknown")), device_name=text("device_name"),
            uuid=data["uuid"] if isinstance(data.get("uuid"), str) else None,
            total_bytes=_count(data, "total_bytes"), allocated_bytes=_count(data, "allocated_bytes"),
            reserved_bytes=_count(data, "reserved_bytes"), active_bytes=_count(data, "active_bytes"),
            inactive_split_bytes=_count(data, "inactive_split_bytes"), alloc_retries=_count(data, "alloc_retries"),
            num_ooms=_count(data, "num_ooms"), fragmentation_ratio=float(frag),
            injected=bool(data.get("injected", False)), ooms_caught=_count(data, "ooms_caught"),
            empty_cache_count=_lenient(data, "empty_cache_count"), uptime_s=_count(data, "uptime_s", float),
            poisoned=poisoned, poison_reason=str(data["poison_reason"]) if data.get("poison_reason") else None,
            inflight=_count(data, "inflight"), queued=_count(data, "queued"),
            draining=data.get("draining") is True,
            drain_deadline_left_s=float(drain_left) if isinstance(drain_left, int | float)
            and not isinstance(drain_left, bool) else None,
            ready=data.get("ready") is True,
            instance_id=data["instance_id"] if isinstance(data.get("instance_id"), str) else None,
            pid=_lenient(data, "pid"), model=text("model"), time=_lenient(data, "time", float),
            admission=AdmissionReport(
                mode=str(admission.get("mode", "")),
                limit=_count(admission, "limit"),
                capacity=_lenient(admission, "capacity", float), in_use=_lenient(admission, "in_use", float),
                holders=_lenient(admission, "holders"), waiting=_lenient(admission, "waiting"),
                peak_holders=_lenient(admission, "peak_holders"), canary_busy=admission.get("canary_busy") is True,
                source=str(admission.get("source", ""))),
            faults=section("faults"), engine=section("engine"), prefix_cache=section("prefix_cache"),
        )


def _lenient(data: dict[str, Any], key: str, kind: type = int) -> Any:
    # A figure the sidecar only shows: one it cannot read costs that figure, not the whole sample.
    try:
        return _count(data, key, kind)
    except ValueError:
        return kind(0)


def _count(data: dict[str, Any], key: str, kind: type = int) -> Any:
    value = data.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{key}: expected a non-negative number, got {value!r}")
    return kind(value)


_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}


def _schema_of(hint: Any) -> dict[str, Any]:
    nullable = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        nullable, hint = True, args[0]
    if dataclasses.is_dataclass(hint):
        out = record_schema(typing.cast(type, hint))
    elif typing.get_origin(hint) is dict:
        out = {"type": "object"}
    else:
        out = {"type": _JSON_TYPES[hint]}
    if nullable:
        out["nullable"] = True
    return out


def record_schema(record: type) -> dict[str, Any]:
    """The OpenAPI 3.0 schema of one of the records above: every field typed, those without a default required."""
    hints = typing.get_type_hints(record)
    fields = dataclasses.fields(record)
    optional = set(getattr(record, "OPTIONAL_SECTIONS", ()))
    required = [f.name for f in fields if f.name not in optional and f.default is dataclasses.MISSING]
    return {"type": "object", "required": required,
            "properties": {f.name: _schema_of(hints[f.name]) for f in fields}}
