"""The memory report (`GET /control/memory`) is one record: the agent builds it, the sidecar parses it
from the same definition, and the control API's schema is derived from it. (`serve`'s report is
checked against the same record in tests/integration/test_inference_server.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from gpu_watchdog.contract import MemoryReport, record_schema
from gpu_watchdog.inference.agent import Agent, AgentSettings
from gpu_watchdog.watchdog.edge.samplers.allocator import parse_memory
from tests.unit.memory_record import check_against_the_record


def test_the_agents_report_is_the_record_and_the_sidecar_reads_it() -> None:
    agent = Agent(AgentSettings(limit=3, device="cpu", model="my-app"))
    with agent.admit():
        report = agent.memory_report()
    parsed = check_against_the_record(report)
    assert (parsed.admission.limit, parsed.admission.holders, parsed.admission.source) == (3, 1, "agent")
    assert "engine" not in report  # the agent has no batches to report
    sample = parse_memory(report, at=12.5)
    assert sample.reachable and (sample.admission_limit, sample.inflight, sample.instance_id) == \
        (3, 1, agent.guard.instance_id)


def good() -> dict[str, Any]:
    agent = Agent(AgentSettings(limit=2, device="cpu"))
    return agent.memory_report()


@pytest.mark.parametrize(("change", "said"), [
    (lambda r: r.pop("reserved_bytes"), "missing reserved_bytes"),
    (lambda r: r.update(total_bytes=-1), "total_bytes: expected a non-negative number"),
    (lambda r: r.update(allocated_bytes="lots"), "allocated_bytes: expected a non-negative number"),
    (lambda r: r.update(num_ooms=True), "num_ooms: expected a non-negative number"),
    (lambda r: r.update(fragmentation_ratio=1.5), "fragmentation_ratio: expected 0..1"),
    (lambda r: r.update(poisoned="yes"), "poisoned: expected a boolean"),
    (lambda r: r.update(admission=[1]), "admission: expected an object"),
    (lambda r: r["admission"].update(limit=-2), "limit: expected a non-negative number"),
])
def test_garbage_is_named_field_by_field(change: Any, said: str) -> None:
    report = good()
    change(report)
    with pytest.raises(ValueError, match=said):
        MemoryReport.parse(report)


def test_not_an_object_and_another_release_lenient() -> None:
    with pytest.raises(ValueError, match="expected a JSON object"):
        MemoryReport.parse([1, 2])
    # A server of another release that sends only the allocator's essentials still reads.
    minimal = {"device": "cuda", "total_bytes": 80, "allocated_bytes": 10, "reserved_bytes": 20}
    r = MemoryReport.parse(minimal)
    assert (r.total_bytes, r.inflight, r.admission.limit, r.poisoned, r.instance_id) == (80, 0, 0, False, None)
    assert parse_memory(minimal, 0.0).instance_id is None
    # A figure the sidecar only shows costs itself when unreadable, not the sample.
    odd = {**good(), "pid": None, "time": "now", "empty_cache_count": -1}
    odd["admission"] = {**odd["admission"], "holders": "many"}
    r = MemoryReport.parse(odd)
    assert (r.pid, r.time, r.empty_cache_count, r.admission.holders) == (0, 0.0, 0, 0)
    assert parse_memory(odd, 0.0).reachable


def test_the_schema_is_derived_from_the_record() -> None:
    schema = record_schema(MemoryReport)
    props = schema["properties"]
    assert props["uuid"] == {"type": "string", "nullable": True}
    assert props["total_bytes"] == {"type": "integer"} and props["fragmentation_ratio"] == {"type": "number"}
    assert props["admission"]["required"] == ["mode", "limit"]
    assert "engine" not in schema["required"] and "engine" in props
