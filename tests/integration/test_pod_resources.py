"""Which GPUs are ours: the real gRPC client against a gRPC server on a unix socket serving PodResources.

The stand-in kubelet declares the upstream v1 messages with their other fields too (cpu_ids,
memory, topology, dynamic resources), so the client is shown to read real answers, not only its
own subset.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from gpu_watchdog.watchdog.edge.config import from_mapping
from gpu_watchdog.watchdog.edge.samplers.pod_resources import PodResourcesError, list_pod_gpus
from gpu_watchdog.watchdog.runtime.app import Watchdog
from tests.unit.fake_nvml import A, B, FakeNvml

C, D = "GPU-33333333-cccc", "GPU-44444444-dddd"
T = descriptor_pb2.FieldDescriptorProto


def upstream_messages() -> dict[str, Any]:
    """k8s.io/kubelet/pkg/apis/podresources/v1/api.proto, the messages List answers with."""
    f = descriptor_pb2.FileDescriptorProto(name="kubelet_podresources_v1.proto", package="v1", syntax="proto3")
    opt, rep = T.LABEL_OPTIONAL, T.LABEL_REPEATED

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = f.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            field = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                field.type_name = type_name

    message("ListPodResourcesRequest")
    message("ListPodResourcesResponse", ("pod_resources", 1, T.TYPE_MESSAGE, rep, ".v1.PodResources"))
    message("PodResources", ("name", 1, T.TYPE_STRING, opt, ""), ("namespace", 2, T.TYPE_STRING, opt, ""),
            ("containers", 3, T.TYPE_MESSAGE, rep, ".v1.ContainerResources"))
    message("ContainerResources", ("name", 1, T.TYPE_STRING, opt, ""),
            ("devices", 2, T.TYPE_MESSAGE, rep, ".v1.ContainerDevices"),
            ("cpu_ids", 3, T.TYPE_INT64, rep, ""), ("memory", 4, T.TYPE_MESSAGE, rep, ".v1.ContainerMemory"))
    message("ContainerMemory", ("memory_type", 1, T.TYPE_STRING, opt, ""), ("size", 2, T.TYPE_UINT64, opt, ""))
    message("ContainerDevices", ("resource_name", 1, T.TYPE_STRING, opt, ""),
            ("device_ids", 2, T.TYPE_STRING, rep, ""), ("topology", 3, T.TYPE_MESSAGE, opt, ".v1.TopologyInfo"))
    message("TopologyInfo", ("nodes", 1, T.TYPE_MESSAGE, rep, ".v1.NUMANode"))
    message("NUMANode", ("ID", 1, T.TYPE_INT64, opt, ""))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return {m.name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{m.name}"))
            for m in f.message_type}


M = upstream_messages()


def node_answer() -> Any:
    r = M["ListPodResourcesResponse"]()
    other = r.pod_resources.add(name="someone-else", namespace="ml")
    c = other.containers.add(name="server", cpu_ids=[0, 1])
    c.devices.add(resource_name="nvidia.com/gpu", device_ids=[A])
    ours = r.pod_resources.add(name="llm-0", namespace="ml")
    c = ours.containers.add(name="vllm", cpu_ids=[2, 3])
    c.memory.add(memory_type="memory", size=2**34)
    dev = c.devices.add(resource_name="nvidia.com/gpu", device_ids=[B, C])
    dev.topology.nodes.add(ID=1)
    c.devices.add(resource_name="example.com/nic", device_ids=["nic-7"])
    ours.containers.add(name="gpu-watchdog")  # the sidecar asks for no GPU
    same_name = r.pod_resources.add(name="llm-0", namespace="other-team")
    same_name.containers.add(name="x").devices.add(resource_name="nvidia.com/gpu", device_ids=[D])
    return r


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    calls: list[str] = []

    def list_pods(request: Any, context: grpc.ServicerContext) -> Any:
        calls.append("List")
        return node_answer()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
        "List": grpc.unary_unary_rpc_method_handler(
            list_pods, request_deserializer=M["ListPodResourcesRequest"].FromString,
            response_serializer=lambda m: m.SerializeToString()),
    })])
    socket = tmp_path / "kubelet.sock"
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    try:
        yield str(socket), calls
    finally:
        server.stop(grace=None)


def test_the_pods_gpus_from_every_container(kubelet: tuple[str, list[str]]) -> None:
    socket, calls = kubelet
    assert list_pod_gpus(socket, "llm-0", "ml", timeout=5) == (B, C)
    assert list_pod_gpus(socket, "llm-0", "other-team", timeout=5) == (D,)
    assert list_pod_gpus(socket, "not-on-this-node", "ml", timeout=5) is None
    assert calls == ["List", "List", "List"]


def test_a_missing_socket_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nothing.sock"
    with pytest.raises(PodResourcesError, match="UNAVAILABLE") as info:
        list_pod_gpus(str(missing), "llm-0", "ml", timeout=2)
    assert str(missing) in str(info.value)


class FourGpuNode(FakeNvml):
    def __init__(self) -> None:
        super().__init__()
        self.visible = [A, B, C, D]
        self.used = {u: 2**30 for u in self.visible}

    def read(self, uuid: str) -> Any:
        r = super().read(A if uuid not in (A, B) else uuid)
        return type(r)(**{**r.__dict__, "uuid": uuid, "index": self.visible.index(uuid)})


def watchdog_settings(socket: str | None) -> Any:
    return from_mapping({
        "target": {"openai_url": "http://127.0.0.1:9", "metrics_url": None},
        "sampling": {"nvml_interval": "50ms"},
        "canary": {"interval": "10s", "timeout": "1s"},
        "restart": {"strategy": "none"},
        "kubernetes": {"pod_name": "llm-0", "namespace": "ml", "pod_resources_socket": socket},
        "server": {"host": "127.0.0.1", "port": 0},
    })


async def test_the_watchdog_samples_only_the_gpus_the_kubelet_gave_the_pod(kubelet: tuple[str, list[str]]) -> None:
    from gpu_watchdog.watchdog.edge.effects.restart import ReportOnlyRestarter

    socket, _ = kubelet
    wd = Watchdog(watchdog_settings(socket), ReportOnlyRestarter(), nvml_backend=FourGpuNode())
    await wd.start(serve_http=False)
    try:
        await asyncio.sleep(0.3)
        assert [g.uuid for g in wd.history.gpus] == [B, C]
        status = wd.status()
        assert status["gpus"]["ours"] == [B, C] and status["gpus"]["source"] == "kubelet"
        assert "gpus_unknown" not in status["states"]
    finally:
        await wd.stop()


async def test_without_the_kubelet_a_multi_gpu_node_is_reported_not_guessed(tmp_path: Path) -> None:
    from gpu_watchdog.watchdog.edge.effects.restart import ReportOnlyRestarter

    wd = Watchdog(watchdog_settings(str(tmp_path / "absent.sock")), ReportOnlyRestarter(),
                  nvml_backend=FourGpuNode())
    await wd.start(serve_http=False)
    try:
        await asyncio.sleep(0.3)
        status = wd.status()
        assert "gpus_unknown" in status["states"]
        assert status["gpus"]["ours"] is None and status["gpus"]["visible"] == 4
        assert "absent.sock" in (status["gpus"]["pod_resources_error"] or "")
        assert "4 GPUs visible and the pod's are unknown" in status["gpus"]["note"]
        assert [g.available for g in wd.history.gpus] == [False]  # nothing sampled as if it were ours
    finally:
        await wd.stop()


async def test_a_kubelet_that_answers_later_is_asked_again_with_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket may not be there yet, or refuse at first: asked again, ever less often, until it answers."""
    from gpu_watchdog.watchdog.core import edges
    from gpu_watchdog.watchdog.edge.effects.restart import ReportOnlyRestarter

    monkeypatch.setattr(edges, "POD_GPUS_RETRY_S", 0.05)
    calls: list[int] = []

    def kubelet_late() -> tuple[str, ...]:
        calls.append(1)
        if len(calls) < 3:
            raise PodResourcesError("kubelet PodResources socket /var/lib/kubelet/pod-resources/kubelet.sock: refused")
        return (B, C)

    wd = Watchdog(watchdog_settings(None), ReportOnlyRestarter(), nvml_backend=FourGpuNode(), pod_gpus=kubelet_late)
    await wd.start(serve_http=False)
    try:
        assert "refused" in (wd.status()["gpus"]["pod_resources_error"] or "")
        await asyncio.sleep(0.6)  # 0.05 + 0.1 + ...: the third call answers
        status = wd.status()
        assert len(calls) == 3 and status["gpus"]["ours"] == [B, C] and status["gpus"]["source"] == "kubelet"
        assert status["gpus"]["pod_resources_error"] is None
        # Two refusals, the wait doubled after each.
        assert wd.history.edge.pod_gpus_tries == 2 and [edges.pod_gpus_wait(n) for n in (1, 2, 3)] == [0.05, 0.1, 0.2]
    finally:
        await wd.stop()
