"""N pods of one Deployment, each a real model server and a real `gpu-watchdog run` sidecar.

    async with Fleet(kmock, tmp_path, replicas=8, sidecar_config={"policy": {"fleet": {...}}}) as fleet:
        await fleet.hang(fleet.pods()[0])
        await fleet.wait_until(lambda: fleet.deletions(), 30, "a restart")
        assert fleet.max_restarting() <= 2

The harness is also the cluster's ReplicaSet controller and kubelet: a pod really deleted or evicted
(not a dry run) has its two processes stopped with SIGTERM and a replacement pod created at once,
named as a ReplicaSet names its pods, with its own processes; the kubelet's readiness probe (the
sidecar's `/readyz`, polled) sets each pod's Ready condition, which the disruption budget counts.
A timeline records what happened, for assertions on how many replicas were down at once.

With a `Scheduler` (tests.fleet.scheduler) each pod asks for one GPU (a DRA claim, or the device
plugin's `nvidia.com/gpu`) and is placed on the card the scheduler picks, reading the node taints and
DeviceTaintRules in the cluster at that moment; the harness is then also the resourceclaim controller
(a claim `<pod>-gpu`, allocated, for each DRA pod; deleted with its pod) and the binder. A pod no card
fits stays Pending, without processes, and is placed as soon as one does (a pod removed, a node or
DeviceTaintRule written through the API, or the probe loop's periodic retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import io
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import yaml

from gpu_watchdog.watchdog.cli.replay import replay_main
from tests.fleet import cluster as k8s
from tests.fleet.cluster import Cluster, PodRemoval, Write
from tests.fleet.scheduler import GPU_RESOURCE, Placement, Scheduler
from tests.helpers import ROOT, Proc, free_port, json_lines, spawn, spawn_python

# The alphabet Kubernetes names generated objects with (k8s.io/apimachinery/pkg/util/rand): no vowels,
# no look-alike digits.
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`, dicts merged key by key, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def base_sidecar_config(model_port: int, sidecar_port: int, kubeconfig: Path) -> dict[str, Any]:
    return {
        "target": {"openai_url": f"http://127.0.0.1:{model_port}", "metrics_url": None},
        "canary": {"interval": "300ms", "timeout": "1s"},
        "policy": {"hang": {"consecutive_timeouts": 2}},
        "restart": {"strategy": "delete", "max_attempts": 3, "retry_initial": "100ms"},
        "kubernetes": {"pod_name": "${POD_NAME}", "namespace": "${POD_NAMESPACE}", "node_name": "${NODE_NAME}",
                       "kubeconfig": str(kubeconfig)},
        "server": {"host": "127.0.0.1", "port": sidecar_port},
    }


def write_kubeconfig(path: Path, url: str, namespace: str) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fleet",
        "clusters": [{"name": "fleet", "cluster": {"server": url}}],
        "users": [{"name": "fleet", "user": {"token": "not-a-real-token"}}],
        "contexts": [{"name": "fleet", "context": {"cluster": "fleet", "user": "fleet", "namespace": namespace}}],
    }))


@dataclass(frozen=True)
class Moment:
    """One thing that happened. kind: created | scheduled | unschedulable | ready | unready | deleted |
    evicted | dry_delete | dry_evict | refused_delete | refused_evict | stopped | exited | device_health
    (and model_ready | model_exited for serve pods)."""

    at: float
    kind: str
    pod: str
    detail: dict[str, Any] = field(default_factory=dict)


# Said at every sample or canary while nothing changes: a failed test's account leaves them out.
NOISE = frozenset({"canary_failed", "canary_ok", "server_metrics", "server_metrics_unavailable", "nvml_unavailable",
                   "recorder_started", "workload", "watchdog_started", "target_unreachable"})
SHOWN = ("reason", "process", "inflight", "fingerprint", "fingerprints", "why", "action", "error", "pod", "waited_s",
         "workload_failures", "evidence", "instance_id", "outcome")


def account(lines: list[dict[str, Any]]) -> list[str]:
    """A sidecar's log as one short line per thing it decided or did (its time of day, event and
    the fields that tell it)."""
    out = []
    for line in lines:
        if line.get("event") in NOISE:
            continue
        fields = " ".join(f"{k}={json.dumps(line[k])[:80]}" for k in SHOWN if k in line)
        out.append(f"  {str(line.get('timestamp', ''))[11:23]} {line.get('event')} {fields}"[:240])
    return out


@dataclass
class FleetPod:
    """One pod: its processes, ports and life. `generation` 0 for the Deployment's first pods; a
    replacement's is one more than the pod it `replaces`. With a scheduler: `node` is "" while the pod is
    Pending; `card` its GPU as its allocatedResourcesStatus names it (DRA `gpu.nvidia.com/<pool>/<device>`,
    device plugin the card's UUID)."""

    name: str
    node: str
    generation: int
    replaces: str | None
    model_port: int
    sidecar_port: int
    hang_after: int | None
    config_path: Path
    created_at: float
    control_port: int = 0  # serve's control API (model "serve")
    model: Proc | None = None
    sidecar: Proc | None = None
    ready_at: float | None = None  # the first /readyz 200
    ready: bool = False  # the probe's last answer
    removed_at: float | None = None
    removed_how: str | None = None  # delete | evict
    exited: bool = False  # the sidecar ended by itself while its pod was alive
    model_exits: int = 0  # the model server ended by itself (and the kubelet restarted it in place)
    model_starts: int = 0  # model server processes started in this pod, the first included
    card: str | None = None
    placement: Placement | None = None
    scheduled_at: float | None = None

    @property
    def alive(self) -> bool:
        return self.removed_at is None

    @property
    def scheduled(self) -> bool:
        return bool(self.node)

    @property
    def sidecar_url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar_port}"

    @property
    def model_url(self) -> str:
        return f"http://127.0.0.1:{self.model_port}"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    @property
    def token(self) -> str:
        return f"fleet-token-{self.name}"

    def log_text(self) -> str:
        return self.sidecar.log() if self.sidecar is not None else ""

    def log(self) -> list[dict[str, Any]]:
        """The sidecar's JSON log lines."""
        return json_lines(self.log_text())

    def model_log_text(self) -> str:
        """Every model server process of the pod, in order."""
        logs = sorted(self.config_path.parent.glob(f"{self.name}.model.*.log"),
                      key=lambda p: int(p.stem.rsplit(".", 1)[-1]))
        return "".join(p.read_text(errors="replace") for p in logs)


