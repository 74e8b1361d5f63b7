"""The workload's shared ledger in a `coordination.k8s.io/v1` Lease, and its replica count.

Blocking (callers run it through `asyncio.to_thread`). Every change is read, decided by a pure rule
(`watchdog.core.fleet`) and written back with the `resourceVersion` that was read: a write that lost a race
gets 409 and is decided again on what the winner wrote, so a slot is taken once.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import urllib3

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core import correctness, fleet, placement, quarantine
from gpu_watchdog.watchdog.core.fleet import LEDGER_ANNOTATION, Ledger
from gpu_watchdog.watchdog.core.timing import API_RETRY_S, API_TRIES
from gpu_watchdog.watchdog.edge.kube.kube import event_body, event_name, events_path, pod_path
from gpu_watchdog.watchdog.edge.kube.kube_api import (
    ApiError,
    KubeApi,
    api_of,
    micro_time,
    parse_time,
    path,
    second_time,
)

log = logs.get("watchdog.fleet")

T = TypeVar("T")
A = TypeVar("A")
CONFLICT_TRIES = 8  # writers that lost a race; more than this many in a row is an API to report


class LedgerUnavailable(RuntimeError):
    """The ledger could not be read or written: no slot can be known, so none is taken."""


def lease_name(workload: str, configured: str = "") -> str:
    """The Lease's name: configured (the chart's), else gpu-watchdog-<workload> as a DNS name."""
    if configured:
        return configured
    name = re.sub(r"[^a-z0-9.-]+", "-", f"gpu-watchdog-{workload}".lower()).strip("-.")
    return name[:253].rstrip("-.")


def _annotation(lease: dict[str, Any] | None, name: str) -> Any:
    """The annotation as the Lease holds it (garbage too: its parser says it is not ours)."""
    return (((lease or {}).get("metadata") or {}).get("annotations") or {}).get(name)


def transient(exc: BaseException) -> bool:
    """The API server refused this call for now (a 5xx, a 429) or could not be reached: worth another
    try at once; a 4xx it answered (403, 404, 422) is its word, and a call that timed out is not tried
    again here (an API that hangs would hold the ledger API_TRIES times as long)."""
    if isinstance(exc, (TimeoutError, urllib3.exceptions.TimeoutError)):
        return False
    status = getattr(exc, "status", None)
    return status is None or status == 429 or (isinstance(status, int) and status >= 500)


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    if status is not None:
        return f"HTTP {status} {getattr(exc, 'reason', '') or ''}".strip()
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def read_workload(api: KubeApi, workload: str, namespace: str, timeout: float) -> dict[str, Any] | None:
    """The workload's controller: its Deployment, else its StatefulSet; None where it has neither."""
    for plural in ("deployments", "statefulsets"):
        try:
            return api.get(path("/apis/apps/v1/namespaces", namespace, plural, workload), timeout=timeout)
        except ApiError as exc:
            if exc.status != 404:
                raise
    return None


def selector_text(workload: dict[str, Any] | None) -> str | None:
    """The workload's `spec.selector` as a `labelSelector` query; None where it has none (every pod
    of the namespace would match: nothing to count by)."""
    selector = ((workload or {}).get("spec") or {}).get("selector") or {}
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for e in selector.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), ",".join(sorted(e.get("values") or []))
        terms.append({"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})", "Exists": f"{key}",
                      "DoesNotExist": f"!{key}"}.get(op, ""))
    if not terms or not all(terms):
        return None
    return ",".join(terms)


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def census_of(workload: dict[str, Any] | None, pods: list[Any]) -> fleet.Census | None:
    """The census from the workload's controller and the pods its selector listed; None where the
    controller says no count (it has no `spec.replicas`)."""
    desired = ((workload or {}).get("spec") or {}).get("replicas")
    if not isinstance(desired, int) or isinstance(desired, bool) or desired < 0:
        return None
    seen = tuple(fleet.PodSeen(str(meta.get("name")), _ready(p), bool(meta.get("deletionTimestamp")))
                 for p in pods if isinstance(p, dict) for meta in [p.get("metadata") or {}] if meta.get("name"))
    return fleet.Census(desired, seen)


