"""Generated configs for the settings' loader, shared by the in-process fuzz and the CLI's: the known
sections and keys (plus one unknown at each level) over any YAML value, so that both see the same
inputs."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

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
