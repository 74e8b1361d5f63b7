"""The watchdog's vocabulary, defined once: restart reasons, flush reasons, states, error classes.

The policy decides with these names, the metrics pre-create their label values from them, the
alert rules and the dashboard match them, and the tests import them rather than spelling them.
"""

from __future__ import annotations

from gpu_watchdog.contract import CANARY_ERROR_CLASSES

# Why a pod is restarted (`gpu_watchdog_restarts_total{reason}`).
CONTEXT_LOSS = "context_loss"
HANG = "hang"
FRAGMENTATION_DRIFT = "fragmentation_drift"
MAX_AGE = "max_age"
STARTUP_TIMEOUT = "startup_timeout"
UNSERVABLE = "unservable"
# The process answers, and its answers are wrong: probes deviating from the fleet's agreed reference.
CORRUPT = "corrupt"
RESTART_REASONS = (CONTEXT_LOSS, HANG, FRAGMENTATION_DRIFT, MAX_AGE, STARTUP_TIMEOUT, UNSERVABLE, CORRUPT)

# How a restart is carried out, cheapest first (`gpu_watchdog_restarts_total{rung}`): one worker of
# several (told to exit, its server starts it again, the others serving), the inference container
# in place (same pod, same GPU, model files in the page cache), the pod (rescheduled), or the child
# process of `gpu-watchdog up`.
RUNG_WORKER, RUNG_CONTAINER, RUNG_POD, RUNG_PROCESS = "worker", "container", "pod", "process"
RUNGS = (RUNG_WORKER, RUNG_CONTAINER, RUNG_POD, RUNG_PROCESS)

# Why the allocator cache is flushed (`gpu_watchdog_empty_cache_total{reason}`).
MEMORY_PRESSURE = "memory_pressure"
OOM = "oom"
EMPTY_CACHE_REASONS = (MEMORY_PRESSURE, OOM, FRAGMENTATION_DRIFT)

# How a canary failed (`gpu_watchdog_canary_failures_total{error_class}`).
ERROR_CLASSES = CANARY_ERROR_CLASSES
# Failures the server answered itself (as opposed to silence or a closed port).
ANSWERED_ERRORS = ("oom", "other")

# What the watchdog says about its target (`gpu_watchdog_state{state}`).
HEALTHY = "healthy"
STARTING = "starting"
SATURATED = "saturated"
# Canaries time out and the server's work counter, readable before, cannot be read now.
PROGRESS_UNKNOWN = "progress_unknown"
CANARY_FAILING = "canary_failing"
TARGET_UNREACHABLE = "target_unreachable"
RESTARTING = "restarting"
# The server answers its canary but admits nothing (drained by us, an operator or its shutdown).
DRAINING = "draining"
BUDGET_EXHAUSTED = "budget_exhausted"
NVML_UNAVAILABLE = "nvml_unavailable"
GPUS_UNKNOWN = "gpus_unknown"
SERVER_METRICS_UNAVAILABLE = "server_metrics_unavailable"
GPU_SUSPECT = "gpu_suspect"
# A restart decided and waiting for permission (the disruption budget), the server serving meanwhile.
RESTART_WAITING = "restart_waiting"
# The last restart was not carried out because its Event could not be written.
RESTART_NOT_RECORDED = "restart_not_recorded"
# A decision's outcome when the restart budget refuses it.
BLOCKED_BY_BUDGET = "blocked_by_budget"
# A restart held by the workload's ledger: every slot taken (at most max_unavailable restarting), the
# breaker open (a fault a restart does not cure, fleet-wide), or the ledger unreadable (fail safe).
FLEET_UNAVAILABLE_LIMIT = "fleet_unavailable_limit"
FLEET_BREAKER_OPEN = "fleet_breaker_open"
FLEET_LEDGER_UNKNOWN = "fleet_ledger_unknown"
FLEET_HOLDS = (FLEET_UNAVAILABLE_LIMIT, FLEET_BREAKER_OPEN, FLEET_LEDGER_UNKNOWN)
STATES = (HEALTHY, STARTING, SATURATED, PROGRESS_UNKNOWN, CANARY_FAILING, TARGET_UNREACHABLE, RESTARTING,
          BUDGET_EXHAUSTED, NVML_UNAVAILABLE, GPUS_UNKNOWN, SERVER_METRICS_UNAVAILABLE, GPU_SUSPECT,
          RESTART_WAITING, RESTART_NOT_RECORDED, DRAINING, *FLEET_HOLDS)

# Which server the target's /metrics belong to (`server` label).
SERVER_KINDS = ("vllm", "tgi", "sglang", "bundled", "unknown")

# What keeping a card out of placement did (gpu_watchdog_placement_actions_total's `action`).
PLACEMENT_ACTIONS = ("tainted", "would_taint", "capped", "lifted", "failed", "not_possible")
# The DRA drivers whose devices are GPUs (NVIDIA's DRA driver): a pod's other DRA devices (a NIC) are
# never taken for its GPU.
GPU_DRIVERS = ("gpu.nvidia.com",)

# What the sidecar may do in earnest (`policy.enforce`): an action names every rule that takes it, a
# reason (RESTART_REASONS, EMPTY_CACHE_REASONS, RECOVERED) the restarts, flushes and admission changes
# it decides; the quarantine and placement are enforced by their action's name alone. The rest is
# shadow: decided, recorded and reported as it would be, and not performed.
RESTART, EMPTY_CACHE, ADMISSION, QUARANTINE, PLACEMENT = "restart", "empty_cache", "admission", "quarantine", \
    "placement"
ENFORCEABLE_ACTIONS = (RESTART, EMPTY_CACHE, ADMISSION, QUARANTINE, PLACEMENT)
RECOVERED = "recovered"  # why the admission limit grows back
ENFORCE_ALL, ENFORCE_SHADOW = "all", "shadow"
ENFORCEABLE = (ENFORCE_ALL, ENFORCE_SHADOW, *ENFORCEABLE_ACTIONS,
               *dict.fromkeys((*RESTART_REASONS, *EMPTY_CACHE_REASONS, RECOVERED)))
# A decision's outcome when it is shadow: reported as it would have been carried out, nothing done.
WOULD = "would"