class LeaseLedger:
    def __init__(self, api_client: KubeApi, namespace: str, name: str, workload: str, pod_name: str,
                 request_timeout: float, wall_clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.namespace = namespace
        self.name = name
        self.workload = workload
        self.pod_name = pod_name
        self.timeout = request_timeout
        self.wall_clock = wall_clock
        self.sleep = sleep
        # The annotations this client has read with something in them, or written: one found gone
        # since was deleted (an operator's cleanup, an etcd restore), not yet to be written.
        self._had: set[str] = set()
        self.api = api_of(api_client)

    # -- the ledger --------------------------------------------------------------------------------

    def _leases(self, name: str | None = None) -> str:
        return path("/apis/coordination.k8s.io/v1/namespaces", self.namespace, "leases", name)

    def _get(self) -> dict[str, Any] | None:
        """The Lease (None: there is none yet); LedgerUnavailable when it cannot be read (after API_TRIES
        where the server did not answer)."""
        for attempt in range(API_TRIES):
            if attempt:
                self.sleep(API_RETRY_S * attempt)
            try:
                return self.api.get(self._leases(self.name), timeout=self.timeout)
            except Exception as exc:
                if getattr(exc, "status", None) == 404:
                    return None
                if not transient(exc) or attempt + 1 == API_TRIES:
                    raise LedgerUnavailable(f"cannot read Lease {self.namespace}/{self.name}: {_describe(exc)}"
                                            ) from None
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def read(self) -> Ledger:
        return self._ledger(self._get())

    def _ledger(self, lease: dict[str, Any] | None) -> Ledger:
        return self._parsed(lease, LEDGER_ANNOTATION, fleet.parse, "ledger")

    def _parsed(self, lease: dict[str, Any] | None, annotation: str, parse: Callable[[str | None], A],
                what: str) -> A:
        text = _annotation(lease, annotation)
        if text:
            self._had.add(annotation)
        try:
            return parse(text)
        except ValueError as exc:  # LedgerError, RecordsError
            raise LedgerUnavailable(f"Lease {self.namespace}/{self.name}: its {what} is not ours ({exc})") from None

    def update(self, decide: Callable[[Ledger, float], tuple[Ledger, T]]) -> T:
        """Read, decide (`decide(ledger, wall_now)`), write back if it changed; again on a conflict."""
        return self._update(LEDGER_ANNOTATION, fleet.parse, fleet.dump, "ledger", decide)

    # -- the query of death's records (a second annotation of the same Lease) ----------------------

    def read_records(self) -> quarantine.Records:
        return self._parsed(self._get(), quarantine.ANNOTATION, quarantine.parse, "quarantine records")

    def update_records(self, decide: Callable[[quarantine.Records, float], tuple[quarantine.Records, T]]) -> T:
        """As `update`. Records this client read before and finds gone start again as forgotten
        (`quarantine.lost`): the successes they held, which cleared suspects, are gone with them."""
        return self._update(quarantine.ANNOTATION, quarantine.parse, quarantine.dump, "quarantine records", decide,
                            quarantine.lost)

    # -- the cards kept out of placement (a third annotation) --------------------------------------------

    def read_placement(self) -> placement.Records:
        return self._parsed(self._get(), placement.ANNOTATION, placement.parse, "placement records")

    def update_placement(self, decide: Callable[[placement.Records, float], tuple[placement.Records, T]]) -> T:
        return self._update(placement.ANNOTATION, placement.parse, placement.dump, "placement records", decide)

    # -- the reference answers the replicas agreed on (a fourth annotation) ------------------------------

    def read_correctness(self) -> correctness.Records:
        return self._parsed(self._get(), correctness.ANNOTATION, correctness.parse, "correctness records")

    def update_correctness(self, decide: Callable[[correctness.Records, float], tuple[correctness.Records, T]]
                           ) -> T:
        return self._update(correctness.ANNOTATION, correctness.parse, correctness.dump, "correctness records",
                            decide)

    def _update(self, annotation: str, parse: Callable[[str | None], A], dump: Callable[[A], str], what: str,
                decide: Callable[[A, float], tuple[A, T]], lost: Callable[[float], A] | None = None) -> T:
        unanswered = 0
        for attempt in range(CONFLICT_TRIES):
            if attempt:
                # Writers that lost a race to the same version would collide again in step.
                self.sleep(random.uniform(0.0, 0.05 * 2**min(attempt, 4)))
            lease = self._get()
            had = annotation in self._had
            current = self._parsed(lease, annotation, parse, what)
            now = self.wall_clock()
            if lost is not None and had and not _annotation(lease, annotation):
                current = lost(now)
            new, result = decide(current, now)
            if new == current:
                return result
            try:
                self._write(lease, annotation, dump(new))
            except Exception as exc:
                if getattr(exc, "status", None) == 409:
                    continue  # another replica wrote first: decide again on what it wrote
                unanswered += 1
                if transient(exc) and unanswered < API_TRIES:
                    self.sleep(API_RETRY_S * unanswered)
                    continue  # read and decided again: a write that was done answers 409 then
                raise LedgerUnavailable(f"cannot write Lease {self.namespace}/{self.name}: {_describe(exc)}") from None
            self._had.add(annotation)
            return result
        raise LedgerUnavailable(f"Lease {self.namespace}/{self.name}: {CONFLICT_TRIES} conflicting writes in a row")

    def _write(self, lease: dict[str, Any] | None, annotation: str, text: str) -> None:
        now = micro_time(self.wall_clock())
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace, "annotations": {annotation: text},
                                 "labels": {"app.kubernetes.io/managed-by": "gpu-watchdog"}},
                    "spec": {"holderIdentity": self.pod_name, "renewTime": now}}
            self.api.post(self._leases(), body, timeout=self.timeout)
            return
        meta = dict(lease.get("metadata") or {})
        meta["annotations"] = {**(meta.get("annotations") or {}), annotation: text}
        spec = {**(lease.get("spec") or {}), "holderIdentity": self.pod_name, "renewTime": now}
        # The metadata read carries its resourceVersion: a write in between makes this a 409.
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}
        self.api.put(self._leases(self.name), body, timeout=self.timeout)

    # -- what the cluster says of the workload -------------------------------------------------------

    def replicas(self) -> int | None:
        """The workload's desired replicas: its Deployment's (else StatefulSet's) `spec.replicas`."""
        found = read_workload(self.api, self.workload, self.namespace, self.timeout)
        replicas = ((found or {}).get("spec") or {}).get("replicas")
        return replicas if isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 0 else None

    def census(self) -> fleet.Census | None:
        """What the cluster says of the workload now: its controller's desired replicas and every pod
        its selector matches (GET the Deployment, else StatefulSet; GET pods?labelSelector=). None
        where the workload has no such controller (a bare pod, another kind of owner): there is no
        fleet to count, and the ledger's slots alone bound it, as `spec.replicas` unknown counts as
        one. Raises LedgerUnavailable where either cannot be read, or the controller has no selector
        or count: no count, no slot."""
        try:
            found = read_workload(self.api, self.workload, self.namespace, self.timeout)
            if found is None:
                return None
            selector = selector_text(found)
            if selector is None:
                raise LedgerUnavailable(f"workload {self.namespace}/{self.workload}: no selector to count its"
                                        " pods by")
            listed = self.api.get(pod_path(self.namespace), query={"labelSelector": selector}, timeout=self.timeout)
        except LedgerUnavailable:
            raise
        except Exception as exc:
            raise LedgerUnavailable(f"cannot count the pods of {self.namespace}/{self.workload}: {_describe(exc)}") \
                from None
        items = listed.get("items") if isinstance(listed, dict) else None
        census = census_of(found, items if isinstance(items, list) else [])
        if census is None or not isinstance(items, list):
            raise LedgerUnavailable(f"workload {self.namespace}/{self.workload}: no replica count or pod list to"
                                    " count by")
        return census

    def own_pod(self) -> fleet.OwnPod:
        """Our pod's creation (wall clock) and template: a replacement is a pod of the slot's template
        created after the slot was taken."""
        found = self.api.get(pod_path(self.namespace, self.pod_name), timeout=self.timeout)
        meta = found.get("metadata") or {}
        labels = meta.get("labels") or {}
        template = next((labels[k] for k in fleet.TEMPLATE_LABELS if labels.get(k)), None)
        return fleet.OwnPod(parse_time(meta.get("creationTimestamp")), template)

    def report_quarantine(self, q: quarantine.Quarantined, lifted: bool = False) -> None:
        """A Warning Event on the workload (its Deployment): a request fingerprint quarantined, or lifted."""
        if lifted:
            note = f"gpu-watchdog lifted the quarantine of request fingerprint {q.fingerprint} in {self.workload}."
        else:
            start = "" if q.in_force_at is None else (
                f" from {second_time(q.in_force_at)} (unless a replica says first that it answered it)")
            note = (f"gpu-watchdog refuses request fingerprint {q.fingerprint} on every replica of {self.workload}"
                    f"{start} until {second_time(q.until)}: it was in flight at {len(q.failures)} failures"
                    f" (pods {', '.join(q.pods)})."
                    " A request is killing replicas: find its client by this fingerprint in the access log;"
                    " lift with `gpu-watchdog quarantine lift`.")
        body = event_body(event_name(self.workload), self.namespace, self._regarding(),
                          "QuarantineLifted" if lifted else "RequestQuarantined", note,
                          "LiftQuarantine" if lifted else "Quarantine", "Normal" if lifted else "Warning",
                          self.pod_name, {"gpu-watchdog.io/fingerprint": q.fingerprint}, self.wall_clock())
        self.api.post(events_path(self.namespace), body, timeout=self.timeout)

    def _regarding(self) -> dict[str, str]:
        return {"kind": "Deployment", "apiVersion": "apps/v1", "name": self.workload, "namespace": self.namespace}

    def report_breaker(self, breaker: fleet.Breaker) -> None:
        """A Warning Event on the workload (its Deployment): the breaker opened."""
        note = (f"gpu-watchdog stopped restarts of {self.workload} fleet-wide: {len(breaker.restarted)} of"
                f" {breaker.replicas} replicas were restarted for {breaker.reason} and one came back failing the same"
                f" way (pods {', '.join(breaker.restarted)}). A restart does not cure this fault; reset with"
                " `gpu-watchdog fleet reset-breaker` once it is fixed.")
        body = event_body(event_name(self.workload), self.namespace, self._regarding(), "FleetBreakerOpen", note,
                          "StopRestarts", "Warning", self.pod_name, {"gpu-watchdog.io/reason": breaker.reason},
                          self.wall_clock())
        self.api.post(events_path(self.namespace), body, timeout=self.timeout)
