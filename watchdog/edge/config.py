"""The watchdog's YAML config, loaded and checked into the settings of `watchdog.core.settings`.

Every error names its key path (`policy.fragmentation.ratio: ...`); all errors are reported
at once. `${VAR}` in a string is replaced from the environment (the downward API sets
POD_NAME and POD_NAMESPACE). The settings' names are re-exported here for what loads them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from gpu_watchdog.watchdog.core import selector
from gpu_watchdog.watchdog.core.settings import (
    BUNDLED_METRICS_URL,
    DEVICE_EFFECTS,
    HTTP_METHODS,
    METRICS_AUTO,
    NODE_EFFECTS,
    STRATEGIES,
    VERDICT_FILE,
    AdmissionSettings,
    CanarySettings,
    EscalationSettings,
    FleetSettings,
    FragmentationSettings,
    HangSettings,
    HttpTargetSettings,
    InPlaceSettings,
    KubernetesSettings,
    MemoryPressureSettings,
    PlacementSettings,
    PolicySettings,
    QuarantineSettings,
    RecorderSettings,
    RestartBudgetSettings,
    RestartSettings,
    SamplingSettings,
    ServerSettings,
    Settings,
    StallSettings,
    TargetSettings,
    UnservableSettings,
    bounds,
    metrics_url,
    workload_of,
)

__all__ = [
    "BUNDLED_METRICS_URL", "HTTP_METHODS", "METRICS_AUTO", "STRATEGIES", "VERDICT_FILE", "AdmissionSettings",
    "CanarySettings", "ConfigError", "EscalationSettings", "FleetSettings", "FragmentationSettings", "HangSettings",
    "HttpTargetSettings", "InPlaceSettings", "KubernetesSettings", "MemoryPressureSettings", "PlacementSettings",
    "PolicySettings",
    "QuarantineSettings", "RecorderSettings", "RestartBudgetSettings", "RestartSettings", "SamplingSettings",
    "ServerSettings",
    "Settings", "StallSettings", "TargetSettings", "UnservableSettings", "check_config_main", "from_mapping",
    "load", "metrics_url", "read_yaml", "replace", "workload_of",
]

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ConfigError(ValueError):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


def _broken(meta: Mapping[str, Any], value: float) -> bool:
    return any(bound is not None and broken for bound, broken in (
        (meta.get("min"), value < meta.get("min", 0)), (meta.get("max"), value > meta.get("max", 0)),
        (meta.get("gt"), value <= meta.get("gt", 0)), (meta.get("lt"), value >= meta.get("lt", 0))))


def _check_bounds(obj: Any, path: str, errors: list[str]) -> None:
    """Every setting's own bounds, as its metadata states them (the references say the same)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        where = _join(path, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _check_bounds(value, where, errors)
        elif isinstance(value, int | float) and not isinstance(value, bool) and _broken(f.metadata, value):
            why = f" ({f.metadata['why']})" if "why" in f.metadata else ""
            errors.append(f"{where}: must be {bounds(f.metadata)}{why}")


def _substitute(value: str) -> str:
    def repl(m: re.Match[str]) -> str:
        return os.environ.get(m.group(1), "")

    return _ENV_REF.sub(repl, value)


