"""The samplers one target needs, built whole from the settings: none exists half-configured."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core.selector import parse as parse_selector
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.edge.control_client import ControlClient
from gpu_watchdog.watchdog.edge.samplers.allocator import AllocatorSampler
from gpu_watchdog.watchdog.edge.samplers.canary import Canary, CanarySampler, OpenAICanary
from gpu_watchdog.watchdog.edge.samplers.device_health import DeviceHealthSampler, pod_reader
from gpu_watchdog.watchdog.edge.samplers.http_canary import HttpCanary
from gpu_watchdog.watchdog.edge.samplers.nvml import NvmlBackend, NvmlSampler
from gpu_watchdog.watchdog.edge.samplers.server_metrics import ServerMetricsSampler
from gpu_watchdog.watchdog.edge.samplers.workers import WorkersSampler

log = logs.get("watchdog")


@dataclass(frozen=True)
class Samplers:
    nvml: NvmlSampler
    canary: Canary
    # The bundled server's control API: allocator figures, and the effects (flush, drain, limit).
    control: ControlClient | None
    allocator: AllocatorSampler | None
    server_metrics: ServerMetricsSampler | None
    # Our pod's devices' health from its status: only where the Kubernetes API is configured.
    device_health: DeviceHealthSampler | None
    # The service's other workers (target.workers > 1), each on its own control port.
    workers: WorkersSampler | None = None


def build_samplers(settings: Settings, session: aiohttp.ClientSession, clock: Callable[[], float],
                   token: str | None, nvml_backend: NvmlBackend, server_metrics_url: str | None) -> Samplers:
    s = settings
    control: ControlClient | None = None
    allocator: AllocatorSampler | None = None
    canary: Canary
    if s.target.http is not None:
        canary = HttpCanary(s.target.http, session, clock, s.canary.timeout, s.target.api_key_file)
    elif s.target.openai_url is None:
        control = ControlClient(s.target.control_url, token, session)
        allocator = AllocatorSampler(control, clock)
        canary = CanarySampler(control, clock, s.canary.timeout)
    else:
        canary = OpenAICanary(s.target.openai_url, s.target.openai_model, s.target.api_key_file, session, clock,
                              s.canary.timeout)
    server_metrics = None
    if server_metrics_url is not None:
        headers = canary.headers if isinstance(canary, OpenAICanary | HttpCanary) else dict
        progress = None if s.target.progress_metric is None else parse_selector(s.target.progress_metric)
        server_metrics = ServerMetricsSampler(server_metrics_url, session, clock, timeout=s.sampling.server_timeout,
                                              headers=headers, progress=progress,
                                              worker="0" if s.target.workers > 1 else None)
    workers = None if control is None or s.target.workers < 2 else WorkersSampler(
        s.target.control_url, s.target.workers, token, session, clock, s.canary.timeout)
    return Samplers(NvmlSampler(nvml_backend, clock), canary, control, allocator, server_metrics,
                    _device_health(settings, clock), workers)


def _device_health(settings: Settings, clock: Callable[[], float]) -> DeviceHealthSampler | None:
    try:
        read_pod = pod_reader(settings)
    except Exception as exc:  # a kubeconfig that does not load: the other evidence still stands
        log.warning("device_health_unavailable", error=str(exc)[:300])
        return None
    return None if read_pod is None else DeviceHealthSampler(read_pod, clock, settings.sampling.device_health_interval)
