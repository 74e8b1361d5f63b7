"""Which GPUs this pod got, from the kubelet's PodResources API (as dcgm-exporter learns it).

gRPC over the kubelet's unix socket, service `v1.PodResourcesLister`, method `List` (GA since
Kubernetes 1.28; `Get` is still beta). The messages are declared here from the upstream
`k8s.io/kubelet/pkg/apis/podresources/v1/api.proto`, with only the fields we read and their
upstream field numbers, so no generated code has to match the installed protobuf runtime.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from gpu_watchdog.watchdog.core.settings import Settings

SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST_METHOD = "/v1.PodResourcesLister/List"
GPU_RESOURCE_PREFIX = "nvidia.com/"  # nvidia.com/gpu, and MIG slices as nvidia.com/mig-*

@functools.cache
def messages() -> dict[str, Any]:
    # protobuf at the first question to the kubelet: a sidecar that never asks does not carry it.
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    _T = descriptor_pb2.FieldDescriptorProto
    f = descriptor_pb2.FileDescriptorProto(name="gpu_watchdog/podresources_v1.proto", package="v1",
                                           syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = f.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            field = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                field.type_name = type_name

    opt, rep = _T.LABEL_OPTIONAL, _T.LABEL_REPEATED
    message("ListPodResourcesRequest")
    message("ListPodResourcesResponse", ("pod_resources", 1, _T.TYPE_MESSAGE, rep, ".v1.PodResources"))
    message("PodResources", ("name", 1, _T.TYPE_STRING, opt, ""), ("namespace", 2, _T.TYPE_STRING, opt, ""),
            ("containers", 3, _T.TYPE_MESSAGE, rep, ".v1.ContainerResources"))
    message("ContainerResources", ("name", 1, _T.TYPE_STRING, opt, ""),
            ("devices", 2, _T.TYPE_MESSAGE, rep, ".v1.ContainerDevices"))
    message("ContainerDevices", ("resource_name", 1, _T.TYPE_STRING, opt, ""),
            ("device_ids", 2, _T.TYPE_STRING, rep, ""))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{name}"))
            for name in ("ListPodResourcesRequest", "ListPodResourcesResponse", "PodResources",
                         "ContainerResources", "ContainerDevices")}



class PodResourcesError(Exception):
    """The kubelet could not be asked, or did not answer."""


def pod_gpus(response: Any, pod: str, namespace: str) -> tuple[str, ...] | None:
    """The GPU device ids (UUIDs) of every container of `pod`; None when the pod is not listed."""
    for p in response.pod_resources:
        if p.name == pod and p.namespace == namespace:
            ids = [d for c in p.containers for dev in c.devices if dev.resource_name.startswith(GPU_RESOURCE_PREFIX)
                   for d in dev.device_ids]
            return tuple(dict.fromkeys(ids))  # in order, once each
    return None


def list_pod_gpus(socket_path: str, pod: str, namespace: str, timeout: float) -> tuple[str, ...] | None:
    """Blocking: call it from a thread."""
    import grpc

    try:
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            call = channel.unary_unary(LIST_METHOD, request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=messages()["ListPodResourcesResponse"].FromString)
            response = call(messages()["ListPodResourcesRequest"](), timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        raise PodResourcesError(f"{socket_path}: {getattr(code, 'name', code)}: {details}") from None
    return pod_gpus(response, pod, namespace)


def pod_gpus_reader(settings: Settings) -> Callable[[], tuple[str, ...] | None]:
    """What the watchdog asks for its pod's GPUs: the kubelet where a socket is configured, else nobody."""
    k = settings.kubernetes
    if k.pod_resources_socket is None:
        return lambda: None
    return functools.partial(list_pod_gpus, k.pod_resources_socket, k.pod_name, k.namespace, k.request_timeout)
