"""A hang's evidence on the real server: what was in flight when the engine's loop stopped advancing
is frozen by `serve` itself (`at_stall`), and a client that leaves afterwards stays in it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import requests

from gpu_watchdog.inference.screen import STALL_AFTER_S
from tests.helpers import Server, json_lines, post_raw, start_server, wait_for


def _requests(srv: Server) -> dict[str, Any]:
    r = srv.ctl("GET", "/control/requests")
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def test_the_server_freezes_what_was_in_flight_when_its_loop_stalled(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--fault-injection")
    try:
        srv.fault("hang", when_prompt_contains="WEDGE")
        ok = requests.post(srv.url + "/v1/completions", json={"prompt": "an ordinary question", "max_tokens": 2},
                           timeout=60)
        assert ok.status_code == 200, ok.text
        sock = post_raw(srv, "/v1/completions", {"prompt": "a WEDGE prompt", "max_tokens": 2})
        try:
            report = wait_for(lambda: (r := _requests(srv))["inflight"] and r, 10, "the hung request in flight")
            [stuck] = report["inflight"]
            assert report["at_stall"] is None  # not yet: a loop may be flat for a moment
            report = wait_for(lambda: (r := _requests(srv))["at_stall"] and r, STALL_AFTER_S + 15,
                              "the stall's snapshot")
            frozen = report["at_stall"]
            assert frozen["inflight"] == [stuck] and frozen["newest"] == stuck
            assert len(frozen["completed"]) == 2  # the one answered, by its fingerprint and its input's
        finally:
            sock.close()  # the client gives up
        wait_for(lambda: _requests(srv)["inflight"] == [], 10, "the gone client's request out of flight")
        report = _requests(srv)
        assert report["at_stall"] == frozen and report["at_failure"] is None  # a frozen copy: it stays
        stalls = [e for e in json_lines(srv.proc.log()) if e.get("event") == "engine_stalled"]
        assert len(stalls) == 1 and stalls[0]["fingerprints"] == [stuck]
        # The loop advances again: the stall is over, and its snapshot no evidence.
        srv.fault("clear")
        wait_for(lambda: _requests(srv)["at_stall"] is None, 15, "the snapshot dropped once the loop advanced")
    finally:
        srv.proc.stop()
