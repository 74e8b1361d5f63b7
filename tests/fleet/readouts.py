"""What a fleet scenario prints and reads back from its sidecars' logs: one line of figures per scenario
(read with `-s`) and the pods that logged an event, shared by the scenario modules so their lines
compare."""

from __future__ import annotations

import json
from typing import Any

from tests.fleet.harness import Fleet


def figures(scenario: str, **values: Any) -> None:
    print(f"\nfleet scenario {scenario}: {json.dumps(values, sort_keys=True)}")


def held_lines(f: Fleet, event: str) -> list[str]:
    return [p.name for p in f.all_pods.values() for line in p.log() if line.get("event") == event]
