from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpu_watchdog.units import parse_duration, parse_size
from gpu_watchdog.watchdog.edge.config import ConfigError, Settings, from_mapping, load

DESIGN_EXAMPLE = """
target:
  control_url: http://127.0.0.1:8001
  token_file: /var/run/gpu-watchdog/token
  openai_url: null
sampling: {nvml_interval: 1s, torch_interval: 5s}
canary: {interval: 30s, timeout: 10s}
policy:
  memory_pressure: {reserved_ratio: 0.85, cooldown: 60s}
  fragmentation: {ratio: 0.30, window: 10m, empty_cache_attempts: 3}
  hang: {consecutive_timeouts: 3}
  max_age: 24h
  restart_budget: {max_restarts: 3, window: 1h}
restart: {strategy: evict, drain_timeout: 30s}
kubernetes: {pod_name: "${POD_NAME}", namespace: "${POD_NAMESPACE}"}
server: {host: 0.0.0.0, port: 9402}
"""


def test_design_example_loads_with_env_substitution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "model-7f9c")
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    s = from_mapping(yaml.safe_load(DESIGN_EXAMPLE))
    assert s.kubernetes.pod_name == "model-7f9c" and s.kubernetes.namespace == "serving"
    assert s.policy.fragmentation.window == 600.0
    assert s.policy.max_age == 86400.0
    assert s.policy.restart_budget.window == 3600.0
    assert s.canary.timeout == 10.0
    assert s.restart.strategy == "evict"


PEER_EXAMPLE = """
target:
  openai_url: http://127.0.0.1:8000/v1
  api_key_file: /var/run/secrets/vllm/key
sampling: {server_interval: 2s}
policy:
  stall: {window: 90s}
  startup_timeout: 45m
  unservable: {window: 5m}
kubernetes: {pod_resources_socket: /var/lib/kubelet/pod-resources/kubelet.sock}
restart: {strategy: none}
"""


def test_peer_example_and_the_metrics_url_it_implies() -> None:
    from gpu_watchdog.watchdog.edge.config import metrics_url

    s = from_mapping(yaml.safe_load(PEER_EXAMPLE))
    assert (s.sampling.server_interval, s.policy.stall.window) == (2.0, 90.0)
    assert (s.policy.startup_timeout, s.policy.unservable.window) == (2700.0, 300.0)
    assert s.kubernetes.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert metrics_url(s.target) == "http://127.0.0.1:8000/metrics"  # "auto": the origin, not /v1/metrics
    assert metrics_url(from_mapping({"restart": {"strategy": "none"}}).target) == "http://127.0.0.1:8000/metrics"
    none = from_mapping({"target": {"openai_url": "http://h:1", "metrics_url": None}, "restart": {"strategy": "none"}})
    assert metrics_url(none.target) is None
    custom = from_mapping({"target": {"metrics_url": "http://h:9/prom"}, "restart": {"strategy": "none"}})
    assert metrics_url(custom.target) == "http://h:9/prom"


def test_a_bad_metrics_url_names_its_key() -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"target": {"metrics_url": "localhost:9/metrics"}, "restart": {"strategy": "none"}})
    assert any(e.startswith("target.metrics_url: expected an http(s) URL") for e in err.value.errors)


def test_empty_config_is_the_defaults() -> None:
    s = from_mapping({"restart": {"strategy": "none"}})
    assert s.policy == Settings().policy


@pytest.mark.parametrize(
    ("config", "path", "words"),
    [
        ({"canary": {"intervall": "30s"}}, "canary.intervall", "unknown key"),
        ({"bogus": 1}, "bogus", "unknown key"),
        ({"canary": {"interval": "soon"}}, "canary.interval", "duration"),
        ({"canary": {"interval": "0s"}}, "canary.interval", "greater than 0"),
        ({"sampling": {"nvml_interval": -1}}, "sampling.nvml_interval", "negative"),
        ({"policy": {"memory_pressure": {"reserved_ratio": 1.5}}}, "policy.memory_pressure.reserved_ratio", "0 and 1"),
        ({"policy": {"fragmentation": {"ratio": -0.1}}}, "policy.fragmentation.ratio", "0 and 1"),
        ({"policy": {"hang": {"consecutive_timeouts": "three"}}}, "policy.hang.consecutive_timeouts", "integer"),
        ({"restart": {"strategy": "reboot"}}, "restart.strategy", "one of evict, delete, container, local, none"),
        ({"server": {"port": "x"}}, "server.port", "integer"),
        ({"canary": [1, 2]}, "canary", "mapping"),
        ({"target": {"control_url": "ftp://x"}}, "target.control_url", "http"),
    ],
)
def test_every_error_names_its_key_path(config: dict[str, object], path: str, words: str) -> None:
    config.setdefault("restart", {"strategy": "none"})  # type: ignore[union-attr]
    if isinstance(config.get("restart"), dict) and "strategy" not in config["restart"]:  # type: ignore[operator]
        config["restart"]["strategy"] = "none"  # type: ignore[index]
    with pytest.raises(ConfigError) as err:
        from_mapping(config)
    assert any(line.startswith(f"{path}:") and words in line for line in err.value.errors), err.value.errors


def test_all_errors_are_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"canary": {"interval": "x", "timeout": "y"}, "restart": {"strategy": "nope"}})
    assert len(err.value.errors) == 3


def test_kubernetes_strategies_need_the_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    with pytest.raises(ConfigError) as err:
        from_mapping({"restart": {"strategy": "evict"}})
    assert any(e.startswith("kubernetes.pod_name:") for e in err.value.errors)


def test_units() -> None:
    assert parse_duration("250ms") == 0.25
    assert parse_duration("10m") == 600
    assert parse_duration(5) == 5.0
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("1GB") == 10**9
    for bad in ("ten", "1 fortnight", True, None):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_load_reads_a_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("restart: {strategy: none}\npolicy: {max_age: 0s}\n")
    assert load(str(f)).policy.max_age == 0.0


def test_a_key_ending_in_a_newline_is_named_quoted() -> None:
    # `$` matches before a trailing newline: such a key once printed as a bare path split over two lines.
    with pytest.raises(ConfigError) as err:
        from_mapping({"0\n": 1, "restart": {"strategy": "none"}})
    assert err.value.errors[0].startswith("['0\\n']: unknown key")
