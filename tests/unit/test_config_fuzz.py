"""Generated configs: either a clean error naming the key path, or valid settings. Never a traceback."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings

from gpu_watchdog.watchdog.edge.config import ConfigError, Settings, from_mapping
from tests.config_strategies import configs


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_any_config_is_valid_or_a_clean_key_path_error(config: Any) -> None:
    try:
        result = from_mapping(config)
    except ConfigError as exc:
        assert exc.errors, "an error without a message"
        for line in exc.errors:
            path, sep, message = line.partition(": ")
            assert sep and path.strip() and message, line
            assert path == path.strip(), line
    else:
        assert isinstance(result, Settings)
