"""Prometheus metrics of the watchdog (prefix `gpu_watchdog_`).

Event counters are incremented where things happen; everything sampled is exposed by a
collector that only reads the latest snapshot, so a scrape never calls NVML or HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpu_watchdog.watchdog.core import correctness
from gpu_watchdog.watchdog.core.fleet import FleetView
from gpu_watchdog.watchdog.core.names import (
    EMPTY_CACHE_REASONS,
    ERROR_CLASSES,
    FLEET_HOLDS,
    PLACEMENT_ACTIONS,
    RESTART_REASONS,
    RUNGS,
    STATES,
)
from gpu_watchdog.watchdog.core.samples import ServerSample
from gpu_watchdog.watchdog.core.views import Snapshot, WorkerRow

P = "gpu_watchdog_"

class SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        read = [g for g in s.gpus if g.available and not g.lost]
        if read:
            for name, doc, field in (
                ("gpu_memory_used_bytes", "GPU memory used (NVML)", "memory_used_bytes"),
                ("gpu_memory_total_bytes", "GPU memory total (NVML)", "memory_total_bytes"),
                ("gpu_utilization_ratio", "GPU utilization 0-1 (NVML)", "utilization_ratio"),
                ("gpu_temperature_celsius", "GPU temperature (NVML)", "temperature_celsius"),
                ("gpu_power_watts", "GPU power draw (NVML)", "power_watts"),
            ):
                fam = GaugeMetricFamily(P + name, doc, labels=["gpu", "uuid"])
                for g in read:
                    fam.add_metric([str(g.index if g.index is not None else ""), g.uuid or ""],
                                   float(getattr(g, field)))
                yield fam
        yield from _server_families(s.server)
        t = s.torch
        if t is not None and t.reachable:
            labels = ["device"]
            for name, doc, value in (
                ("torch_allocated_bytes", "Bytes allocated by tensors (torch allocator)", t.allocated_bytes),
                ("torch_reserved_bytes", "Bytes reserved by the torch caching allocator", t.reserved_bytes),
                ("torch_active_bytes", "Bytes in active blocks", t.active_bytes),
                ("torch_inactive_split_bytes", "Inactive, non-releasable bytes", t.inactive_split_bytes),
                ("fragmentation_ratio", "(reserved - allocated) / reserved", t.fragmentation_ratio),
            ):
                fam = GaugeMetricFamily(P + name, doc, labels=labels)
                fam.add_metric([t.device], float(value))
                yield fam
            for name, doc, value in (
                ("torch_alloc_retries", "cudaMalloc retries after a cache flush (since process start)",
                 t.alloc_retries),
                ("torch_ooms", "Out-of-memory errors seen by the inference process (since process start)", t.ooms),
            ):
                cfam = CounterMetricFamily(P + name, doc, labels=labels)
                cfam.add_metric([t.device], float(value))
                yield cfam
        yield from _worker_families(s.workers)
        m = s.idle_memory
        if m is not None:  # CUDA only: without an allocator there is nothing to follow
            for name, doc, value in (
                ("idle_memory_growth_bytes", "Active bytes at idle above this process's first idle figure",
                 float(m.growth_bytes)),
                ("idle_memory_growth_ratio", "idle_memory_growth_bytes as a share of the GPU's memory", m.growth_ratio),
            ):
                fam = GaugeMetricFamily(P + name, doc, labels=["device"])
                fam.add_metric(["cuda"], value)
                yield fam
        if s.suspects:
            fam = GaugeMetricFamily(P + "gpu_suspect", "1 for a GPU that restarts did not cure (see /status)",
                                    labels=["uuid"])
            for uuid in s.suspects:
                fam.add_metric([uuid], 1.0)
            yield fam
        if s.admission_limit is not None:
            fam = GaugeMetricFamily(P + "admission_limit", "The inference server's admission limit (worst-case slots)")
            fam.add_metric([], float(s.admission_limit))
            yield fam
        c = s.canary
        fam = GaugeMetricFamily(P + "canary_success", "1 when the last canary inference succeeded")
        fam.add_metric([], 1.0 if c is not None and c.ok else 0.0)
        yield fam
        fam = GaugeMetricFamily(P + "restart_budget_remaining", "Restarts still allowed in the budget window")
        fam.add_metric([], float(s.budget_remaining))
        yield fam
        yield from _fleet_families(s.fleet, s.workload or "")
        cfam = CounterMetricFamily(P + "shadow_actions", "Actions decided and not performed (policy.enforce: shadow),"
                                   " by action and reason", labels=["action", "reason"])
        for action, reason, n in s.would:
            cfam.add_metric([action, reason], float(n))
        yield cfam
        fam = GaugeMetricFamily(P + "state", "Current watchdog states (1 = active)", labels=["state"])
        for state in STATES:
            fam.add_metric([state], 1.0 if state in s.states else 0.0)
        yield fam


def _fleet_families(f: FleetView | None, workload: str) -> Iterator[Metric]:
    """The workload's ledger as this sidecar last read it."""
    if f is None:
        return
    if f.replicas is not None:
        fam = GaugeMetricFamily(P + "fleet_replicas", "The workload's desired replicas (its controller's spec)")
        fam.add_metric([], float(f.replicas))
        yield fam
    fam = GaugeMetricFamily(P + "fleet_unavailable", "Replicas of the workload restarting now (slots in use)")
    fam.add_metric([], float(len(f.restarting)))
    yield fam
    fam = GaugeMetricFamily(P + "fleet_max_unavailable", "Replicas of the workload that may restart at once")
    fam.add_metric([], float(f.max_unavailable))
    yield fam
    fam = GaugeMetricFamily(P + "fleet_breaker_open", "1 while the workload's breaker stops restarts fleet-wide",
                            labels=["workload", "reason"])
    fam.add_metric([workload, f.breaker.reason if f.breaker is not None else ""], 1.0 if f.breaker else 0.0)
    yield fam


