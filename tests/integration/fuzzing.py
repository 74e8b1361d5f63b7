"""Schemathesis run against a published OpenAPI description, with the checks and the seed every fuzzed
API is held to: shared by the built-in server's fuzzing and a handler's, so a handler's API passes
the same checks."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "negative_data_rejection")
SCHEMATHESIS = str(Path(sys.executable).parent / "schemathesis")


def fuzz(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SCHEMATHESIS, "run", url, "-c", CHECKS, "-n", "60", "--seed", "20261129",
                           "--generation-deterministic", *extra], capture_output=True, text=True, timeout=600,
                          cwd=tempfile.mkdtemp(prefix="fuzz-"))  # its caches stay out of the tree
