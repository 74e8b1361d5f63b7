"""Generated configs: either a clean error naming the key path, or valid settings. Never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_watchdog.watchdog.edge.config import ConfigError, Settings, from_mapping

KNOWN: dict[str, Any] = {
    "target": ["control_url", "token_file", "openai_url", "openai_model", "api_key_file", "metrics_url"],
    "sampling": ["nvml_interval", "torch_interval", "server_interval"],
    "canary": ["interval", "timeout"],
    "policy": {"memory_pressure": ["reserved_ratio", "cooldown"],
               "fragmentation": ["ratio", "window", "empty_cache_attempts", "latency_factor"],
               "hang": ["consecutive_timeouts"], "restart_budget": ["max_restarts", "window"],
               "stall": ["window"], "unservable": ["window"], "startup_timeout": None,
               "max_age": None, "max_age_jitter": None},
    "restart": ["strategy", "drain_timeout", "retry_initial", "retry_max", "max_attempts", "grace_period"],
    "kubernetes": ["pod_name", "namespace", "kubeconfig", "request_timeout", "pod_resources_socket"],
    "server": ["host", "port"],
}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["30s", "10m", "-1s", "0s", "1h", "abc", "12%", "0.5", "evict", "local", "none", "delete",
                     "http://127.0.0.1:8001", "${POD_NAME}", "${NOPE}", "", "512MiB", "1e309"]),
    st.text(max_size=12),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=8), inner, max_size=3), max_leaves=6)


def section(spec: Any) -> st.SearchStrategy[Any]:
    if spec is None:
        return values
    if isinstance(spec, list):
        keys = st.sampled_from([*spec, "unknown_key"])
        return st.one_of(st.dictionaries(keys, values, max_size=len(spec) + 1), values)
    keys = st.sampled_from([*spec, "unknown_key"])
    return st.one_of(st.fixed_dictionaries({}, optional={k: section(v) for k, v in spec.items()}), values)


configs = st.one_of(section(KNOWN), values)


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


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(configs)
def test_check_config_cli_never_prints_a_traceback(tmp_path: Path, config: Any) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(config, allow_unicode=True))
    out = subprocess.run([sys.executable, "-m", "gpu_watchdog", "check-config", str(f)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode in (0, 1), out.stderr
    assert "Traceback" not in out.stdout + out.stderr