def _server_families(v: ServerSample | None) -> Iterator[Metric]:
    """The target server's own signals, under one name whatever the server calls them."""
    if v is None:
        return
    labels, values = ["server"], [v.server]
    for name, doc, value in (
        ("server_requests_running", "Requests the target server is running", v.requests_running),
        ("server_requests_waiting", "Requests waiting in the target server's queue", v.requests_waiting),
        ("server_kv_cache_usage_ratio", "Share of the target server's KV cache in use (0-1)", v.kv_cache_usage_ratio),
    ):
        if value is not None:
            fam = GaugeMetricFamily(P + name, doc, labels=labels)
            fam.add_metric(values, float(value))
            yield fam
    for name, doc, value in (
        ("server_generated_tokens", "Tokens the target server generated (its own counter)", v.generated_tokens),
        ("server_preemptions", "Requests the target server preempted (its own counter)", v.preemptions),
    ):
        if value is not None:
            cfam = CounterMetricFamily(P + name, doc, labels=labels)
            cfam.add_metric(values, float(value))
            yield cfam


class WatchdogMetrics:
    def __init__(self, snapshot: Callable[[], Snapshot], registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.canary_duration = Histogram(P + "canary_duration_seconds", "Canary inference latency",
                                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                         registry=r)
        self.canary_failures = Counter(P + "canary_failures", "Failed canaries by error class", ["error_class"],
                                       registry=r)
        self.empty_cache = Counter(P + "empty_cache", "Allocator cache flushes requested", ["reason"], registry=r)
        self.empty_cache_freed = Counter(P + "empty_cache_freed_bytes", "Bytes returned to the driver by flushes",
                                         registry=r)
        self.restarts = Counter(P + "restarts", "Restarts performed, by reason and rung (container in place, pod,"
                                " process)", ["reason", "rung"], registry=r)
        self.xid_errors = Counter(P + "gpu_xid_errors", "Xid events seen by NVML", ["gpu", "uuid", "xid"],
                                  registry=r)
        self.sample_duration = Histogram(P + "sample_duration_seconds", "Time spent taking one sample",
                                         ["sampler"], buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 15),
                                         registry=r)
        self.decisions = Counter(P + "decisions", "Policy decisions by action, reason and outcome",
                                 ["action", "reason", "outcome"], registry=r)
        self.admission_changes = Counter(P + "admission_changes", "Admission limit changes by the watchdog",
                                         ["direction"], registry=r)
        for direction in ("down", "up"):
            self.admission_changes.labels(direction=direction)
        self.saturation_episodes = Counter(P + "saturation_episodes",
                                           "Episodes of canary timeouts while the server kept producing tokens",
                                           registry=r)
        self.progress_unknown_episodes = Counter(
            P + "progress_unknown_episodes",
            "Episodes of canary timeouts while the server's work counter, readable before, could not be read",
            registry=r)
        # How late the sidecar's own loop runs: a loop that lags answers its probes late.
        self.event_loop_lag = Histogram(P + "event_loop_lag_seconds", "How late the sidecar's event loop woke up",
                                        buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
                                        registry=r)
        for error_class in ERROR_CLASSES:
            self.canary_failures.labels(error_class=error_class)
        for reason in RESTART_REASONS:
            for rung in RUNGS:
                self.restarts.labels(reason=reason, rung=rung)
        for reason in EMPTY_CACHE_REASONS:
            self.empty_cache.labels(reason=reason)
        self.fleet_held = Counter(P + "fleet_held", "Restarts held by the workload's ledger (episodes), by why",
                                  ["why"], registry=r)
        for why in FLEET_HOLDS:
            self.fleet_held.labels(why=why)
        # The query of death: fingerprints this sidecar quarantined, and those its server refuses now.
        self.quarantines = Counter(P + "quarantines", "Request fingerprints this sidecar quarantined (in flight at"
                                   " policy.quarantine.failures failures of the workload)", registry=r)
        self.quarantined = Gauge(P + "quarantined", "Request fingerprints the workload refuses now, as pushed to"
                                 " this pod's server", ["workload"], registry=r)
        # Cards kept out of placement: what this sidecar did (tainted, would_taint, capped, lifted, failed,
        # not_possible), the workload's taints of ours as last read, and whether the bound stops the next one.
        self.placement_actions = Counter(P + "placement_actions", "Cards kept out of placement by this sidecar,"
                                         " by action", ["action"], registry=r)
        for action in PLACEMENT_ACTIONS:
            self.placement_actions.labels(action=action)
        self.placement_tainted = Gauge(P + "placement_tainted", "The workload's nodes or cards tainted by gpu-watchdog"
                                       " now, as last read from its Lease", registry=r)
        self.placement_capped = Gauge(P + "placement_capped", "1 while a card the evidence blamed is left untainted"
                                      " by policy.placement's bound (the workload's, from its Lease)", ["workload"],
                                      registry=r)
        # Answers checked: each probe's comparison with the fleet's agreed reference, and whether there is one.
        self.correctness_probes = Counter(P + "correctness_probes", "Correctness probes by result (match, token,"
                                          " logprob, nonfinite, no_reference, unanswered)", ["result"], registry=r)
        for result in correctness.RESULTS:
            self.correctness_probes.labels(result=result)
        self.correctness_reference = Gauge(P + "correctness_reference_agreed", "1 while the workload's replicas"
                                           " have agreed a reference answer for this model and device class",
                                           registry=r)
        # The flight recorder's losses, by why: queue_full (lines dropped), open, write, rotate.
        self.recorder_failures = Counter(P + "recorder_failures", "Flight recorder lines lost, by why",
                                         ["why"], registry=r)
        r.register(SnapshotCollector(snapshot))


