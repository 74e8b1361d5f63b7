"""Under tests/fleet the `kmock` fixture is the extended emulator (`tests.fleet.cluster.Cluster`)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fleet.cluster import Cluster


@pytest.fixture
def kmock_options(kmock_options: dict[str, Any]) -> dict[str, Any]:
    return {**kmock_options, "cls": Cluster}
