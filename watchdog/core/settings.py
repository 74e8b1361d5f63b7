"""The sidecar's settings: frozen dataclasses, each field with its default, its bounds and its
one-line meaning (the configuration reference and the chart's schema are generated from them).

Pure: nothing here reads a file, the environment or the network. `watchdog.edge.config` loads and
checks a YAML file into these; the rules (`policy`, `fleet`, `quarantine`, ...) read them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpu_watchdog.units import parse_duration, parse_ratio, parse_share, parse_size
from gpu_watchdog.watchdog.core.names import ENFORCE_ALL, ENFORCE_SHADOW, ENFORCEABLE
from gpu_watchdog.watchdog.core.timing import QUARANTINE_SYNC_S

STRATEGIES = ("evict", "delete", "container", "local", "none")
# Where the sidecar publishes a `container` verdict: an emptyDir the inference container's liveness
# probe reads (helm/gpu-watchdog/files/verdict-probe.sh).
VERDICT_FILE = "/var/run/gpu-watchdog-verdict/restart"
HTTP_METHODS = ("GET", "POST", "PUT")
METRICS_AUTO = "auto"
BUNDLED_METRICS_URL = "http://127.0.0.1:8000/metrics"  # the inference container's public port


def _about(meaning: str, **meta: Any) -> dict[str, Any]:
    """A setting's metadata: its one-line meaning (the configuration reference and the chart's
    schema are generated from it) and its bounds, which the loader enforces and both documents
    state: `min`/`max` (inclusive), `gt`/`lt` (exclusive), `why` (said with a broken bound)."""
    return {"help": meaning, **meta}


def _duration(meaning: str, positive: bool = True, **meta: Any) -> dict[str, Any]:
    return _about(meaning, parse=parse_duration, positive=positive, kind="duration", **meta)


def _ratio(meaning: str, **meta: Any) -> dict[str, Any]:
    return _about(meaning, parse=parse_ratio, kind="ratio", **meta)


@dataclass(frozen=True)
class HttpTargetSettings:
    """A canary for any HTTP model server: one request, judged by its status and, optionally, a key."""

    url: str = field(default="", metadata=_about("The URL the canary request goes to (required with target.http)."))
    method: str = field(default="POST", metadata=_about("The canary request's method.", choices=HTTP_METHODS))
    body: Any = field(default=None, metadata=_about("The canary's body, sent as JSON.", kind="json"))
    body_file: str | None = field(default=None, metadata=_about(
        "A file whose bytes are the canary's body, sent as they are (JSON or not), read once at start."))
    headers: dict[str, str] = field(default_factory=dict, metadata=_about(
        "Extra request headers; `${VAR}` is replaced from the environment."))
    api_key_file: str | None = field(default=None, metadata=_about("A file holding a key sent as a Bearer token."))
    expect_status: int = field(default=200, metadata=_about("The status a serving target answers with.",
                                                            min=100, max=599))
    expect_json: str | None = field(default=None, metadata=_about(
        "A key path that must be in the answer (`outputs.0.data`); null: the status alone decides."))


@dataclass(frozen=True)
class TargetSettings:
    control_url: str = field(default="http://127.0.0.1:8001", metadata=_about(
        "The bundled server's (or the agent's) control API: canary, memory report, empty_cache, drain."))
    token_file: str | None = field(default="/var/run/gpu-watchdog/token", metadata=_about(
        "The control API's bearer token; GPU_WATCHDOG_TOKEN wins when set."))
    # Any OpenAI-compatible server (vLLM, TGI, SGLang, ...), with or without the `/v1` suffix.
    openai_url: str | None = field(default=None, metadata=_about(
        "Canary an OpenAI-compatible server (vLLM, TGI, SGLang) at this URL instead of the control API."))
    openai_model: str | None = field(default=None, metadata=_about(
        "The model the OpenAI canary asks for; null: the first id of GET /v1/models, re-read after a restart."))
    api_key_file: str | None = field(default=None, metadata=_about(
        "A file holding the OpenAI server's API key, sent as a Bearer token."))
    metrics_url: str | None = field(default=METRICS_AUTO, metadata=_about(
        "The target's Prometheus page; auto: openai_url's origin + /metrics, or the bundled server's public port;"
        " null: none (canary timeouts alone decide a hang)."))
    http: HttpTargetSettings | None = field(default=None, metadata=_about(
        "Canary any HTTP model server (Triton, TorchServe, LitServe, TEI, one's own) by one request."))
    # Canary timeouts while the counter advances mean saturated, not hung.
    progress_metric: str | None = field(default=None, metadata=_about(
        "The target's counter of finished work on its metrics page (`name` or `name{label=\"v\"}`)."))
    # Worker k's control API is on control_url's port + k (`serve --workers N`, the agent under
    # `uvicorn --workers N`): the first is watched by every rule, the others by their own canaries.
    workers: int = field(default=1, metadata=_about(
        "The service's worker processes, each with its control API on the next port.", min=1, max=256))


@dataclass(frozen=True)
class SamplingSettings:
    nvml_interval: float = field(default=1.0, metadata=_duration("How often NVML is read (memory, Xids, health)."))
    torch_interval: float = field(default=5.0, metadata=_duration(
        "How often the server's allocator figures are read (GET /control/memory)."))
    server_interval: float = field(default=5.0, metadata=_duration("How often the server's metrics page is read."))
    device_health_interval: float = field(default=30.0, metadata=_duration(
        "How often our pod's status is read for its devices' health (one GET of the pod; Kubernetes API only)."))
    # Its own timeout, not the interval's: a saturated server answers its page late, and a late
    # reading is evidence where a timed-out one is none. A failed scrape is retried at the next tick.
    server_timeout: float = field(default=5.0, metadata=_duration("How long one read of the metrics page may take."))


@dataclass(frozen=True)
class CanarySettings:
    interval: float = field(default=30.0, metadata=_duration("How often a one-token canary inference runs."))
    timeout: float = field(default=10.0, metadata=_duration(
        "How long a canary may take before it counts as a timeout (at most 10 x interval)."))


@dataclass(frozen=True)
class MemoryPressureSettings:
    reserved_ratio: float = field(default=0.85, metadata=_ratio(
        "Reserved memory at or above this share of the card empties the cache."))
    cooldown: float = field(default=60.0, metadata=_duration(
        "The least time between two flushes for memory pressure or OOMs.", positive=False))


@dataclass(frozen=True)
class FragmentationSettings:
    ratio: float = field(default=0.30, metadata=_ratio(
        "(reserved - allocated) / reserved at or above this is fragmentation drift."))
    window: float = field(default=600.0, metadata=_duration("One drift episode: flushes within it count together."))
    empty_cache_attempts: int = field(default=3, metadata=_about(
        "Flushes in one drift episode before a drained restart.", min=1))
    # Off by default: a busy server is slower too, and load is no reason to restart.
    latency_factor: float = field(default=0.0, metadata=_about(
        "Canary latency this many times its own baseline counts as drift too; 0: off."))


@dataclass(frozen=True)
class HangSettings:
    consecutive_timeouts: int = field(default=3, metadata=_about(
        "Canary timeouts in a row, with the server's work counter flat, that make a hang.", min=1))
    # A server whose work counter was readable and whose page now times out too is not proven
    # hung: its timeouts decide alone only once no reading has come for this long.
    no_evidence_after: float = field(default=120.0, metadata=_duration(
        "With the counter unreadable after it was read, how long before the timeouts decide alone."))


@dataclass(frozen=True)
class StallSettings:
    window: float = field(default=60.0, metadata=_duration(
        "Requests waiting (or running, with the canary unanswered) while the work counter stays flat"
        " this long: a hang."))


@dataclass(frozen=True)
class UnservableSettings:
    window: float = field(default=600.0, metadata=_duration(
        "Every canary answered with an error (not a timeout) this long after having served: a drained restart."))


@dataclass(frozen=True)
class AdmissionSettings:
    """Adaptive admission (AIMD) through the control API: shrink on OOMs a flush did not stop."""

    enabled: bool = field(default=True, metadata=_about("Lower the admission limit on OOMs a flush did not stop."))
    oom_threshold: int = field(default=2, metadata=_about("OOMs within the window that lower the limit.", min=1))
    window: float = field(default=60.0, metadata=_duration("The window the OOMs are counted in."))
    decrease_factor: float = field(default=0.5, metadata=_ratio(
        "The rows on the card are cut to this share at each step down.", gt=0, lt=1))
    min_limit: int = field(default=1, metadata=_about("The limit is never cut below this.", min=1))
    recover_after: float = field(default=300.0, metadata=_duration(
        "A quiet period with the limit in full use after which it grows one step."))
    max_wait: float = field(default=3600.0, metadata=_duration(
        "The longest wait before probing back to a limit that failed (at least recover_after)."))


@dataclass(frozen=True)
class EscalationSettings:
    """Restarts that do not cure: the same GPU restarted this often within the window is suspect."""

    restarts: int = field(default=2, metadata=_about(
        "Restarts of one GPU for context_loss or hang within the window that make it a suspect.", min=1))
    window: float = field(default=86400.0, metadata=_duration("The window those restarts are counted in."))
    node_condition: bool = field(default=False, metadata=_about(
        "Also set the Node condition GPUSuspect=True (opt-in; needs patch on nodes/status)."))
    # Off: the suspect is still logged, in /status and in gpu_watchdog_gpu_suspect, and nothing is written.
    node_event: bool = field(default=True, metadata=_about(
        "Write the Warning Event GPUSuspect on the Node (needs create events in `default`)."))


@dataclass(frozen=True)
class InPlaceSettings:
    """restart.strategy container: in-place restarts for one reason that do not cure escalate to the pod."""

    max_restarts: int = field(default=2, metadata=_about(
        "In-place restarts for the same reason within the window; the next one is the pod's.", min=1))
    window: float = field(default=3600.0, metadata=_duration("The window those restarts are counted in."))


@dataclass(frozen=True)
class RestartBudgetSettings:
    """Two bounds per window: a restart loop (`max_restarts` for one lineage: the same GPU, else the
    same node, else the same pod), and the workload's allowance, which grows with its replicas:
    max(max_restarts, ceil(per_replica x replicas))."""

    max_restarts: int = field(default=3, metadata=_about(
        "Restarts of one lineage (the same GPU, else node, else pod) within the window.", min=1,
        why="use restart.strategy none to never restart"))
    window: float = field(default=3600.0, metadata=_duration("The window restarts are counted in."))
    per_replica: float = field(default=1.0, metadata=_about(
        "The workload's allowance: max(max_restarts, ceil(per_replica x replicas)) per window.", gt=0))


@dataclass(frozen=True)
class FleetSettings:
    """The replicas of one workload restart through one ledger (a Lease): at most `max_unavailable`
    at once, and none while the breaker is open (more than `breaker` of the replicas restarted for
    one reason within `window` and one came back failing the same way)."""

    enabled: bool = field(default=True, metadata=_about("Restart through the workload's Lease ledger."))
    max_unavailable: str = field(default="25%", metadata=_about(
        "Replicas restarting at once, a count (2) or a share (25%, rounded down, at least 1).",
        parse=parse_share, kind="share"))
    breaker: float = field(default=0.5, metadata=_ratio(
        "Open the breaker when more than this share restarted for one reason and one came back failing."))
    window: float = field(default=3600.0, metadata=_duration("The window the breaker counts restarts in."))
    slot_timeout: float = field(default=1800.0, metadata=_duration(
        "A slot is given back when its target serves again (or its replacement does); this long at most."))
    lease_name: str = field(default="", metadata=_about("The Lease's name; empty: gpu-watchdog-<workload>."))


@dataclass(frozen=True)
class QuarantineSettings:
    """The query of death: a request in flight at `failures` failures of the workload within `window`,
    on two pods or processes, is refused by every replica for `ttl`."""

    enabled: bool = field(default=True, metadata=_about("Record what was in flight at failures and quarantine."))
    # One failure says nothing of a request: it was in flight, as its neighbours were.
    failures: int = field(default=2, metadata=_about(
        "Failures, on two pods or processes, a request must be in flight at to be quarantined.", min=2,
        why="failures on two pods or processes"))
    window: float = field(default=3600.0, metadata=_duration("The window those failures are counted in."))
    ttl: float = field(default=3600.0, metadata=_duration("How long every replica refuses a quarantined request."))
    # Two turns of the replicas' syncs (QUARANTINE_SYNC_S) to say they answered it, and a margin for
    # the API server's clock each learned (1 s stamps): an innocent request in flight beside a killer
    # is dropped before anyone refuses it.
    confirm: float = field(default=2 * QUARANTINE_SYNC_S + 2.0, metadata=_duration(
        "How long a new quarantine waits, served as before, for a replica to say it answered the request"
        " (then it is dropped) before every replica refuses it; 0: at once.", positive=False))


PROMPT_MAX = 2000  # characters of one probe prompt (the control API's bound)


def parse_prompts(value: Any) -> tuple[str, ...]:
    """A list of non-empty prompts, at most 32 of them."""
    if not isinstance(value, list | tuple) or len(value) > 32:
        raise ValueError("expected a list of at most 32 prompts")
    for i, p in enumerate(value):
        if not isinstance(p, str) or not 0 < len(p) <= PROMPT_MAX:
            raise ValueError(f"[{i}]: expected a non-empty string of at most {PROMPT_MAX} characters")
    return tuple(value)


@dataclass(frozen=True)
class CorrectnessSettings:
    """Answers checked: a probe set answered greedily with log-probabilities, compared with the reference
    the workload's replicas agreed on (kept in its Lease); `consecutive` deviations in a row restart."""

    enabled: bool = field(default=False, metadata=_about(
        "Ask the probes and compare their answers with the fleet's agreed reference."))
    every: int = field(default=10, metadata=_about(
        "One probe every this many canary intervals (after the probe set was answered once).", min=1))
    prompts: tuple[str, ...] = field(default=(), metadata=_about(
        "The probe set's prompts; empty: the built-in ones. Each card answers every one once; those whose"
        " agreed first token leads by `margin` are asked after that.", parse=parse_prompts, kind="list"))
    tokens: int = field(default=3, metadata=_about("Tokens generated per probe.", min=1, max=16))
    top_logprobs: int = field(default=2, metadata=_about(
        "Log-probabilities asked per token (the runner-up gives the margin).", min=2, max=5))
    margin: float = field(default=2.0, metadata=_about(
        "A token is compared only where the reference's leads the runner-up by this many nats.", gt=0))
    tolerance: float = field(default=0.5, metadata=_about(
        "A log-probability further than this (nats) from the reference's is a deviation.", gt=0))
    consecutive: int = field(default=2, metadata=_about(
        "Deviations in a row that make the process corrupt (never one alone).", min=2,
        why="never act on a single deviation"))
    quorum: int = field(default=2, metadata=_about(
        "Cards that must answer alike (and be more than half of those that answered) to agree a reference.",
        min=2, why="one card's answer is not an agreement"))


