"""The watchdog's YAML config, loaded into typed settings.

Every error names its key path (`policy.fragmentation.ratio: ...`); all errors are reported
at once. `${VAR}` in a string is replaced from the environment (the downward API sets
POD_NAME and POD_NAMESPACE).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from gpu_watchdog.units import parse_duration, parse_ratio, parse_share
from gpu_watchdog.watchdog import selector

STRATEGIES = ("evict", "delete", "container", "local", "none")
# Where the sidecar publishes a `container` verdict: an emptyDir the inference container's liveness
# probe reads (helm/gpu-watchdog/files/verdict-probe.sh).
VERDICT_FILE = "/var/run/gpu-watchdog-verdict/restart"
HTTP_METHODS = ("GET", "POST", "PUT")
METRICS_AUTO = "auto"
BUNDLED_METRICS_URL = "http://127.0.0.1:8000/metrics"  # the inference container's public port
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ConfigError(ValueError):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


def _duration(positive: bool = True) -> dict[str, Any]:
    return {"parse": parse_duration, "min": 0.0, "positive": positive, "kind": "duration"}


def _ratio() -> dict[str, Any]:
    return {"parse": parse_ratio, "kind": "ratio"}


@dataclass(frozen=True)
class HttpTargetSettings:
    """A canary for any HTTP model server: one request, judged by its status and, optionally, a key."""

    url: str = ""
    method: str = field(default="POST", metadata={"choices": HTTP_METHODS})
    body: Any = field(default=None, metadata={"kind": "json"})  # sent as JSON
    body_file: str | None = None  # sent as it is (JSON or not), read once at start
    headers: dict[str, str] = field(default_factory=dict)
    api_key_file: str | None = None  # sent as a Bearer token
    expect_status: int = 200
    expect_json: str | None = None  # a key path that must be in the answer: `outputs.0.data`


@dataclass(frozen=True)
class TargetSettings:
    control_url: str = "http://127.0.0.1:8001"
    token_file: str | None = "/var/run/gpu-watchdog/token"
    # Any OpenAI-compatible server (vLLM, TGI, SGLang, ...), with or without the `/v1` suffix.
    openai_url: str | None = None
    openai_model: str | None = None  # None: the first id of GET /v1/models, re-read after a restart
    api_key_file: str | None = None  # sent as a Bearer token, for servers started with an API key
    # The target's Prometheus page. "auto": the openai_url's origin + /metrics, or the bundled
    # server's public port on this pod; null: none (canary timeouts alone decide a hang).
    metrics_url: str | None = METRICS_AUTO
    # Any HTTP model server (Triton, TorchServe, LitServe, TEI, one's own): canary by this request.
    http: HttpTargetSettings | None = None
    # The target's counter of finished work on its metrics page (`name` or `name{label="v"}`):
    # canary timeouts while it advances mean saturated, not hung.
    progress_metric: str | None = None
    # The service's workers, each with its control API on the next port from control_url's
    # (`serve --workers N`, the agent under `uvicorn --workers N`): the first is watched by every
    # rule, the others by their own canaries (a hang of theirs is theirs: the worker rung).
    workers: int = 1


@dataclass(frozen=True)
class SamplingSettings:
    nvml_interval: float = field(default=1.0, metadata=_duration())
    torch_interval: float = field(default=5.0, metadata=_duration())
    server_interval: float = field(default=5.0, metadata=_duration())
    # Its own timeout, not the interval's: a saturated server answers its page late, and a late
    # reading is evidence where a timed-out one is none. A failed scrape is retried at the next tick.
    server_timeout: float = field(default=5.0, metadata=_duration())


@dataclass(frozen=True)
class CanarySettings:
    interval: float = field(default=30.0, metadata=_duration())
    timeout: float = field(default=10.0, metadata=_duration())


@dataclass(frozen=True)
class MemoryPressureSettings:
    reserved_ratio: float = field(default=0.85, metadata=_ratio())
    cooldown: float = field(default=60.0, metadata=_duration(positive=False))


@dataclass(frozen=True)
class FragmentationSettings:
    ratio: float = field(default=0.30, metadata=_ratio())
    window: float = field(default=600.0, metadata=_duration())
    empty_cache_attempts: int = 3
    # Canary latency against its own baseline as a drift signal. Off by default: a busy server
    # is slower too, and load is no reason to restart.
    latency_factor: float = 0.0


@dataclass(frozen=True)
class HangSettings:
    consecutive_timeouts: int = 3
    # A server whose work counter was readable and whose page now times out too is not proven
    # hung: its timeouts decide alone only once no reading has come for this long.
    no_evidence_after: float = field(default=120.0, metadata=_duration())


@dataclass(frozen=True)
class StallSettings:
    # Requests running or waiting while the generated-token counter stays flat this long.
    window: float = field(default=60.0, metadata=_duration())


@dataclass(frozen=True)
class UnservableSettings:
    # Every canary answered with an error (not a timeout) this long after having served.
    window: float = field(default=600.0, metadata=_duration())


@dataclass(frozen=True)
class AdmissionSettings:
    """Adaptive admission (AIMD) through the control API: shrink on OOMs a flush did not stop."""

    enabled: bool = True
    oom_threshold: int = 2
    window: float = field(default=60.0, metadata=_duration())
    decrease_factor: float = field(default=0.5, metadata=_ratio())
    min_limit: int = 1
    recover_after: float = field(default=300.0, metadata=_duration())
    max_wait: float = field(default=3600.0, metadata=_duration())


@dataclass(frozen=True)
class EscalationSettings:
    """Restarts that do not cure: the same GPU restarted this often within the window is suspect."""

    restarts: int = 2
    window: float = field(default=86400.0, metadata=_duration())
    node_condition: bool = False  # opt-in: set the Node condition GPUSuspect=True
    # The Warning Event GPUSuspect on the Node (needs `create events` in `default`). Off: the
    # suspect is still logged, in /status and in gpu_watchdog_gpu_suspect, and nothing is written.
    node_event: bool = True


@dataclass(frozen=True)
class InPlaceSettings:
    """restart.strategy container: in-place restarts for one reason that do not cure escalate to the pod."""

    max_restarts: int = 2  # in-place restarts for the same reason within the window; the next is the pod's
    window: float = field(default=3600.0, metadata=_duration())


@dataclass(frozen=True)
class RestartBudgetSettings:
    """Two bounds per window: a restart loop (`max_restarts` for one lineage: the same GPU, else the
    same node, else the same pod), and the workload's allowance, which grows with its replicas:
    max(max_restarts, ceil(per_replica x replicas))."""

    max_restarts: int = 3
    window: float = field(default=3600.0, metadata=_duration())
    per_replica: float = 1.0


@dataclass(frozen=True)
class FleetSettings:
    """The replicas of one workload restart through one ledger (a Lease): at most `max_unavailable`
    at once, and none while the breaker is open (more than `breaker` of the replicas restarted for
    one reason within `window` and one came back failing the same way)."""

    enabled: bool = True
    max_unavailable: str = field(default="25%", metadata={"parse": parse_share, "kind": "share"})
    breaker: float = field(default=0.5, metadata=_ratio())
    window: float = field(default=3600.0, metadata=_duration())
    # A slot is given back when its target serves again (or its replacement does); this long at most.
    slot_timeout: float = field(default=1800.0, metadata=_duration())
    # The Lease's name; empty: gpu-watchdog-<workload>.
    lease_name: str = ""


@dataclass(frozen=True)
class QuarantineSettings:
    """The query of death: a request in flight at `failures` failures of the workload within `window`,
    on two pods or processes, is refused by every replica for `ttl`."""

    enabled: bool = True
    failures: int = 2
    window: float = field(default=3600.0, metadata=_duration())
    ttl: float = field(default=3600.0, metadata=_duration())


@dataclass(frozen=True)
class PolicySettings:
    memory_pressure: MemoryPressureSettings = MemoryPressureSettings()
    fragmentation: FragmentationSettings = FragmentationSettings()
    hang: HangSettings = HangSettings()
    stall: StallSettings = StallSettings()
    # Model loading can take many minutes: before the first successful canary nothing restarts,
    # until this long has passed.
    startup_timeout: float = field(default=1800.0, metadata=_duration())
    unservable: UnservableSettings = UnservableSettings()
    max_age: float = field(default=86400.0, metadata=_duration(positive=False))  # 0 = never
    max_age_jitter: float = field(default=0.1, metadata=_ratio())
    restart_budget: RestartBudgetSettings = RestartBudgetSettings()
    fleet: FleetSettings = FleetSettings()
    quarantine: QuarantineSettings = QuarantineSettings()
    in_place: InPlaceSettings = InPlaceSettings()
    admission: AdmissionSettings = AdmissionSettings()
    escalation: EscalationSettings = EscalationSettings()


@dataclass(frozen=True)
class RestartSettings:
    strategy: str = field(default="evict", metadata={"choices": STRATEGIES})
    drain_timeout: float = field(default=30.0, metadata=_duration(positive=False))
    retry_initial: float = field(default=1.0, metadata=_duration())
    retry_max: float = field(default=30.0, metadata=_duration())
    max_attempts: int = 20
    grace_period: float | None = field(default=None, metadata=_duration(positive=False))
    verdict_file: str = VERDICT_FILE  # strategy container: the file the liveness probe reads


@dataclass(frozen=True)
class KubernetesSettings:
    pod_name: str = "${POD_NAME}"
    namespace: str = "${POD_NAMESPACE}"
    kubeconfig: str | None = None
    request_timeout: float = field(default=10.0, metadata=_duration())
    # The kubelet's PodResources API tells which GPUs this pod got (null: not asked).
    pod_resources_socket: str | None = None
    # The node this pod runs on (downward API spec.nodeName): where a suspect GPU is reported.
    node_name: str = "${NODE_NAME}"
    # The workload whose restart budget this pod shares with every generation of its pods (the
    # chart sets its Deployment's name). Empty: the pod's controller, read from the API at start.
    workload: str = "${GPU_WATCHDOG_WORKLOAD}"


@dataclass(frozen=True)
class ServerSettings:
    host: str = "0.0.0.0"
    port: int = 9402


@dataclass(frozen=True)
class Settings:
    target: TargetSettings = TargetSettings()
    sampling: SamplingSettings = SamplingSettings()
    canary: CanarySettings = CanarySettings()
    policy: PolicySettings = PolicySettings()
    restart: RestartSettings = RestartSettings()
    kubernetes: KubernetesSettings = KubernetesSettings()
    server: ServerSettings = ServerSettings()


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


_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _join(path: str, key: object) -> str:
    """A readable key path even for odd keys: `canary.interval`, `canary['a b']`, `[1]`."""
    if isinstance(key, str) and _PLAIN_KEY.match(key):
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
    if s.policy.hang.consecutive_timeouts < 1:
        errors.append("policy.hang.consecutive_timeouts: must be at least 1")
    if s.policy.fragmentation.empty_cache_attempts < 1:
        errors.append("policy.fragmentation.empty_cache_attempts: must be at least 1")
    if s.policy.restart_budget.max_restarts < 1:
        errors.append("policy.restart_budget.max_restarts: must be at least 1"
                      " (use restart.strategy none to never restart)")
    if s.policy.restart_budget.per_replica <= 0:
        errors.append("policy.restart_budget.per_replica: must be greater than 0")
    a = s.policy.admission
    if a.oom_threshold < 1:
        errors.append("policy.admission.oom_threshold: must be at least 1")
    if a.min_limit < 1:
        errors.append("policy.admission.min_limit: must be at least 1")
    if not 0 < a.decrease_factor < 1:
        errors.append("policy.admission.decrease_factor: must be between 0 and 1 (exclusive)")
    if a.max_wait < a.recover_after:
        errors.append("policy.admission.max_wait: must not be below policy.admission.recover_after")
    if s.policy.escalation.restarts < 1:
        errors.append("policy.escalation.restarts: must be at least 1")
    if s.restart.max_attempts < 1:
        errors.append("restart.max_attempts: must be at least 1")
    if s.restart.retry_max < s.restart.retry_initial:
        errors.append("restart.retry_max: must not be below restart.retry_initial")
    if not 1 <= s.server.port <= 65535 and s.server.port != 0:
        errors.append("server.port: must be between 1 and 65535")
    if s.policy.in_place.max_restarts < 1:
        errors.append("policy.in_place.max_restarts: must be at least 1")
    if s.policy.quarantine.failures < 2:
        # One failure says nothing of a request: it was in flight, as its neighbours were.
        errors.append("policy.quarantine.failures: must be at least 2 (failures on two pods or processes)")
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
    if not 1 <= s.target.workers <= 256:
        errors.append("target.workers: must be between 1 and 256")
    elif s.target.workers > 1 and (s.target.http is not None or s.target.openai_url is not None):
        errors.append("target.workers: only with the control API (target.control_url), not target.http or"
                      " target.openai_url")


# <deployment>-<pod-template-hash>-<5 characters>: how a Deployment's ReplicaSet names its pods.
_DEPLOYMENT_POD = re.compile(r"^(?P<workload>.+)-[a-z0-9]{1,10}-[a-z0-9]{5}$")


def workload_of(settings: Settings) -> str:
    """The restart budget's key: `kubernetes.workload`, else the Deployment a pod name belongs to,
    else the pod itself (a bare pod is its own workload)."""
    k = settings.kubernetes
    if k.workload:
        return k.workload
    m = _DEPLOYMENT_POD.match(k.pod_name)
    return m.group("workload") if m else k.pod_name


def metrics_url(target: TargetSettings) -> str | None:
    """Where the target's own Prometheus page is, with "auto" resolved."""
    if target.metrics_url != METRICS_AUTO:
        return target.metrics_url
    served = target.http.url if target.http is not None else target.openai_url
    if served is None:
        return BUNDLED_METRICS_URL
    m = re.match(r"^(https?://[^/\s]+)", served)
    return (m.group(1) if m else served.rstrip("/")) + "/metrics"


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
    if not 100 <= h.expect_status <= 599:
        errors.append(f"target.http.expect_status: expected an HTTP status (100-599), got {h.expect_status}")
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
