"""Prometheus metrics of the inference process (prefix `gpu_inference_`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class InferenceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("gpu_inference_requests", "Requests answered, by route and status code",
                                ["route", "code"], registry=r)
        self.duration = Histogram("gpu_inference_request_duration_seconds", "Request latency", ["route"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge("gpu_inference_inflight_requests", "Requests admitted and running", registry=r)
        self.queued = Gauge("gpu_inference_queued_requests", "Requests waiting for admission", registry=r)
        self.admission_limit = Gauge("gpu_inference_admission_limit",
                                     "Concurrent worst-case requests the memory budget admits", registry=r)
        self.ooms = Counter("gpu_inference_ooms", "CUDA out-of-memory errors caught", registry=r)
        self.batch_size = Histogram("gpu_inference_batch_size", "Sequences per forward batch",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.tokens = Counter("gpu_inference_generated_tokens", "Tokens generated", registry=r)
        # Counted a prefill pass (or a long prompt's chunk) at a time: with the generated tokens, the
        # watchdog's proof of progress, which a long prefill on an idle server would otherwise lack.
        self.prompt_tokens = Counter("gpu_inference_prompt_tokens",
                                     "Prompt tokens computed by prefill (those from the prefix cache not counted)",
                                     registry=r)
        self.empty_cache = Counter("gpu_inference_empty_cache", "Allocator cache flushes", registry=r)
        self.quarantined = Counter("gpu_inference_quarantined",
                                   "Requests refused (422) because their fingerprint is quarantined: in flight at"
                                   " failures of the workload", registry=r)
        self.fatal = Counter("gpu_inference_fatal_errors", "Sticky CUDA errors that poisoned the process",
                             registry=r)
        self.nonfinite = Counter("gpu_inference_nonfinite",
                                 "Steps whose logits held NaN or infinities (their sequences failed, never answered)",
                                 registry=r)
        self.prefix_queried = Counter("gpu_inference_prefix_cache_queried_tokens",
                                      "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("gpu_inference_prefix_cache_hit_tokens",
                                   "Prompt tokens whose keys and values came from the prefix cache", registry=r)

    def prefix_lookup(self, queried: int, hit: int) -> None:
        self.prefix_queried.inc(queried)
        self.prefix_hits.inc(hit)
