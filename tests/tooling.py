"""External tools the checks need: installed by `make tools` (and so by CI); required there."""

from __future__ import annotations

import os
import shutil

import pytest


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} not found: run `make tools` (Debian packages prometheus, prometheus-alertmanager, faketime)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it; a missing tool there is a broken pipeline, not a skip
        pytest.skip(message)
    return path


def faketime_env(offset: str) -> dict[str, str]:
    """The environment that runs a process with its clock `offset` off ("-30s", "+8s"), all clocks
    but the monotonic one: Debian's libfaketime, preloaded (the package `faketime` brings it)."""
    require("faketime")
    libs = [os.path.join(d, "faketime", "libfaketime.so.1") for d in ("/usr/lib/x86_64-linux-gnu",
                                                                      "/usr/lib/aarch64-linux-gnu", "/usr/lib")]
    lib = next((p for p in libs if os.path.exists(p)), None)
    if lib is None:
        pytest.fail(f"faketime is installed but libfaketime.so.1 is in none of {libs}")
    return {"LD_PRELOAD": lib, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_NO_CACHE": "1"}
