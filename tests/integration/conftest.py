"""Fixtures shared by the tests that talk to kmock's Kubernetes API emulator."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from tests.integration.kmock_api import NS, POD, pod, serve_events


@pytest.fixture
def api(kmock: Any) -> client.ApiClient:
    """The real client pointed at kmock, with our pod and a neighbour in the namespace."""
    cfg = client.Configuration()
    cfg.host = str(kmock.url).rstrip("/")
    cfg.retries = 0
    kmock.objects["v1/pods", NS, POD] = pod()
    kmock.objects["v1/pods", NS, "neighbour"] = pod("neighbour")
    serve_events(kmock)
    return client.ApiClient(cfg)
