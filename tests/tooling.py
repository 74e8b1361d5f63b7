"""External tools the checks need: installed by `make tools` (and so by CI); required there."""

from __future__ import annotations

import os
import shutil

import pytest


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} not found: run `make tools` (Debian packages prometheus, prometheus-alertmanager)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it; a missing tool there is a broken pipeline, not a skip
        pytest.skip(message)
    return path