PLACEMENT_STRATEGIES = ("off", "none", "device", "node")
DEVICE_EFFECTS = ("NoSchedule", "NoExecute")
NODE_EFFECTS = ("NoSchedule", "PreferNoSchedule")


@dataclass(frozen=True)
class PlacementSettings:
    """Keep a sick GPU out of the next placement: where the evidence is about the card, it is tainted
    before the pod rung acts (a DeviceTaintRule for a DRA device; opt-in, the node of a device-plugin
    GPU), at most `max_nodes` and `max_percent` of the workload's nodes or cards at once, each for `ttl`."""

    strategy: str = field(default="off", metadata=_about(
        "off: nothing; none: report what would be tainted; device: a DeviceTaintRule for a DRA GPU; node: also"
        " the node taint of a device-plugin GPU (the whole node: opt-in).", choices=PLACEMENT_STRATEGIES))
    effect: str = field(default="NoSchedule", metadata=_about(
        "The taint's effect: NoSchedule; NoExecute (devices only) also evicts what uses the device;"
        " PreferNoSchedule (nodes only) is a hint.", choices=("NoSchedule", "NoExecute", "PreferNoSchedule")))
    max_nodes: int = field(default=2, metadata=_about(
        "Nodes or cards of the workload tainted by us at once, at most (many failing at once is not many bad"
        " cards).", min=1, max=64))
    max_percent: float = field(default=50.0, metadata=_about(
        "And at most this share of the workload's nodes or cards, in percent (rounded up).", min=1, max=100))
    ttl: float = field(default=86400.0, metadata=_duration(
        "Each taint's expiry: lifted then by the sidecar that placed it, or any sidecar of the workload."))
    memory: float = field(default=7 * 86400.0, metadata=_duration(
        "How long a card's and a node's remediations are remembered in the workload's Lease."))
    repeat_days: int = field(default=2, metadata=_about(
        "A card remediated on this many different days is suspect at its first fault of another day.", min=1))