def _convert(value: Any, tp: Any, meta: Mapping[str, Any], path: str, errors: list[str]) -> Any:
    if meta.get("kind") == "json":
        return value  # any JSON value, sent as it is
    origin = typing.get_origin(tp)
    if origin is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in value.items()):
            errors.append(f"{path}: expected a mapping of strings to strings")
            return None
        return {k: _substitute(v) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], meta, path, errors)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _build(tp, value, path, errors)
    if value is None:
        errors.append(f"{path}: must not be empty")
        return None
    if "parse" in meta:
        try:
            parsed = meta["parse"](value)
        except ValueError as exc:
            errors.append(f"{path}: {exc}")
            return None
        if meta.get("kind") == "duration":
            if parsed < 0:
                errors.append(f"{path}: must not be negative")
            elif meta.get("positive") and parsed == 0:
                errors.append(f"{path}: must be greater than 0")
        return parsed
    if tp is bool:
        if not isinstance(value, bool):
            errors.append(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"{path}: expected an integer, got {value!r}")
            return None
        if value < 0:
            errors.append(f"{path}: must not be negative")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            errors.append(f"{path}: expected a number, got {value!r}")
            return None
        if value < 0:
            errors.append(f"{path}: must not be negative")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            errors.append(f"{path}: expected a string, got {value!r}")
            return None
        value = _substitute(value)
        choices = meta.get("choices")
        if choices and value not in choices:
            errors.append(f"{path}: must be one of {', '.join(choices)}, got {value!r}")
        return value
    errors.append(f"{path}: unsupported setting type")  # pragma: no cover - a programming error
    return None


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _join(path: str, key: object) -> str:
    """A readable key path even for odd keys: `canary.interval`, `canary['a b']`, `[1]`."""
    if isinstance(key, str) and _PLAIN_KEY.fullmatch(key):  # fullmatch: a key ending in a newline is not plain
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _build(cls: type[Any], data: Any, path: str, errors: list[str]) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        errors.append(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            where = _join(path, key)
            errors.append(f"{where}: unknown key (expected one of {', '.join(fields)})")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in data:
            tp = hints[name]
            if dataclasses.is_dataclass(tp) and isinstance(tp, type):
                kwargs[name] = _build(tp, {}, _join(path, name), errors)
            elif isinstance(f.default, str) and _ENV_REF.search(f.default):
                kwargs[name] = _substitute(f.default)
            continue
        where = _join(path, name)
        converted = _convert(data[name], hints[name], f.metadata, where, errors)
        if converted is not None or data[name] is None:
            kwargs[name] = converted
    try:
        return cls(**kwargs)
    except TypeError:  # pragma: no cover - only reached after an error was recorded
        return cls()


def _check(s: Settings, errors: list[str]) -> None:
    if s.canary.timeout > s.canary.interval * 10:
        errors.append("canary.timeout: must not exceed 10 x canary.interval")
    _check_bounds(s, "", errors)
    a = s.policy.admission
    if a.max_wait < a.recover_after:
        errors.append("policy.admission.max_wait: must not be below policy.admission.recover_after")
    if s.restart.retry_max < s.restart.retry_initial:
        errors.append("restart.retry_max: must not be below restart.retry_initial")
    if s.restart.strategy in ("evict", "delete"):
        if not s.kubernetes.pod_name:
            errors.append(f"kubernetes.pod_name: required for restart strategy {s.restart.strategy}"
                          " (set POD_NAME from the downward API)")
        if not s.kubernetes.namespace:
            errors.append(f"kubernetes.namespace: required for restart strategy {s.restart.strategy}"
                          " (set POD_NAMESPACE from the downward API)")
    urls = [("target.control_url", s.target.control_url), ("target.openai_url", s.target.openai_url)]
    if s.target.metrics_url != METRICS_AUTO:
        urls.append(("target.metrics_url", s.target.metrics_url))
    for key, url in urls:
        if url is not None and not re.match(r"^https?://[^/\s]+", url):
            errors.append(f"{key}: expected an http(s) URL, got {url!r}")
    _check_http_target(s.target, errors)
    _check_placement(s, errors)
    if s.target.workers > 1 and (s.target.http is not None or s.target.openai_url is not None):
        errors.append("target.workers: only with the control API (target.control_url), not target.http or"
                      " target.openai_url")


def _check_placement(s: Settings, errors: list[str]) -> None:
    p = s.policy.placement
    if p.strategy == "device" and p.effect not in DEVICE_EFFECTS:
        errors.append(f"policy.placement.effect: {p.effect} is a node taint's effect; a device's is one of"
                      f" {', '.join(DEVICE_EFFECTS)}")
    if p.strategy == "node" and p.effect == "NoExecute":
        errors.append("policy.placement.effect: NoExecute on a node would evict every pod on it; strategy node"
                      f" takes one of {', '.join(NODE_EFFECTS)} (NoExecute is for strategy device)")
    if p.strategy in ("device", "node") and s.restart.strategy in ("none", "local"):
        errors.append(f"policy.placement.strategy: {p.strategy} taints through the Kubernetes API, which restart"
                      f" strategy {s.restart.strategy} does not use (use strategy none to report only)")


def _check_http_target(t: TargetSettings, errors: list[str]) -> None:
    if t.progress_metric is not None:
        try:
            selector.parse(t.progress_metric)
        except ValueError as exc:
            errors.append(f"target.progress_metric: {exc}")
    h = t.http
    if h is None:
        return
    if t.openai_url is not None:
        errors.append("target.http: cannot be combined with target.openai_url (one canary per target)")
    if not h.url:
        errors.append("target.http.url: required (the URL the canary request goes to)")
    elif not re.match(r"^https?://[^/\s]+", h.url):
        errors.append(f"target.http.url: expected an http(s) URL, got {h.url!r}")
    if h.body is not None and h.body_file is not None:
        errors.append("target.http.body_file: give body or body_file, not both")
    if h.body is not None and h.method == "GET":
        errors.append("target.http.body: a GET request carries no body (use method POST)")
    if h.body_file is not None and not os.path.isfile(h.body_file):
        errors.append(f"target.http.body_file: no such file {h.body_file!r}")
    if h.expect_json is not None and (not h.expect_json or any(not part for part in h.expect_json.split("."))):
        errors.append(f"target.http.expect_json: expected a key path like outputs.0.data, got {h.expect_json!r}")


def from_mapping(data: Any) -> Settings:
    errors: list[str] = []
    settings = _build(Settings, data, "", errors)
    if not errors:
        _check(settings, errors)
    if errors:
        raise ConfigError(errors)
    return typing.cast(Settings, settings)


def build(data: Any) -> Settings:
    """Settings from a mapping, its keys, types and bounds checked, and nothing that needs this
    machine (the environment, a file named in it): for settings written down elsewhere, as a
    flight recording holds them."""
    errors: list[str] = []
    settings = _build(Settings, data, "", errors)
    if not errors:
        _check_bounds(settings, "", errors)
    if errors:
        raise ConfigError(errors)
    return typing.cast(Settings, settings)


def load(path: str) -> Settings:
    return from_mapping(read_yaml(path))


def read_yaml(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError([f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}"]) from None
    return data


def replace(settings: Settings, section: str, **changes: Any) -> Settings:
    return dataclasses.replace(settings, **{section: dataclasses.replace(getattr(settings, section), **changes)})


def check_config_main(path: str, out: Callable[[str], None] = print) -> int:
    try:
        settings = load(path)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"error: {line}", file=sys.stderr)
        print(f"{path}: {len(exc.errors)} error(s)", file=sys.stderr)
        return 1
    out(f"{path}: ok (restart strategy {settings.restart.strategy}, canary every {settings.canary.interval:g}s,"
        f" timeout {settings.canary.timeout:g}s)")
    return 0
