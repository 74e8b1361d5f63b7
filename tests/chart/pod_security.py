"""The Pod Security Standards' baseline and restricted checks, as the PodSecurity admission applies them.

From https://kubernetes.io/docs/concepts/security/pod-security-standards/ (the controls a chart
can trip; Windows, AppArmor, SELinux, sysctls and /proc mount types are left out because the
chart sets none of them). A pod the namespace's level rejects never starts: the ReplicaSet only
records FailedCreate.
"""

from __future__ import annotations

from typing import Any

LEVELS = ("privileged", "baseline", "restricted")
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]


def baseline(pod: dict[str, Any]) -> list[str]:
    out = [f"spec.{k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    out += [f"volume {v['name']}: hostPath" for v in pod.get("volumes", []) if "hostPath" in v]
    for c in _containers(pod):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"{c['name']}: adds capabilities {sorted(added - BASELINE_CAPABILITIES)}")
        out += [f"{c['name']}: hostPort {p['hostPort']}" for p in c.get("ports", []) if p.get("hostPort")]
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{c['name']}: seccomp Unconfined")
    if ((pod.get("securityContext") or {}).get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append("pod: seccomp Unconfined")
    return out


def restricted(pod: dict[str, Any]) -> list[str]:
    out = baseline(pod)
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: type {sorted(kinds)} not allowed")
    psc = pod.get("securityContext") or {}
    if psc.get("runAsUser") == 0:
        out.append("pod: runAsUser 0")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    for c in _containers(pod):
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot must be true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        if (sc.get("seccompProfile") or {}).get("type", pod_seccomp) not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: may add only NET_BIND_SERVICE")
    return out


def violations(pod: dict[str, Any], level: str) -> list[str]:
    """What the PodSecurity admission at `level` would reject in this pod spec."""
    if level == "privileged":
        return []
    return restricted(pod) if level == "restricted" else baseline(pod)
