"""The check that a memory report is the shared record, whole: the agent's report is checked with it
here and `serve`'s in tests/integration/test_inference_server.py, so both producers answer to the same
definition."""

from __future__ import annotations

from typing import Any

from gpu_watchdog.contract import MemoryReport, record_schema


def check_against_the_record(report: dict[str, Any]) -> MemoryReport:
    schema = record_schema(MemoryReport)
    assert set(schema["required"]) <= set(report) <= set(schema["properties"]), \
        (set(schema["required"]) - set(report), set(report) - set(schema["properties"]))
    parsed = MemoryReport.parse(report)
    assert parsed.to_json() == report  # read back whole: nothing the producer sends is lost or changed
    return parsed
