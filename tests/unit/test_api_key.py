"""A server's API key comes from its key file, never from the control API's token."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from gpu_watchdog.watchdog.edge.samplers.canary import OpenAICanary, read_api_key


async def test_the_control_token_is_never_sent_as_a_servers_api_key(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_WATCHDOG_TOKEN", "control-api-secret")
    key = tmp_path / "key"
    key.write_text("server-key\n")
    async with aiohttp.ClientSession() as session:
        canary = OpenAICanary("http://127.0.0.1:9/v1", None, str(key), session, lambda: 0.0, 1.0)
        assert canary.headers() == {"Authorization": "Bearer server-key"}
        none = OpenAICanary("http://127.0.0.1:9/v1", None, None, session, lambda: 0.0, 1.0)
        assert none.headers() == {}
    assert read_api_key(str(tmp_path / "absent")) is None