def parse_enforce(value: Any) -> tuple[str, ...]:
    """`policy.enforce`: `all`, `shadow`, or a list of actions and reasons (`[hang, empty_cache]`); an
    empty list is `shadow`."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(v, str) for v in items):
        raise ValueError(f"expected all, shadow or a list of actions and reasons, got {value!r}")
    unknown = [v for v in items if v not in ENFORCEABLE]
    if unknown:
        raise ValueError(f"unknown {', '.join(map(repr, unknown))} (expected all, shadow, or any of"
                         f" {', '.join(ENFORCEABLE[2:])})")
    if (ENFORCE_ALL in items or ENFORCE_SHADOW in items) and len(items) > 1:
        raise ValueError("all and shadow stand alone, not in a list with others")
    return tuple(dict.fromkeys(items)) if items else (ENFORCE_SHADOW,)


@dataclass(frozen=True)
class PolicySettings:
    # First, for it governs every rule below: what runs dark is decided and reported, never performed.
    enforce: tuple[str, ...] = field(default=(ENFORCE_ALL,), metadata=_about(
        "What the sidecar performs: all; shadow (decides, records and reports everything, performs nothing: a"
        " Normal Event says what would restart); or a list of actions (restart, empty_cache, admission,"
        " quarantine, placement) and reasons (hang, context_loss, ...) enforced, the rest in shadow.",
        parse=parse_enforce, kind="enforce"))
    memory_pressure: MemoryPressureSettings = MemoryPressureSettings()
    fragmentation: FragmentationSettings = FragmentationSettings()
    hang: HangSettings = HangSettings()
    stall: StallSettings = StallSettings()
    # Model loading can take many minutes.
    startup_timeout: float = field(default=1800.0, metadata=_duration(
        "Before the first successful canary nothing restarts, until this long has passed."))
    unservable: UnservableSettings = UnservableSettings()
    max_age: float = field(default=86400.0, metadata=_duration(
        "A drained restart of a process older than this; 0: never.", positive=False))
    max_age_jitter: float = field(default=0.1, metadata=_ratio(
        "Up to this share added to max_age per pod, so replicas do not age out together."))
    restart_budget: RestartBudgetSettings = RestartBudgetSettings()
    fleet: FleetSettings = FleetSettings()
    quarantine: QuarantineSettings = QuarantineSettings()
    in_place: InPlaceSettings = InPlaceSettings()
    admission: AdmissionSettings = AdmissionSettings()
    escalation: EscalationSettings = EscalationSettings()
    placement: PlacementSettings = PlacementSettings()
    correctness: CorrectnessSettings = CorrectnessSettings()


@dataclass(frozen=True)
class RestartSettings:
    strategy: str = field(default="evict", metadata=_about(
        "How a restart is done: evict (Eviction API, PDB-respecting), delete, container (in place, through"
        " the liveness probe), local (`gpu-watchdog up`'s child), none (report only).", choices=STRATEGIES))
    drain_timeout: float = field(default=30.0, metadata=_duration(
        "How long a drained restart waits for requests in flight to finish.", positive=False))
    retry_initial: float = field(default=1.0, metadata=_duration(
        "The first wait before a refused or failed restart call is tried again (doubling each time)."))
    retry_max: float = field(default=30.0, metadata=_duration(
        "The longest wait between those tries (at least retry_initial)."))
    max_attempts: int = field(default=20, metadata=_about(
        "Tries of the eviction (or delete) before the restart is given up.", min=1))
    grace_period: float | None = field(default=None, metadata=_duration(
        "The grace period, in seconds, the restarted pod is given to stop; null: the pod's own.", positive=False))
    verdict_file: str = field(default=VERDICT_FILE, metadata=_about(
        "strategy container: the file the inference container's liveness probe reads."))


@dataclass(frozen=True)
class KubernetesSettings:
    pod_name: str = field(default="${POD_NAME}", metadata=_about(
        "This pod's name (downward API); required for evict and delete."))
    namespace: str = field(default="${POD_NAMESPACE}", metadata=_about(
        "This pod's namespace (downward API); required for evict and delete."))
    kubeconfig: str | None = field(default=None, metadata=_about("A kubeconfig file; null: the in-cluster config."))
    request_timeout: float = field(default=10.0, metadata=_duration("How long one Kubernetes API call may take."))
    pod_resources_socket: str | None = field(default=None, metadata=_about(
        "The kubelet's PodResources socket, which tells which GPUs this pod got; null: not asked."))
    node_name: str = field(default="${NODE_NAME}", metadata=_about(
        "The node this pod runs on (downward API spec.nodeName): where a suspect GPU is reported."))
    # The chart sets its Deployment's name.
    workload: str = field(default="${GPU_WATCHDOG_WORKLOAD}", metadata=_about(
        "The workload whose restart budget and Lease this pod shares; empty: the pod's controller, read at start."))


@dataclass(frozen=True)
class ServerSettings:
    host: str = field(default="0.0.0.0", metadata=_about("The address the sidecar's own HTTP server listens on."))
    port: int = field(default=9402, metadata=_about(
        "Its port (/metrics, /healthz, /readyz, /status); 0: any free port.", max=65535))


@dataclass(frozen=True)
class RecorderSettings:
    """The flight recorder: every input the core sees, one JSON line each, for `gpu-watchdog replay`."""

    path: str | None = field(default=None, metadata=_about(
        "The file it appends to (FILE and FILE.1 after a rotation); null: nothing is recorded."))
    max_bytes: int = field(default=64 * 2**20, metadata=_about(
        "The two files together stay within this (`64MiB`, `1GiB` or a number of bytes).", parse=parse_size,
        kind="size", min=2**20))


@dataclass(frozen=True)
class Settings:
    target: TargetSettings = TargetSettings()
    sampling: SamplingSettings = SamplingSettings()
    canary: CanarySettings = CanarySettings()
    policy: PolicySettings = PolicySettings()
    restart: RestartSettings = RestartSettings()
    kubernetes: KubernetesSettings = KubernetesSettings()
    server: ServerSettings = ServerSettings()
    recorder: RecorderSettings = RecorderSettings()


def bounds(meta: Mapping[str, Any]) -> str:
    """A setting's bounds in words (`at least 1`, `between 0 and 1 (exclusive)`), empty when it has none."""
    lo, hi, gt, lt = (_said(meta, meta.get(k)) for k in ("min", "max", "gt", "lt"))
    if lo is not None and hi is not None:
        return f"between {lo} and {hi}"
    if gt is not None and lt is not None:
        return f"between {gt} and {lt} (exclusive)"
    if lo is not None:
        return f"at least {lo}"
    if hi is not None:
        return f"at most {hi}"
    if gt is not None:
        return f"greater than {gt}"
    if lt is not None:
        return f"less than {lt}"
    return ""


def size_text(n: float) -> str:
    """A size as it is written in a config: `64MiB`, `1GiB`, `512KiB`, else bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{int(n // scale)}{unit}"
    return f"{int(n)}"


def _said(meta: Mapping[str, Any], value: float | None) -> str | None:
    if value is None:
        return None
    return size_text(value) if meta.get("kind") == "size" else f"{value:g}"



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
