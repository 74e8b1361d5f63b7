"""Assertion rewriting for the helper modules whose own asserts check what a test reads: they came out
of test modules, which pytest rewrites, so a failure there still shows the values compared."""

from __future__ import annotations

import pytest

# Registered before any test module imports them (a conftest loads first); a module already imported
# could no longer be rewritten.
pytest.register_assert_rewrite("tests.e2e.up_stack", "tests.integration.workers", "tests.unit.memory_record")