PodRef = FleetPod | str


class Fleet:
    """The Deployment `deployment` (spec.replicas = `replicas`) in `namespace`, its ReplicaSet
    `<deployment>-<10-char hash>` and its pods, each with a model server and a sidecar.

    - `sidecar_config`: deep-merged over the base config (see `base_sidecar_config`).
    - `hang_after` / `replacement_hang_after`: how the first pods' / the replacements' model servers
      start (`--hang-after N`; None: healthy). `set_replacement_hang_after` changes the latter mid-test.
    - `replacement_delay`: seconds a replacement's processes take to start (a model still loading).
    - `replacement_node`: "fresh" (a node no pod has used yet: node-<N>, node-<N+1>, ...) or "same"
      (the node of the pod it replaces).
    - `min_available`: a PodDisruptionBudget over the Deployment's pods (None: none).
    - `ready_timeout`: how long the first pods' sidecars may take to become ready on entry.
    - `model`: "toy" (tests.fleet.model_server) or "serve" (the bundled server on the built-in model,
      with fault injection; the sidecar drives its control API). A serve process that exits by itself
      is started again in its pod, as the kubelet restarts a container; `serve_faults` are injected
      into every serve process once it is ready (`serve_ready` says which are).
    - `sidecar_env`: more environment for one pod's sidecar (its clock skewed, say), by pod.
    - `corrupt_nodes`: the toy model servers of pods on these nodes answer probes wrong (`--corrupt`): a
      card that computes wrong, whatever process runs on it.
    - `scheduler`: places each pod on a GPU card (see the module's doc; `replacement_node` is then
      not used); None: every pod on a node of its own, without GPUs in its spec, as before.
    """

    def __init__(self, cluster: Any, tmp_path: Path, replicas: int = 8,
                 sidecar_config: dict[str, Any] | None = None, *, namespace: str = "serving",
                 deployment: str = "llm", hang_after: int | None = None, replacement_hang_after: int | None = None,
                 replacement_node: str = "fresh", replacement_delay: float = 0.0,
                 min_available: int | None = None, ready_timeout: float = 90.0,
                 probe_interval: float = 0.2, stop_timeout: float = 5.0, env: dict[str, str] | None = None,
                 seed: int | None = None, clock: Callable[[], float] = time.monotonic, model: str = "toy",
                 serve_faults: list[dict[str, Any]] | None = None, scheduler: Scheduler | None = None,
                 sidecar_env: Callable[[FleetPod], dict[str, str]] | None = None,
                 serve_args: tuple[str, ...] = (), corrupt_nodes: frozenset[str] = frozenset()) -> None:
        if not isinstance(cluster, Cluster):
            raise TypeError(f"Fleet needs the extended emulator tests.fleet.cluster.Cluster, got"
                            f" {type(cluster).__name__}: use the `kmock` fixture under tests/fleet/ (its conftest"
                            f" selects the class) or @pytest.mark.kmock(cls=Cluster)")
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, not {replicas}")
        if model not in ("toy", "serve"):
            raise ValueError(f"model: 'toy' or 'serve', not {model!r}")
        if replacement_node not in ("fresh", "same"):
            raise ValueError(f"replacement_node: 'fresh' or 'same', not {replacement_node!r}")
        if scheduler is not None and scheduler.cluster is not cluster:
            raise ValueError("the scheduler places pods in another cluster than the fleet's")
        self.cluster: Cluster = cluster
        self.dir = tmp_path / "fleet"
        self.replicas = replicas
        self.sidecar_config = sidecar_config or {}
        self.namespace = namespace
        self.deployment = deployment
        self.hang_after = hang_after
        self.replacement_hang_after = replacement_hang_after
        self.replacement_node = replacement_node
        self.replacement_delay = replacement_delay
        self.min_available = min_available
        self.ready_timeout = ready_timeout
        self.probe_interval = probe_interval
        self.stop_timeout = stop_timeout
        self.env = env or {}
        self.sidecar_env = sidecar_env
        self.corrupt_nodes = corrupt_nodes
        self.clock = clock
        self.model = model
        self.serve_faults = serve_faults or []
        self.serve_args = serve_args  # more of `serve`'s flags, as the chart adds them
        self.serve_ready: set[tuple[str, int]] = set()  # (pod, start): ready with its faults injected
        self.random = random.Random(seed)
        self.template_hash = "".join(self.random.choice(NAME_ALPHABET) for _ in range(10))
        self.replica_set_name = f"{deployment}-{self.template_hash}"
        self.labels = {"app": deployment}
        self.timeline: list[Moment] = []
        self.all_pods: dict[str, FleetPod] = {}  # every pod ever, in creation order
        self._restarting: set[str] = set()  # replacements not yet ready, each standing for one restart
        self._restarting_series: list[tuple[float, int]] = []
        self._nodes_used = 0
        self._rs: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._unhook: list[Callable[[], None]] = []
        self._probe_task: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._kubeconfig = self.dir / "kubeconfig"
        self.scheduler = scheduler
        self._pending: list[str] = []  # pods no card fits yet, oldest first (the scheduling queue)
        self.started_at = clock()

    # --- life -------------------------------------------------------------------------------------------------

    async def __aenter__(self) -> Fleet:
        self.started_at = self.clock()
        self.dir.mkdir(parents=True, exist_ok=True)
        write_kubeconfig(self._kubeconfig, str(self.cluster.url).rstrip("/"), self.namespace)
        self._http = aiohttp.ClientSession()
        try:
            wanted = k8s.deployment(self.deployment, self.namespace, self.replicas, self.labels)
            if self.scheduler is not None:
                self._request_gpu(wanted["spec"]["template"]["spec"])  # the ReplicaSet and its pods copy it
            deploy = self.cluster.add(wanted)
            self._rs = self.cluster.add(k8s.replica_set(deploy, self.template_hash))
            if self.min_available is not None:
                self.cluster.set_disruption_budget(self.namespace, self.deployment, self.labels, self.min_available)
            self._unhook += [self.cluster.on_pod_removed(self._on_removed), self.cluster.on_write(self._on_write)]
            first = [self._create_pod(replaces=None, ready=True) for _ in range(self.replicas)]
            placed = [pod for pod in first if pod.scheduled]  # a Pending one starts once it is placed
            await asyncio.gather(*(self._start(pod) for pod in placed))
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())
            await self.wait_until(lambda: all(p.ready_at is not None for p in placed), self.ready_timeout,
                                  f"all {len(placed)} placed sidecars ready")
        except BaseException:
            await self._close(failed=True)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._close(failed=exc is not None)

    async def _close(self, failed: bool) -> None:
        for unhook in self._unhook:
            unhook()
        self._unhook.clear()
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        # Starts and stops in flight finish first, so that no process is left behind.
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await asyncio.gather(*(self._stop_procs(p) for p in self.all_pods.values()), return_exceptions=True)
        if self._http is not None:
            await self._http.close()
            self._http = None
        if failed:
            self.print_logs()
        else:
            self.check_recordings()

    def check_recordings(self) -> None:
        """Every sidecar's flight recording, folded through the same core by `gpu-watchdog replay`,
        gives the decisions that sidecar took, evaluation for evaluation."""
        for pod in self.all_pods.values():
            path = self.dir / f"{pod.name}.flight.jsonl"
            if not path.exists():
                continue
            out, err = io.StringIO(), io.StringIO()
            code = replay_main([str(path)], None, [], out=out, err=err)
            summary = json.loads(out.getvalue().splitlines()[-1])
            # A sidecar killed at the end may leave its last line cut: what came before still counts.
            assert code == 0 or "cut short" in err.getvalue(), (pod.name, err.getvalue())
            assert summary["identical"] and summary["ticks"] > 0, (pod.name, summary)

    def print_logs(self, lines: int = 10) -> None:
        """A failed test's report: each sidecar's account (its decisions, records and restarts, the
        repeated sampling noise left out) first, since a long report is cut in its middle, then the
        timeline and each sidecar's raw last `lines`."""
        out: list[str] = []
        for pod in self.all_pods.values():
            out.append(f"--- sidecar {pod.name} (node {pod.node}, generation {pod.generation},"
                       f" {'alive' if pod.alive else 'gone'}): its account ---")
            out += account(pod.log())
        out.append(f"--- fleet timeline ({len(self.timeline)} moments) ---")
        out += [f"{m.at - self.started_at:8.3f}s {m.kind:<14} {m.pod} {m.detail or ''}" for m in self.timeline]
        for pod in self.all_pods.values():
            tail = pod.log_text().splitlines()[-lines:]
            out.append(f"--- sidecar {pod.name} last {len(tail)} lines ---")
            out += tail
        print("\n".join(out), file=sys.stdout, flush=True)

    # --- the ReplicaSet controller and the kubelet ---------------------------------------------------------

    def _next_node(self) -> str:
        node = f"node-{self._nodes_used}"
        self._nodes_used += 1
        return node

    def _new_name(self) -> str:
        while True:
            name = f"{self.replica_set_name}-{''.join(self.random.choice(NAME_ALPHABET) for _ in range(5))}"
            if name not in self.all_pods:
                return name

    def _create_pod(self, replaces: FleetPod | None, ready: bool) -> FleetPod:
        if self.scheduler is not None:
            return self._create_scheduled_pod(replaces, ready)
        node = replaces.node if replaces is not None and self.replacement_node == "same" else self._next_node()
        pod = self._new_pod(replaces, node)
        name = pod.name
        self.cluster.add(k8s.pod_of(self._rs, name, node, ready=ready, wall=self.cluster.wall))
        self._moment("created", name, node=node, replaces=pod.replaces, hang_after=pod.hang_after)
        return pod

    # --- the scheduler's side: placement, binding, the claims ---------------------------------------------

    def _request_gpu(self, spec: dict[str, Any]) -> None:
        """One GPU for the inference container: a DRA claim from the template `gpu`, or the device plugin's
        extended resource (requests defaulted from limits, as the API server defaults them)."""
        assert self.scheduler is not None
        inference = next(c for c in spec["containers"] if c["name"] == "inference")
        resources = inference.setdefault("resources", {})
        if self.scheduler.mode == "dra":
            spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
            resources["claims"] = [{"name": "gpu"}]
        else:
            resources["limits"] = {**resources.get("limits", {}), GPU_RESOURCE: "1"}
            resources["requests"] = {**resources.get("requests", {}), GPU_RESOURCE: "1"}

    def _new_pod(self, replaces: FleetPod | None, node: str) -> FleetPod:
        """A new pod's name, ports and life, kept in `all_pods` (`node` "": not scheduled yet)."""
        name = self._new_name()
        pod = FleetPod(name=name, node=node, generation=0 if replaces is None else replaces.generation + 1,
                       replaces=None if replaces is None else replaces.name, model_port=free_port(),
                       sidecar_port=free_port(),
                       hang_after=self.hang_after if replaces is None else self.replacement_hang_after,
                       config_path=self.dir / f"{name}.yaml", created_at=self.clock(),
                       control_port=free_port() if self.model == "serve" else 0)
        self.all_pods[name] = pod
        return pod

    def _create_scheduled_pod(self, replaces: FleetPod | None, ready: bool) -> FleetPod:
        assert self.scheduler is not None
        pod = self._new_pod(replaces, "")
        name = pod.name
        # Created unscheduled, as the ReplicaSet controller creates it; the scheduler reads its tolerations.
        self.cluster.add(k8s.unscheduled(k8s.pod_of(self._rs, name, "", ready=ready, wall=self.cluster.wall),
                                         "waiting for the scheduler", wall=self.cluster.wall))
        self._moment("created", name, node=None, replaces=pod.replaces, hang_after=pod.hang_after)
        placement = self.scheduler.place(name, self.namespace)
        if placement is None:
            self._unschedulable(pod)
        else:
            self._bind(pod, placement, ready)
        return pod

    def _unschedulable(self, pod: FleetPod) -> None:
        assert self.scheduler is not None
        message = self.scheduler.refusals.get(pod.name, "no node fits")

        def change(obj: dict[str, Any]) -> None:
            for c in obj["status"].get("conditions") or []:
                if c.get("type") == "PodScheduled":
                    c.update(status="False", reason="Unschedulable", message=message)

        self.cluster.mutate("pods", self.namespace, pod.name, change)
        self._pending.append(pod.name)
        self._moment("unschedulable", pod.name, message=message)

    def _bind(self, pod: FleetPod, placement: Placement, ready: bool) -> None:
        """The claim allocated (DRA), then the pod bound to the node and running (the kubelet's status:
        its containers started, Ready as `ready` says until the probe says otherwise)."""
        assert self.scheduler is not None
        stored = self.cluster.read("pods", self.namespace, pod.name)
        assert stored is not None
        dra = self.scheduler.mode == "dra"
        if dra:
            assert placement.driver is not None
            self.cluster.add(k8s.resource_claim(stored, "gpu", placement.driver, placement.pool, placement.device))
        running = k8s.pod_of(self._rs, pod.name, placement.node, ready=ready, wall=self.cluster.wall)["status"]
        if dra:
            running["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": f"{pod.name}-gpu"}]

        def change(obj: dict[str, Any]) -> None:
            obj["spec"]["nodeName"] = placement.node
            obj["status"] = copy.deepcopy(running)

        self.cluster.mutate("pods", self.namespace, pod.name, change)
        pod.node, pod.card, pod.placement, pod.scheduled_at = placement.node, placement.card, placement, self.clock()
        self._moment("scheduled", pod.name, node=placement.node, card=placement.card)

    def _retry_pending(self) -> None:
        """Another try for each Pending pod, oldest first; a placed one starts."""
        if self.scheduler is None or not self._pending:
            return
        for name in list(self._pending):
            pod = self.all_pods[name]
            if not pod.alive:
                self._pending.remove(name)
                continue
            placement = self.scheduler.place(name, self.namespace)
            if placement is None:
                continue
            self._pending.remove(name)
            self._bind(pod, placement, ready=False)
            self._spawn_task(self._start(pod))

    def _config(self, pod: FleetPod) -> dict[str, Any]:
        base = base_sidecar_config(pod.model_port, pod.sidecar_port, self._kubeconfig)
        if self.model == "serve":
            base["target"] = {"control_url": pod.control_url, "token_file": None, "openai_url": None,
                              "metrics_url": f"{pod.model_url}/metrics"}
        base["recorder"] = {"path": str(self.dir / f"{pod.name}.flight.jsonl")}
        return deep_merge(base, self.sidecar_config)

    def _model_argv(self, pod: FleetPod) -> list[str]:
        if self.model == "serve":
            return ["-m", "gpu_watchdog", "serve", "--device", "cpu", "--host", "127.0.0.1",
                    "--port", str(pod.model_port), "--control-port", str(pod.control_port), "--fault-injection",
                    *self.serve_args]
        argv = ["-m", "tests.fleet.model_server", "--port", str(pod.model_port)]
        if pod.hang_after is not None:
            argv += ["--hang-after", str(pod.hang_after)]
        if pod.node in self.corrupt_nodes:
            argv.append("--corrupt")
        return argv

    def _model_env(self, pod: FleetPod) -> dict[str, str] | None:
        if self.model != "serve":
            return None
        # One key for the workload (the chart's Secret): every replica fingerprints a request alike.
        return {"GPU_WATCHDOG_TOKEN": pod.token, "GPU_WATCHDOG_FINGERPRINT_KEY": f"key-of-{self.deployment}",
                "GPU_WATCHDOG_TERMINATION_LOG": str(self.dir / f"{pod.name}.termination-log")}

    def _spawn_model(self, pod: FleetPod) -> Proc:
        pod.model_starts += 1
        proc = spawn_python(self._model_argv(pod), self.dir / f"{pod.name}.model.{pod.model_starts}.log",
                            self._model_env(pod), ROOT)
        return proc

    async def _serve_faults(self, pod: FleetPod, start: int) -> None:
        """Once this serve process is ready: `serve_faults` injected, then it counts as ready."""
        assert self._http is not None
        headers = {"Authorization": f"Bearer {pod.token}"}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        while pod.alive and pod.model_starts == start and loop.time() < deadline:
            if await self._get_status(pod.model_url + "/readyz") == 200:
                for fault in self.serve_faults:
                    async with self._http.post(pod.control_url + "/control/fault", json=fault, headers=headers,
                                               timeout=aiohttp.ClientTimeout(total=5)) as r:
                        assert r.status == 200, await r.text()
                self.serve_ready.add((pod.name, start))
                self._moment("model_ready", pod.name, start=start)
                return
            await asyncio.sleep(0.1)

    async def _start(self, pod: FleetPod) -> None:
        if pod.replaces is not None and self.replacement_delay > 0:
            await asyncio.sleep(self.replacement_delay)
            if not pod.alive:
                return
        pod.config_path.write_text(yaml.safe_dump(self._config(pod)))
        env = {"POD_NAME": pod.name, "POD_NAMESPACE": self.namespace, "NODE_NAME": pod.node,
               # Not the runner's: the sidecar learns its workload from its pod, as in the cluster.
               "GPU_WATCHDOG_TOKEN": pod.token if self.model == "serve" else "", "GPU_WATCHDOG_WORKLOAD": "",
               **self.env}
        if self.sidecar_env is not None:
            env = {**env, **self.sidecar_env(pod)}
        # Popen of a Python costs milliseconds each: off the loop that also serves the API.
        pod.model, pod.sidecar = await asyncio.gather(
            asyncio.to_thread(self._spawn_model, pod),
            asyncio.to_thread(spawn, ["run", "--config", str(pod.config_path)], self.dir / f"{pod.name}.sidecar.log",
                              env))
        if not pod.alive:  # removed while starting: the kubelet stops what it just started
            await self._stop_procs(pod)
        elif self.model == "serve":
            self._spawn_task(self._serve_faults(pod, pod.model_starts))

    async def _kubelet(self, pod: FleetPod) -> None:
        """A model server that ended by itself is started again in its pod (restartPolicy Always)."""
        if pod.model is None or pod.model.proc.poll() is None or not pod.alive or pod.removed_at is not None:
            return
        pod.model_exits += 1
        self._moment("model_exited", pod.name, code=pod.model.proc.returncode, start=pod.model_starts)
        pod.model = await asyncio.to_thread(self._spawn_model, pod)
        self._spawn_task(self._serve_faults(pod, pod.model_starts))

    async def _stop_procs(self, pod: FleetPod) -> None:
        """SIGTERM to both at once, as the kubelet stops a pod's containers; SIGKILL after `stop_timeout`.
        Waited for on the loop: a thread each would queue behind the few the default pool has."""
        procs = [p.proc for p in (pod.sidecar, pod.model) if p is not None and p.proc.poll() is None]
        if not procs:
            return
        for proc in procs:
            proc.terminate()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.stop_timeout
        while any(proc.poll() is None for proc in procs) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        killed = [proc for proc in procs if proc.poll() is None]
        for proc in killed:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        self._moment("stopped", pod.name, exit_codes=[proc.returncode for proc in procs], killed=len(killed))

    def _spawn_task(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_write(self, write: Write) -> None:
        if (self.scheduler is not None and write.ok and not write.dry_run
                and write.resource in ("nodes", "devicetaintrules")):
            self._retry_pending()  # a taint lifted may let a Pending pod in
        if write.resource != "pods" or write.verb not in ("delete", "evict") or write.name not in self.all_pods:
            return
        noun = "deleted" if write.verb == "delete" else "evicted"
        if not write.ok:
            kind = f"refused_{write.verb}"
        elif write.dry_run:
            kind = f"dry_{write.verb}"
        else:
            kind = noun
        self._moment(kind, write.name, code=write.code, dry_run=write.dry_run, reason=write.reason)

    def _on_removed(self, removal: PodRemoval) -> None:
        # Called inside the API request that removed the pod: the controller's reaction is immediate.
        if removal.namespace != self.namespace or removal.name not in self.all_pods:
            return
        gone = self.all_pods[removal.name]
        gone.removed_at, gone.removed_how, gone.ready = removal.at, removal.how, False
        self._spawn_task(self._stop_procs(gone))
        if self.scheduler is not None:
            # Its card is free again (its claim goes with it), first for the pods already waiting.
            self.scheduler.release(gone.name)
            if gone.name in self._pending:
                self._pending.remove(gone.name)
            self.cluster.remove("resourceclaims", self.namespace, f"{gone.name}-gpu")
            self._retry_pending()
        # A replacement of a pod that never became ready continues the same restart, not a new one.
        self._restarting.discard(gone.name)
        if len(self.pods()) < self._desired():
            replacement = self._create_pod(replaces=gone, ready=False)
            self._restarting.add(replacement.name)
            if replacement.scheduled:
                self._spawn_task(self._start(replacement))
        self._restarting_series.append((self.clock(), len(self._restarting)))

    async def scale(self, replicas: int) -> list[FleetPod]:
        """`kubectl scale` and the ReplicaSet's reaction: the pods beyond those alive created (growth,
        not replacements: none of them stands for a restart) and started; the new pods."""
        self.cluster.scale(self.namespace, self.deployment, replicas)
        self.cluster.scale(self.namespace, self.replica_set_name, replicas, plural="replicasets")
        grown = [self._create_pod(replaces=None, ready=False) for _ in range(max(0, replicas - len(self.pods())))]
        await asyncio.gather(*(self._start(pod) for pod in grown if pod.scheduled))
        return grown

    def _desired(self) -> int:
        found = self.cluster.read("deployments", self.namespace, self.deployment)
        return int(found["spec"]["replicas"]) if found is not None else self.replicas

    async def _probe_loop(self) -> None:
        while True:
            self._retry_pending()  # what changed without an API write (a test's own taint, say)
            live = [p for p in self.all_pods.values() if p.alive and p.sidecar is not None]
            await asyncio.gather(*(self._probe(p) for p in live))
            await asyncio.sleep(self.probe_interval)

    async def _probe(self, pod: FleetPod) -> None:
        assert self._http is not None and pod.sidecar is not None
        await self._kubelet(pod)
        if pod.sidecar.proc.poll() is not None:
            if not pod.exited:  # on its own: the kubelet here does not restart containers
                pod.exited = True
                self._moment("exited", pod.name, code=pod.sidecar.proc.returncode)
            ok = False
        else:
            ok = await self._get_status(pod.sidecar_url + "/readyz") == 200
        if not pod.alive:
            return  # removed while the probe was out
        if ok and pod.ready_at is None:
            pod.ready_at = self.clock()
            if pod.name in self._restarting:
                self._restarting.discard(pod.name)
                self._restarting_series.append((pod.ready_at, len(self._restarting)))
        if ok != pod.ready:
            pod.ready = ok
            self.cluster.set_pod_ready(self.namespace, pod.name, ok)
            self._moment("ready" if ok else "unready", pod.name)

    async def _get_status(self, url: str) -> int:
        assert self._http is not None
        try:
            async with self._http.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                await r.read()
                return r.status
        except (aiohttp.ClientError, TimeoutError):
            return 0

    def _moment(self, kind: str, pod: str, **detail: Any) -> None:
        self.timeline.append(Moment(self.clock(), kind, pod, detail))

    # --- what tests use ------------------------------------------------------------------------------------------

    def _pod(self, pod: PodRef) -> FleetPod:
        if isinstance(pod, FleetPod):
            return pod
        if pod not in self.all_pods:
            raise KeyError(f"no pod {pod!r} in the fleet (pods: {', '.join(self.all_pods)})")
        return self.all_pods[pod]

    def pods(self) -> list[FleetPod]:
        """The pods alive now (not deleted), oldest first."""
        return [p for p in self.all_pods.values() if p.alive]

    def pod(self, name: str) -> FleetPod:
        return self._pod(name)

    def replacements(self) -> list[FleetPod]:
        """Every pod created to replace another, in order."""
        return [p for p in self.all_pods.values() if p.replaces is not None]

    def deletions(self, dry_run: bool = False) -> list[Moment]:
        """The pods deleted or evicted (`dry_run`: those only asked about), in order."""
        kinds = ("dry_delete", "dry_evict") if dry_run else ("deleted", "evicted")
        return [m for m in self.timeline if m.kind in kinds]

    def restarting(self) -> int:
        """Replicas restarting now: removed, and their replacement's sidecar not yet ready."""
        return len(self._restarting)

    def max_restarting(self) -> int:
        """The most replicas restarting at once over the run so far."""
        return max((n for _, n in self._restarting_series), default=0)

    def restarting_series(self) -> list[tuple[float, int]]:
        """(time, replicas restarting) at every change."""
        return list(self._restarting_series)

    def pending(self) -> list[FleetPod]:
        """The pods alive and not placed (Pending), oldest first."""
        return [self.all_pods[name] for name in self._pending if self.all_pods[name].alive]

    def set_device_health(self, pod: PodRef, health: str, message: str | None = None) -> None:
        """The kubelet's report of the pod's GPU (KEP-4680): the inference container's
        `allocatedResourcesStatus`, `[{name, resources: [{resourceID, health, message}]}]`, with name
        `claim:gpu/gpu` and resourceID `<driver>/<pool>/<device>` (DRA), or `nvidia.com/gpu` and the
        card's UUID (device plugin). `health`: Healthy | Unhealthy | Unknown."""
        if health not in ("Healthy", "Unhealthy", "Unknown"):
            raise ValueError(f"health: Healthy, Unhealthy or Unknown, not {health!r}")
        p = self._pod(pod)
        if self.scheduler is None or p.card is None:
            raise ValueError(f"{p.name} holds no GPU card: device health needs a Fleet with a scheduler and a"
                             f" placed pod")
        name = "claim:gpu/gpu" if self.scheduler.mode == "dra" else GPU_RESOURCE
        resource: dict[str, Any] = {"resourceID": p.card, "health": health}
        if message is not None:
            resource["message"] = message
        done = self.cluster.set_pod_status(self.namespace, p.name, containers={
            "inference": {"allocatedResourcesStatus": [{"name": name, "resources": [resource]}]}})
        if done is None:
            raise KeyError(f"{p.name} is gone")
        self._moment("device_health", p.name, card=p.card, health=health, message=message)

    def set_replacement_hang_after(self, n: int | None) -> None:
        """How the model servers of replacements created from now on start (None: healthy)."""
        self.replacement_hang_after = n

    def logs(self, pod: PodRef) -> list[dict[str, Any]]:
        """The JSON lines of a pod's sidecar log (gone pods too)."""
        return self._pod(pod).log()

    def events_of(self, pod: PodRef, event: str) -> list[dict[str, Any]]:
        """A sidecar's log lines whose `event` is `event`."""
        return [line for line in self.logs(pod) if line.get("event") == event]

    async def status(self, pod: PodRef) -> dict[str, Any]:
        """The sidecar's /status JSON."""
        assert self._http is not None
        p = self._pod(pod)
        async with self._http.get(p.sidecar_url + "/status", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                raise AssertionError(f"{p.name}: /status answered {r.status}: {(await r.text())[:300]}")
            data: dict[str, Any] = await r.json()
            return data

    async def fault(self, pod: PodRef, kind: str) -> dict[str, Any]:
        """Inject a fault into a pod's model server: hang | error | clear."""
        assert self._http is not None
        p = self._pod(pod)
        async with self._http.post(p.model_url + "/fault", json={"kind": kind},
                                   timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                raise AssertionError(f"{p.name}: fault {kind!r} answered {r.status}: {(await r.text())[:300]}")
            data: dict[str, Any] = await r.json()
            return data

    async def control(self, pod: PodRef, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """A call to a serve pod's control API (its token)."""
        assert self._http is not None
        p = self._pod(pod)
        async with self._http.request(method, p.control_url + path, json=body,
                                      headers={"Authorization": f"Bearer {p.token}"},
                                      timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                raise AssertionError(f"{p.name}: {method} {path} answered {r.status}: {(await r.text())[:300]}")
            data: dict[str, Any] = await r.json()
            return data

    async def complete(self, pod: PodRef, body: dict[str, Any], timeout: float = 60) -> tuple[int, Any]:
        """POST /v1/completions to a serve pod: (status, JSON body); (0, error) when no answer came."""
        assert self._http is not None
        try:
            async with self._http.post(self._pod(pod).model_url + "/v1/completions", json=body,
                                       timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status, await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return 0, repr(exc)

    async def hang(self, pod: PodRef) -> None:
        await self.fault(pod, "hang")

    async def hang_all(self) -> None:
        await asyncio.gather(*(self.hang(p) for p in self.pods()))

    async def clear(self, pod: PodRef) -> None:
        await self.fault(pod, "clear")

    async def model_stats(self, pod: PodRef) -> dict[str, Any]:
        assert self._http is not None
        async with self._http.get(self._pod(pod).model_url + "/stats", timeout=aiohttp.ClientTimeout(total=5)) as r:
            data: dict[str, Any] = await r.json()
            return data

    async def wait_until(self, predicate: Callable[[], Any], timeout: float, what: str,
                         interval: float = 0.1) -> Any:
        """Poll `predicate` (sync or async) until it is truthy; its value. On timeout an AssertionError
        naming `what` and the fleet's state."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            if loop.time() >= deadline:
                raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; {self.describe()}")
            await asyncio.sleep(interval)  # yields to the emulator, which serves from this loop

    def describe(self) -> str:
        alive = ", ".join(f"{p.name}@{p.node or '(pending)'}{f' {p.card}' if p.card else ''}"
                          f"{'' if p.ready else ' (unready)'}" for p in self.pods())
        recent = "; ".join(f"{m.kind} {m.pod}" for m in self.timeline[-8:])
        return (f"{len(self.pods())} pods alive [{alive}], {self.restarting()} restarting,"
                f" {len(self.deletions())} removed; recent: {recent}")
