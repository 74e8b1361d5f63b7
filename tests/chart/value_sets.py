"""The values a release is installed with in several chart tests (every monitoring object on, each engine,
a namespace that admits the privileged PodResources mount), and the PodSecurity level each must pass,
kept once so that every chart test renders the same installs."""

from __future__ import annotations

from typing import Any

ALL_ON: dict[str, Any] = {
    "prometheusRelease": "kube-prometheus-stack",
    "serviceMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "dashboard": {"enabled": True},
}
VLLM: dict[str, Any] = {"inference": {"engine": "vllm", "model": {"source": "pvc", "pvc": {"claimName": "models"}}},
                        "vllm": {"servedModelName": "llama", "args": ["--max-num-seqs", "64"]}}
EXTERNAL: dict[str, Any] = {"inference": {"engine": "external"},
                            "external": {"image": {"repository": "ghcr.io/huggingface/text-generation-inference",
                                                   "tag": "3.3.4"}, "args": ["--model-id", "/models/m", "--port",
                                                                             "8080"], "port": 8080}}
HF_VLLM: dict[str, Any] = {"inference": {"engine": "vllm"}, "vllm": {"model": "meta-llama/Llama-3.1-8B-Instruct"}}
PRIVILEGED_PR: dict[str, Any] = {**VLLM, "podSecurityLevel": "privileged",
                                 "watchdog": {"podResources": {"runAsRoot": True}}}

ADMITTED = [
    ("restricted", {}), ("restricted", ALL_ON), ("restricted", VLLM), ("restricted", HF_VLLM),
    ("restricted", EXTERNAL), ("baseline", VLLM),
    ("privileged", PRIVILEGED_PR),
]