def _worker_families(workers: tuple[WorkerRow, ...]) -> Iterator[Metric]:
    """One series per worker of the service (`target.workers` > 1), labelled `worker` and its GPU."""
    if not workers:
        return
    up = GaugeMetricFamily(P + "worker_up", "1 while the worker's control API answers and its context is sound",
                           labels=["worker", "uuid"])
    canary = GaugeMetricFamily(P + "worker_canary_success", "1 if the worker's last canary succeeded",
                               labels=["worker"])
    allocated = GaugeMetricFamily(P + "worker_torch_allocated_bytes", "Bytes allocated by tensors in the worker",
                                  labels=["worker", "uuid"])
    reserved = GaugeMetricFamily(P + "worker_torch_reserved_bytes", "Bytes the worker's caching allocator holds",
                                 labels=["worker", "uuid"])
    for k, t, c in workers:
        uuid = (t.uuid if t is not None else None) or ""
        up.add_metric([str(k), uuid], 1.0 if t is not None and t.reachable and not t.poisoned else 0.0)
        if c is not None:
            canary.add_metric([str(k)], 1.0 if c.ok else 0.0)
        if t is not None and t.reachable:
            allocated.add_metric([str(k), uuid], float(t.allocated_bytes))
            reserved.add_metric([str(k), uuid], float(t.reserved_bytes))
    yield from (up, canary, allocated, reserved)
